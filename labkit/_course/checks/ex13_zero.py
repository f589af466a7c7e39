"""Exercise 13-zero: ZeRO's optimizer step by hand (reduce-scatter, update the slice, all-gather),
proven equal to DDP, its collectives counted and its gradient bytes measured."""

from __future__ import annotations

from dataclasses import dataclass

from labkit._course.checks._common import _metrics, _on, _ranks
from labkit._course.attempt import launched
from labkit._course.feedback import Feedback, check

EXERCISE = "13-zero"

HINTS = [
    "Each rank updates only its slice, so it needs only its slice of the summed gradient: that is a "
    "reduce-scatter. Flatten every p.grad into one vector with torch.cat, add `padding` zeros so that it "
    "splits into world_size equal slices, then dist.reduce_scatter_single(shard.grad, grads) with "
    "shard.grad = torch.empty_like(shard).",
    "A reduce-scatter sums; DDP averages: divide shard.grad by world_size. Then set every p.grad to None: "
    "this rank needs its slice of the gradient only, and the whole gradients are what ZeRO-2 saves.",
    "optimizer.step() updates shard, a view into flat: only this rank's slice of the weights changes. "
    "Then dist.all_gather_single(flat, shard) brings every rank's updated slice to every rank: after the "
    "step, never before it.",
]

#: How far ZeRO's numbers may be from DDP's: on CPU they are equal (a sum of two numbers is the
#: same in any order); GPUs' collectives may add in another order.
TOLERANCE = {"cpu": 1e-6, "cuda": 1e-4}
VALUE_BYTES = 4  # float32
COLUMNS = ["numel", "padding", "slice_values", "own_gap", "other_gap", "grad_gap", "grad_ratio", "grad_bytes"]


@dataclass
class _Logged:
    """What the ranks logged: the buffer's sizes (rank 0's), and every step of every rank."""

    steps: object  # DataFrame: one row per rank and step, with the collectives counted
    world: int
    numel: int
    padding: int
    size: int  # values in one slice
    device: str

    @property
    def buffer_bytes(self) -> int:
        return (self.numel + self.padding) * VALUE_BYTES

    def first(self):
        """The first step's rows: its gradient depends on the initial weights only."""
        return self.steps[self.steps["step"] == self.steps["step"].min()]

    def calls(self, kind: str):
        column = f"calls_{kind}"
        return self.steps[column].fillna(0) if column in self.steps else self.steps["step"] * 0


@check
def check_zero(target="scripts/ex13_zero.py", *, timeout_s: float = 300) -> Feedback:
    """Exercise 13-zero: the learner's ZeRO step makes one reduce-scatter and one all-gather of the
    whole padded buffer per step, gives each rank its slice of DDP's mean gradient, keeps every
    weight equal to DDP's after every step, and leaves only the slice of the gradient in memory
    (2 ranks; every GPU, if there are two or more).

    The script trains a DDP copy of the same model beside it and logs the gaps; the check reads
    them, the collectives ``labkit.comm.count_collectives`` counted around the step, and the
    gradient bytes ``labkit.memory.storage_bytes`` measured after it.

    Args:
        target: the exercise's script, or a finished Run of it.
        timeout_s: seconds the launch may take.

    Returns:
        a Feedback; a mistake in the script is a finding, never an exception.

    Example (exercises/13_zero.ipynb)::

        labkit.check_zero("scripts/ex13_zero.py")
    """
    feedback, run = launched(EXERCISE, target, timeout_s=timeout_s, name="check-13-zero", **_ranks(2))
    logged = _read(feedback, run)
    gathered = _collectives(feedback, logged)
    gradient_right = _gradient(feedback, logged)
    _weights(feedback, logged, gathered, gradient_right)
    _memory(feedback, logged)
    return feedback


def _read(feedback: Feedback, run) -> _Logged:
    """Every column the check reads, from every rank; stops naming the ranks that left one out."""
    df = _metrics(feedback, run, COLUMNS)
    config = df.dropna(subset=["numel"])
    steps = df.dropna(subset=["own_gap"])
    silent = sorted(set(range(run.nproc)) - set(steps["rank"]))
    if silent or config.empty:
        feedback.stop(f"{_on(silent or range(run.nproc), run.nproc)} did not log every step (did the run stop "
                      f"early?): keep the skeleton's metrics.log(...) lines.")
    first = config[config["rank"] == config["rank"].min()].iloc[0]
    return _Logged(steps, run.nproc, numel=int(first["numel"]), padding=int(first["padding"]),
                   size=int(first["slice_values"]), device=str(run.info.get("device", "cpu")))


def _collectives(feedback: Feedback, logged: _Logged) -> bool:
    """One reduce-scatter and one all-gather of the whole padded buffer per step, nothing else.
    True when the step all-gathers."""
    steps, size = logged.steps, logged.buffer_bytes
    all_reduces, scatters, gathers = (logged.calls(k) for k in ("all_reduce", "reduce_scatter", "all_gather"))
    if (all_reduces > 0).any():
        feedback.fail(f"you all-reduced the whole gradient ({size:,} bytes, every rank getting every value): each "
                      f"rank updates only its slice, so it needs only its slice of the sum. "
                      f"dist.reduce_scatter_single(shard.grad, grads) gives it that, and a rank then sends half the "
                      f"bytes an all-reduce sends.", hint=1)
    elif (scatters == 0).any():
        feedback.fail("no step averaged the gradients over the ranks: reduce-scatter them into shard.grad.", hint=1)
    gathered = bool((gathers > 0).all())
    if not gathered:
        feedback.fail("no rank ever received the others' updated slices: after optimizer.step(), "
                      "dist.all_gather_single(flat, shard).", hint=3)
    if (all_reduces > 0).any() or (scatters == 0).any() or not gathered:
        return gathered
    extra = [c.removeprefix("calls_") for c in steps.columns if c.startswith("calls_")
             and c not in ("calls_reduce_scatter", "calls_all_gather") and steps[c].fillna(0).gt(0).any()]
    sizes = {int(b) for k in ("reduce_scatter", "all_gather") for b in steps[f"bytes_{k}"].fillna(0)}
    feedback.expect((scatters == 1).all() and (gathers == 1).all() and not extra and sizes == {size},
                    f"each step made one reduce-scatter and one all-gather, each of the whole padded buffer "
                    f"({size:,} bytes): the two halves of DDP's all-reduce, in another order",
                    f"each step should make one reduce-scatter and one all-gather of {size:,} bytes each; the run "
                    f"made {int(scatters.max())} and {int(gathers.max())} a step"
                    + (f", and {', '.join(extra)}" if extra else "") + f", of {sorted(sizes)} bytes: "
                    f"reduce-scatter the whole flat gradient once, and all-gather flat once.", hint=1)
    return gathered


def _gradient(feedback: Feedback, logged: _Logged) -> bool:
    """Each rank's shard.grad against its slice of DDP's mean gradient, at the first step: later
    gradients depend on the weights, which ``_weights`` judges. True when right."""
    tolerance = TOLERANCE.get(logged.device, TOLERANCE["cuda"])
    steps = logged.first()
    if steps["grad_gap"].isna().any():
        feedback.fail("after your step shard.grad holds no gradient: put the reduce-scatter's output into "
                      "shard.grad = torch.empty_like(shard), so that the optimizer steps with it.", hint=1)
        return False
    gap = float(steps["grad_gap"].max())
    if gap <= tolerance:
        feedback.ok(f"shard.grad is this rank's slice of DDP's mean gradient, on every rank (within {gap:.1e}; "
                    f"tolerance {tolerance:g})")
        return True
    ratio = float(steps["grad_ratio"].median())
    if abs(ratio - logged.world) < 0.01 * logged.world:
        feedback.fail(f"your slice of the gradient is {ratio:.2f} times DDP's mean: a reduce-scatter sums over the "
                      f"{logged.world} ranks, and DDP averages. Divide shard.grad by world_size.", hint=2)
    else:
        feedback.fail(f"shard.grad differs from this rank's slice of DDP's mean gradient by up to {gap:.2e} (its "
                      f"size is {ratio:.2f} times the right one): flatten the gradients in the order of params, add "
                      f"the padding, and reduce-scatter them.", hint=1)
    return False


def _weights(feedback: Feedback, logged: _Logged, gathered: bool, gradient_right: bool) -> None:
    """Every weight against DDP's, after every step: this rank's slice, and the others'."""
    tolerance = TOLERANCE.get(logged.device, TOLERANCE["cuda"])
    own, other = float(logged.steps["own_gap"].max()), float(logged.steps["other_gap"].max())
    first = logged.first()
    if max(own, other) <= tolerance:
        feedback.ok(f"after every step every weight equals DDP's, on every rank (within {max(own, other):.1e})")
    elif not gradient_right or not gathered:
        return  # the findings above are the cause
    elif float(first["own_gap"].max()) <= tolerance:
        feedback.fail(f"this rank's own slice of the weights equals DDP's, but the other ranks' slices are a step "
                      f"behind (up to {float(first['other_gap'].max()):.1e} off after the first): you gathered the slices before optimizer.step(). Gather "
                      f"after it, when every slice holds its new values.", hint=3)
    else:
        feedback.fail(f"after the step the weights differ from DDP's by up to {max(own, other):.1e}: step the "
                      f"optimizer once, on shard, with shard.grad set; then all-gather.", hint=3)


def _memory(feedback: Feedback, logged: _Logged) -> None:
    """The gradient bytes held after the step: the slice only."""
    slice_bytes = logged.size * VALUE_BYTES
    held = int(logged.steps["grad_bytes"].max())
    if held == slice_bytes:
        feedback.ok(f"after the step this rank holds {held:,} bytes of gradient: its slice, 1/{logged.world} of "
                    f"the whole {logged.numel * VALUE_BYTES:,}")
    elif held >= logged.numel * VALUE_BYTES:
        feedback.fail(f"after the step this rank still holds the whole gradients ({held:,} bytes, not its slice's "
                      f"{slice_bytes:,}): set every p.grad to None once the reduce-scatter has its slice, and keep "
                      f"no whole copy (a slice of an all-reduced buffer keeps the whole buffer alive).", hint=2)
    else:
        feedback.fail(f"after the step this rank holds {held:,} bytes of gradient; its slice is {slice_bytes:,}: "
                      f"keep shard.grad, and set every p.grad to None.", hint=2)
