"""Exercise 04-accumulation: gradient accumulation under DDP, against one big batch in one process."""

from __future__ import annotations

from dataclasses import dataclass

from labkit._course.checks._common import _config, _gap, _metrics, _near, _ranks, _saved
from labkit._course.attempt import launched
from labkit._course.feedback import Feedback, check

EXERCISE = "04-accumulation"

HINTS = [
    ".grad adds up across backward() calls until something clears it. So: k forward and "
    "backward passes, then one optimizer.step(), then optimizer.zero_grad(set_to_none=True). "
    "Divide each micro-step's loss by k, so that the sum of the k gradients is the big batch's mean.",
    "model.no_sync() is a context manager: inside it, backward() does not all-reduce. Use it for "
    "every micro-step but the last, around forward and backward both; the last backward "
    "all-reduces the sum of all k.",
    "for i, (x, y) in enumerate(micro_batches): with nullcontext() if i == k - 1 else "
    "model.no_sync(): (F.cross_entropy(model(x), y) / k).backward(). After the loop: "
    "optimizer.step(); optimizer.zero_grad(set_to_none=True).",
]

#: The settings the skeleton logs at step 0.
SETTINGS = ["accum_steps", "batch_size", "dim", "steps", "lr", "seed"]
#: Lesson 04's tolerance on the gradients and weights: float32 sums added in another order
#: (GPU kernels round otherwise).
TOLERANCE = {"cpu": 1e-5, "gpu": 1e-4}


def _accumulation_reference(seed: int, world_size: int, k: int, batch_size: int, dim: int, steps: int,
                            lr: float) -> dict:
    """One process, one big batch per optimizer step (every rank's k micro-batches together), plain SGD.

    The model and data are made exactly as exercise 04's skeleton makes them: the model from
    ``torch.manual_seed(seed)``, rank r's micro-batches from seed + 1 + r. Returns "grads" (the
    flat gradient of each step), "weights" (after the last step), and the first step's gradient
    as three mistakes would compute it: "unscaled" (k times), "local" (each rank's own, never
    all-reduced) and "last_only" (only the last micro-batch's, divided by k).
    """
    import torch
    import torch.nn.functional as F

    from labkit.models import MLPStack

    torch.manual_seed(seed)
    model = MLPStack(dim=dim, depth=1, in_features=dim)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    data = [torch.Generator().manual_seed(seed + 1 + r) for r in range(world_size)]

    def gradient(x, y, scale=1.0):
        optimizer.zero_grad(set_to_none=True)
        (F.cross_entropy(model(x), y) * scale).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    found = {"grads": []}
    for step in range(steps):
        micro = [[(torch.randn(batch_size, dim, generator=gen), torch.randint(0, 10, (batch_size,), generator=gen))
                  for _ in range(k)] for gen in data]
        mine = [(torch.cat([x for x, _ in m]), torch.cat([y for _, y in m])) for m in micro]
        if step == 0:
            found["local"] = [gradient(x, y) for x, y in mine]
            found["last_only"] = sum(gradient(*m[-1], scale=1 / k) for m in micro) / world_size
        grad = gradient(torch.cat([x for x, _ in mine]), torch.cat([y for _, y in mine]))
        if step == 0:
            found["unscaled"] = k * grad
        found["grads"].append(grad)
        optimizer.step()
    found["weights"] = torch.cat([p.detach().flatten() for p in model.parameters()])
    return found


def _explain_gradient(used: dict, reference: dict, k: int) -> tuple[str, int]:
    """Why the gradients the first optimizer.step() used ({rank: flat tensor}) are not one big batch's,
    and the hint about it: 2 for DDP's no_sync, else 1."""
    import torch

    if any(torch.isnan(g).any() for g in used.values()):
        return ("some parameters had no gradient when optimizer.step() ran (.grad was None): clear the gradients "
                "only after the step, never between the last backward() and optimizer.step()."), 1
    if all(_near(g, reference["unscaled"]) for g in used.values()):
        return (f"the gradient is {k}× too large: with the loss not divided by k, the {k} micro-batch gradients add "
                f"up to the sum of {k} means, not the mean of the effective batch. Call (loss / k).backward()."), 1
    if all(_near(g, reference["local"][r]) for r, g in used.items()):
        return ("each rank stepped with its own gradient, never averaged with the other ranks': with no_sync on "
                "the last micro-step too, DDP never all-reduces. Run the last micro-step outside model.no_sync()."), 2
    if all(_near(g, reference["last_only"]) for g in used.values()):
        return (f"only the last micro-batch's gradient (÷ {k}) reached optimizer.step(): zero_grad inside the "
                f"micro-step loop clears what the earlier micro-steps added. Clear the gradients once per optimizer "
                f"step, after optimizer.step()."), 1
    want = reference["grads"][0]
    gap = max(_gap(g, want) for g in used.values())
    return (f"the gradient of the first optimizer step differs from one big batch's by up to {gap:.1e} of the "
            f"largest gradient: add up the k micro-steps' gradients of (loss / k), all-reduced once, after the last."), 1


@dataclass
class _Steps:
    """What the ranks logged and saved for each optimizer step, and one process's big-batch reference."""

    setting: dict  # SETTINGS, as the skeleton logged them
    per_step: object  # the DataFrame rows of the optimizer steps: step_calls, allreduced_bytes, param_bytes
    saved: dict  # {rank: {"used": [gradient of each step], "weights": final weights}}
    reference: dict  # _accumulation_reference's
    world: int
    tolerance: float

    @property
    def k(self) -> int:
        return int(self.setting["accum_steps"])

    @property
    def steps(self) -> int:
        return int(self.setting["steps"])

    @property
    def effective(self) -> int:
        """Samples per optimizer step: every rank's k micro-batches."""
        return self.world * self.k * int(self.setting["batch_size"])


@check
def check_accumulation(target="scripts/ex04_accumulation.py", *, timeout_s: float = 180) -> Feedback:
    """Exercise 04-accumulation: k micro-steps under DDP make one optimizer step whose gradient is
    that of one batch k × world size times larger, with one all-reduce of the gradients per step.

    Launches the script on 2 ranks, or ``LABKIT_RANKS`` (every GPU, if there are two or more).
    A hook in the skeleton records the gradient each ``optimizer.step()`` call uses; a DDP communication hook counts the
    bytes all-reduced. The check builds the same model and draws the same seeded data itself,
    takes each optimizer step on one big batch (every rank's k micro-batches together) in one
    process, and compares: the calls to ``optimizer.step()``, the all-reduced bytes against the
    gradients' bytes, the gradient of every step, and the final weights on every rank.

    Args:
        target: the exercise's script, or a finished Run of it.
        timeout_s: seconds the launch may take.

    Returns:
        a Feedback; a mistake in the script is a finding, never an exception.

    Example (exercises/04_accumulation.ipynb)::

        labkit.check_accumulation("scripts/ex04_accumulation.py")
    """
    feedback, run = launched(EXERCISE, target, timeout_s=timeout_s, name="check-04-accumulation", **_ranks(2))
    steps = _read(feedback, run)
    calls = _step_calls(feedback, steps)
    _allreduces(feedback, steps)
    if calls == [1]:  # the gradient each optimizer.step() used is comparable when it steps once
        _gradients(feedback, steps)
    _weights(feedback, steps)
    return feedback


def _read(feedback: Feedback, run) -> _Steps:
    """The logged steps and saved tensors, and the reference; stops if the skeleton's loop was changed."""
    df = _metrics(feedback, run, [*SETTINGS, "step_calls", "allreduced_bytes", "param_bytes"])
    saved = _saved(feedback, run, "ex04")
    setting = _config(df, SETTINGS)
    steps, world = int(setting["steps"]), run.nproc
    per_step = df.dropna(subset=["step_calls"])
    if sorted(per_step["step"].unique()) != list(range(1, steps + 1)) or len(per_step) != steps * world:
        feedback.stop(f"the skeleton logs one line per optimizer step, {steps} on each rank; it logged "
                      f"{len(per_step)} in all: keep its loop and metrics.log(...) as they are.")
    reference = _accumulation_reference(int(setting["seed"]), world, int(setting["accum_steps"]),
                                        int(setting["batch_size"]), int(setting["dim"]), steps, float(setting["lr"]))
    tolerance = TOLERANCE["cpu" if run.info.get("device") == "cpu" else "gpu"]
    return _Steps(setting, per_step, saved, reference, world, tolerance)


def _step_calls(feedback: Feedback, steps: _Steps) -> list[int]:
    """One optimizer.step() per optimizer step; returns the counts seen (sorted, distinct)."""
    k = steps.k
    calls = sorted(set(steps.per_step["step_calls"].astype(int)))
    if calls == [1]:
        feedback.ok(f"optimizer.step() ran once per optimizer step, after all {k} micro-steps")
    elif calls == [0]:
        feedback.fail(f"optimizer.step() was never called: call it once per optimizer step, after the last of "
                      f"the {k} micro-steps.", hint=1)
    elif calls == [k]:
        feedback.fail(f"optimizer.step() ran {k} times per optimizer step, once per micro-step: the point is one "
                      f"step with the gradient of all {k} micro-batches. Step once, after the last micro-step.", hint=1)
    else:
        feedback.fail(f"optimizer.step() ran {', '.join(map(str, calls))} times in an optimizer step; once, after "
                      f"the last of the {k} micro-steps, is right.", hint=1)
    return calls


def _allreduces(feedback: Feedback, steps: _Steps) -> None:
    """One all-reduce of every gradient per optimizer step, counted by the DDP communication hook."""
    k, per_step = steps.k, steps.per_step
    param_bytes = int(per_step["param_bytes"].iloc[0])
    reduced = sorted(set(per_step["allreduced_bytes"].astype(int)))
    if reduced == [param_bytes]:
        feedback.ok(f"DDP all-reduced every gradient once per optimizer step ({param_bytes:,} bytes, counted by a "
                    f"communication hook): no_sync kept the other {k - 1} micro-steps local")
    elif reduced == [k * param_bytes]:
        feedback.fail(f"DDP all-reduced every gradient {k} times per optimizer step ({k} × {param_bytes:,} bytes). "
                      f"Correct but wasteful: the result is the same, but {k - 1} of the {k} all-reduces carry "
                      f"partial sums that the next micro-step changes again. Wrap every micro-step but the last, "
                      f"forward and backward, in model.no_sync().", hint=2)
    elif reduced == [0]:
        feedback.fail("DDP never all-reduced a gradient (0 bytes counted): no_sync on the last micro-step too, so "
                      "the ranks never average their gradients, and their weights drift apart. Run the last "
                      "micro-step outside model.no_sync().", hint=2)
    else:
        shown = ", ".join(f"{b / param_bytes:g}×" for b in reduced)
        feedback.fail(f"DDP all-reduced {shown} the gradients' {param_bytes:,} bytes in an optimizer step; once is "
                      f"right: model.no_sync() on every micro-step but the last.", hint=2)


def _gradients(feedback: Feedback, steps: _Steps) -> None:
    """The gradient each optimizer.step() used, on every rank, against one big batch's."""
    world, reference, tolerance = steps.world, steps.reference, steps.tolerance
    used = [{r: steps.saved[r]["used"][s] for r in range(world)} for s in range(steps.steps)]
    gaps = [max(_gap(g, reference["grads"][s]) if g.shape == reference["grads"][s].shape else float("inf")
                for g in used[s].values()) for s in range(steps.steps)]
    wrong = [s for s, g in enumerate(gaps) if not g <= tolerance]
    if not wrong:
        feedback.ok(f"the gradient of every optimizer step, on every rank, is that of one batch of {world} × "
                    f"{steps.k} × {steps.setting['batch_size']:.0f} = {steps.effective} samples in one process "
                    f"(largest gap {max(gaps):.1e} of the largest gradient; tolerance {tolerance:g})")
    elif wrong[0] == 0:
        text, hint = _explain_gradient(used[0], reference, steps.k)
        feedback.fail(text, hint=hint)
    else:
        s = wrong[0]
        leftover = all(_near(used[s][r] - used[s - 1][r], reference["grads"][s]) for r in range(world))
        first = "the first optimizer step is" if s == 1 else f"the first {s} optimizer steps are"
        feedback.fail(f"{first} right, but from step {s + 1} on the gradient "
                      + ("still holds the previous step's: clear the gradients after every optimizer.step() "
                         "(optimizer.zero_grad(set_to_none=True))." if leftover else
                         f"differs from one big batch's (by {gaps[s]:.1e}): start every optimizer step from "
                         f"cleared gradients."), hint=1)


def _weights(feedback: Feedback, steps: _Steps) -> None:
    """The final weights: the same on every rank, and one process's on the big batches."""
    weights = {r: steps.saved[r]["weights"] for r in range(steps.world)}
    spread = max(_gap(w, weights[0]) for w in weights.values())
    gap = max(_gap(w, steps.reference["weights"]) for w in weights.values())
    if spread > steps.tolerance:
        feedback.fail(f"the ranks ended with different weights (up to {spread:.1e} apart): every optimizer step must "
                      f"average the gradients over the ranks, so that every rank takes the same step.", hint=2)
    else:
        feedback.expect(gap <= steps.tolerance,
                        f"after {steps.steps} optimizer steps every rank holds the weights one process reaches with "
                        f"plain SGD on one batch of {steps.effective} per step (largest gap {gap:.1e})",
                        f"after {steps.steps} optimizer steps the weights differ from those one process reaches with "
                        f"one batch of {steps.effective} per step (by up to {gap:.1e} of the largest weight).", hint=1)
