"""Exercise 11-tp-plan: a tensor-parallel plan for a gated MLP, proved against one process, its
collectives counted and predicted."""

from __future__ import annotations

from dataclasses import dataclass

from labkit._course.checks._common import _metrics, _on, _ranks
from labkit._course.attempt import launched
from labkit._course.feedback import Feedback, check

EXERCISE = "11-tp-plan"

HINTS = [
    "Each rank should compute silu(gate(h)) * up(h) for its own hidden units, with nothing from "
    "the other ranks: silu and the product act unit by unit. So cut gate and up alike: which way of "
    "cutting a Linear gives each rank whole output units?",
    "gate and up are cut by their outputs, ColwiseParallel(). down reads the hidden layer, which they "
    "have already cut across the ranks: cut down by its inputs, RowwiseParallel(). Each rank then "
    "holds a partial sum of the whole output, and one all-reduce per block adds them up.",
    "PLAN = {\"gate\": ColwiseParallel(), \"up\": ColwiseParallel(), \"down\": RowwiseParallel()}. "
    "Forward: one all-reduce per block, of down's partial sums. Backward: each layer cut by its "
    "outputs all-reduces the gradient of its own input, and h feeds two of them, gate and up: two "
    "per block. Each carries batch × dim float32 numbers: PREDICTED = {\"forward_all_reduces\": "
    "args.depth, \"backward_all_reduces\": 2 * args.depth, \"bytes_per_all_reduce\": "
    "args.batch_size * args.dim * 4}.",
]

LAYERS = ("gate", "up", "down")
#: nn.Linear stores its weight as (outputs, inputs): a cut by outputs (ColwiseParallel) is
#: Shard(dim=0) of the weight, a cut by inputs (RowwiseParallel) is Shard(dim=1).
BY_OUTPUTS, BY_INPUTS = "Shard(dim=0)", "Shard(dim=1)"
#: How far the split model may be from one process, relative to the largest value: float32
#: sums added in another order (CPU), or GPU kernels that round differently (see lesson 11).
TOLERANCE = {"cpu": 1e-5, "cuda": 1e-3}
PREDICTIONS = ("forward_all_reduces", "backward_all_reduces", "bytes_per_all_reduce")
COLUMNS = ["dim", "depth", "batch_size", *(f"{name}_placement" for name in LAYERS),
           *(f"predicted_{p}" for p in PREDICTIONS), "output_gap", "grad_gap"]


@dataclass
class _Logged:
    """What the ranks logged: the settings and placements (rank 0's), and each rank's numbers."""

    rows: dict  # {rank: {column: the first value that rank logged}}
    world: int
    device: str

    def __getitem__(self, column):
        return self.rows[0][column]

    def cut(self, name: str) -> str:
        """'outputs', 'inputs' or 'none': how rank 0's ``name`` weight is cut."""
        placement = str(self[f"{name}_placement"])
        return "outputs" if BY_OUTPUTS in placement else "inputs" if BY_INPUTS in placement else "none"

    def ideal(self) -> dict:
        """What the right plan makes: one all-reduce per block in forward, two in backward (gate's
        and up's gradients of h), each of batch × dim float32 numbers."""
        depth, batch, dim = int(self["depth"]), int(self["batch_size"]), int(self["dim"])
        return {"forward_all_reduces": depth, "backward_all_reduces": 2 * depth,
                "bytes_per_all_reduce": batch * dim * 4}


def _plan_findings(cuts: dict, world: int) -> list[tuple[bool, str, int | None]]:
    """(right, what it says, hint) about each layer's cut, from {layer: 'outputs'|'inputs'|'none'}
    on ``world`` ranks."""
    if all(cut == "none" for cut in cuts.values()):
        return [(False, "nothing is cut, so every rank holds all of gate, up and down and computes the whole "
                        "block. Give PLAN an entry for each layer, named as in the block: gate, up, down.", 1)]
    findings = []
    for name in ("gate", "up"):
        if cuts[name] == "inputs":
            findings.append((False, f"{name} is cut by its inputs (RowwiseParallel): each rank then holds a partial "
                                    f"sum of every hidden unit, and silu of a partial sum is not a part of silu. "
                                    f"Cut gate and up by their outputs, ColwiseParallel.", 1))
        elif cuts[name] == "none":
            other = "up" if name == "gate" else "gate"
            findings.append((False, f"{name} is not cut (every rank holds all of it) while {other} is, and "
                                    f"silu(gate(h)) * up(h) multiplies the two unit by unit. Cut gate and up alike, "
                                    f"by their outputs (is {name} in PLAN, spelled as in the block?).", 1))
    if cuts["down"] == "outputs":
        findings.append((False, "down is cut by its outputs (ColwiseParallel), but its input, the hidden layer, is "
                                "already cut across the ranks by gate and up: cut down by its inputs, "
                                "RowwiseParallel.", 2))
    elif cuts["down"] == "none":
        findings.append((False, "down is not cut (every rank holds all of it), but its input, the hidden layer, is "
                                "cut across the ranks by gate and up. Cut down by its inputs, RowwiseParallel.", 2))
    if not findings:
        findings.append((True, f"gate and up are cut by their outputs and down by its inputs: each rank holds "
                               f"1/{world} of each matrix, and computes its own slice of the hidden layer", None))
    return findings


def _explain_the_crash(feedback: Feedback, target) -> None:
    """The launch failed: if the ranks logged their plan before they stopped, say what is wrong with it."""
    if feedback.failure is None or feedback.failure.exc_type in ("", "NotImplementedError"):
        return
    try:
        df = feedback.run.metrics()
        row = df.dropna(subset=[f"{name}_placement" for name in LAYERS])
        row = row[row["rank"] == 0].iloc[0]
    except Exception:  # noqa: BLE001 - no plan logged: the crash's own message says what there is to say
        return
    cuts = {name: _Logged({0: row.to_dict()}, 1, "cpu").cut(name) for name in LAYERS}
    wrong = [(text, hint) for right, text, hint in _plan_findings(cuts, feedback.run.nproc) if not right]
    for text, hint in wrong:
        feedback.fail(f"the run stopped because {text}", hint=hint)


@check
def check_tp_plan(target="scripts/ex11_tp_plan.py", *, timeout_s: float = 300) -> Feedback:
    """Exercise 11-tp-plan: each matrix of the gated block is cut as tensor parallelism needs, the
    split model's output and gradients equal one process's within a stated tolerance, its
    collectives are the all-reduces the plan should make, and the learner predicted them
    (every GPU when there are two or more, else ``LABKIT_RANKS`` CPU ranks: 2 unless set).

    The script computes one process's output and gradients itself, on an unsplit copy of the
    same weights, and logs how far the split model is from them; the check reads those gaps,
    each weight's placement, and the collectives counted by ``labkit.comm.count_collectives``.

    Args:
        target: the exercise's script, or a finished Run of it.
        timeout_s: seconds the launch may take.

    Returns:
        a Feedback; a mistake in the script is a finding, never an exception.

    Example (exercises/11_tensor_parallel.ipynb)::

        labkit.check_tp_plan("scripts/ex11_tp_plan.py")
    """
    feedback, run = launched(EXERCISE, target, timeout_s=timeout_s, name="check-11-tp-plan",
                             explain=_explain_the_crash, **_ranks(2))
    logged = _read(feedback, run)
    plan_right = _plan(feedback, logged)
    _same_numbers(feedback, logged, plan_right)
    _collectives(feedback, logged, plan_right)
    _prediction(feedback, logged)
    return feedback


def _read(feedback: Feedback, run) -> _Logged:
    """Every column the check reads, from every rank; stops naming the ranks that left one out."""
    df = _metrics(feedback, run, COLUMNS)
    counts = [c for c in df.columns if c.startswith(("forward_", "backward_", "bytes_"))]
    rows = {rank: {c: group[c].dropna().iloc[0] for c in [*COLUMNS, *counts] if group[c].notna().any()}
            for rank, group in df.groupby("rank")}
    silent = sorted(r for r in range(run.nproc) if any(c not in rows.get(r, {}) for c in COLUMNS))
    if silent:
        feedback.stop(f"{_on(silent, run.nproc)} did not log all the check reads (did the run stop early?): keep "
                      f"the skeleton's metrics.log(...) lines.")
    return _Logged(rows, run.nproc, str(run.info.get("device", "cpu")))


def _plan(feedback: Feedback, logged: _Logged) -> bool:
    """Each layer's cut, as rank 0 logged it. True when the plan is the right one."""
    findings = _plan_findings({name: logged.cut(name) for name in LAYERS}, logged.world)
    for right, text, hint in findings:
        (feedback.ok if right else feedback.fail)(text, hint=hint)
    return all(right for right, _, _ in findings)


def _same_numbers(feedback: Feedback, logged: _Logged, plan_right: bool) -> None:
    """The split model's output and gradients, against one process's, on every rank."""
    tolerance = TOLERANCE.get(logged.device, TOLERANCE["cuda"])
    gaps = {r: max(float(row["output_gap"]), float(row["grad_gap"])) for r, row in logged.rows.items()}
    worst = max(gaps, key=gaps.get)
    if gaps[worst] <= tolerance:
        feedback.ok(f"the output and every gradient equal one process's, within {gaps[worst]:.1e} of the largest "
                    f"value (tolerance {tolerance:g}: the same sums, added in another order)")
    else:
        why = ("the plan above is the cause" if not plan_right else
               "keep the skeleton's lines outside the TODOs as they are: every rank must see the same x")
        feedback.fail(f"on {_on([worst], logged.world)} the output or a gradient differs from one process's by "
                      f"{gaps[worst]:.1e} of the largest value, far more than rounding ({tolerance:g}): {why}.",
                      hint=1 if not plan_right else None)


def _collectives(feedback: Feedback, logged: _Logged, plan_right: bool) -> None:
    """The collectives of one forward and one backward: only all-reduces, as many as the plan needs."""
    row, ideal = logged.rows[0], logged.ideal()
    made = {c: int(n) for c, n in row.items() if c.startswith(("forward_", "backward_")) and n == n and n}
    others = sorted({c.split("_", 1)[1] for c in made} - {"all_reduce"})
    if others:
        kinds = " and ".join(k.replace("_", "-") + "s" for k in others)
        counts = ", ".join(f"{n} {c.split('_', 1)[1].replace('_', '-')}s in {c.split('_', 1)[0]}"
                           for c, n in made.items())
        feedback.fail(f"the split model made {kinds} too ({counts}): a layer's output was gathered whole "
                      f"(output_layouts=Replicate()?). Cut gate and up by their outputs and down by its inputs, "
                      f"and a block needs nothing but all-reduces.", hint=2)
        return
    forward, backward = made.get("forward_all_reduce", 0), made.get("backward_all_reduce", 0)
    if not plan_right:
        return  # the plan's findings above say what is wrong; counting its collectives adds nothing
    size = int(row.get("bytes_all_reduce", 0)) // max(1, forward + backward)
    feedback.expect((forward, backward, size) == (ideal["forward_all_reduces"], ideal["backward_all_reduces"],
                                                  ideal["bytes_per_all_reduce"]),
                    f"one all-reduce per block in forward and two in backward: {forward} and {backward}, "
                    f"each of {size:,} bytes (batch × dim float32)",
                    f"the run made {forward} all-reduces in forward and {backward} in backward, each of {size:,} "
                    f"bytes; the plan should make {ideal['forward_all_reduces']} and "
                    f"{ideal['backward_all_reduces']}: keep the skeleton's lines outside the TODOs as they are.")


def _prediction(feedback: Feedback, logged: _Logged) -> None:
    """The learner's prediction, against what the right plan makes."""
    ideal = logged.ideal()
    predicted = {p: int(logged[f"predicted_{p}"]) for p in PREDICTIONS}
    depth, batch, dim = int(logged["depth"]), int(logged["batch_size"]), int(logged["dim"])
    if predicted == ideal:
        feedback.ok(f"your prediction is right: {ideal['forward_all_reduces']} all-reduces in forward, "
                    f"{ideal['backward_all_reduces']} in backward, {ideal['bytes_per_all_reduce']:,} bytes each")
    elif predicted["forward_all_reduces"] != ideal["forward_all_reduces"]:
        feedback.fail(f"you predicted {predicted['forward_all_reduces']} all-reduces in forward; there are "
                      f"{ideal['forward_all_reduces']}: one per block, which adds up down's partial sums "
                      f"({depth} blocks).", hint=3)
    elif predicted["backward_all_reduces"] != ideal["backward_all_reduces"]:
        if predicted["backward_all_reduces"] == depth:
            feedback.fail(f"you predicted one all-reduce per block in backward; there are two ({2 * depth} in all): "
                          f"h is read by gate and by up, and each, cut by its outputs, all-reduces its own "
                          f"partial gradient of h.", hint=3)
        else:
            feedback.fail(f"you predicted {predicted['backward_all_reduces']} all-reduces in backward; there are "
                          f"{2 * depth}: two per block, one for each layer cut by its outputs (gate and up), "
                          f"for the gradient of its input h.", hint=3)
    elif predicted["bytes_per_all_reduce"] == batch * 4 * dim * 4:
        feedback.fail(f"an all-reduce carries the block's input or output, batch × dim = {batch} × {dim} float32 "
                      f"numbers ({ideal['bytes_per_all_reduce']:,} bytes), not the hidden layer (batch × 4·dim): "
                      f"the hidden layer stays cut.", hint=3)
    else:
        feedback.fail(f"you predicted {predicted['bytes_per_all_reduce']:,} bytes per all-reduce; each carries "
                      f"batch × dim = {batch} × {dim} float32 numbers, {ideal['bytes_per_all_reduce']:,} bytes.",
                      hint=3)
