"""Exercise 03-syncbn: SyncBatchNorm from one differentiable all-reduce, against ``nn.BatchNorm2d``
on the global batch."""

# Longer than ~300 lines on purpose: one exercise is one module (found by its file name), with
# three phases on BatchNorm statistics (tests/test_layout.py lists it).

from __future__ import annotations

from dataclasses import dataclass

from labkit._course.checks._common import _config, _gap, _metrics, _near, _on, _ranks, _saved
from labkit._course.attempt import launched
from labkit._course.feedback import Feedback, check

EXERCISE = "03-syncbn"

HINTS = [
    "AllReduceSum.forward returns the sum of x over every rank. dist.all_reduce works in place, so "
    "give it a copy: autograd must still see x as it was. For backward, ask what that sum's "
    "gradient with respect to this rank's x is: every rank's loss reads this rank's x through the "
    "shared statistics, so every rank's grad_output counts.",
    "AllReduceSum: forward all-reduces a copy of x (x.clone(), then dist.all_reduce), backward a "
    "copy of grad_output, the same way. Per channel means over dimensions 0, 2 and 3. One tensor "
    "carries everything: local = "
    "torch.cat([x.sum(dims), (x * x).sum(dims), count]), with count = torch.full((1,), "
    "x.numel() // channels, dtype=x.dtype, device=x.device) (on x's device, so that torch.cat "
    "accepts it on a GPU too). total = AllReduceSum.apply(local); n = total[-1]; mean = "
    "total[:channels] / n; var = total[channels:2 * channels] / n - mean * mean.",
    "Under torch.no_grad(): self.running_mean.lerp_(mean, self.momentum) and "
    "self.running_var.lerp_(var * n / (n - 1), self.momentum). Then, with shape = (1, channels, "
    "1, 1): (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps) * "
    "self.weight.view(shape) + self.bias.view(shape).",
]

#: Exercise 03's tolerance on every comparison (lesson 03's): float32 sums added in another order.
TOLERANCE = 1e-4
#: The settings the skeleton logs at step 0 (each rank its own ``samples``).
SETTINGS = ["samples", "channels", "size", "steps", "seed", "momentum", "eps"]
_KEYS = ("output", "input_grad", "weight_grad", "bias_grad", "running_mean", "running_var")


def _syncbn_reference(seed: int, sizes: list[int], channels: int, size: int, steps: int, *,
                      momentum: float, eps: float):
    """What ``nn.BatchNorm2d`` computes on the global batch (every rank's samples together), in float64.

    The data are drawn exactly as exercise 03's skeleton draws them: rank r from seed + 1 + r,
    its inputs and then its upstream gradient at each step. Returns (weight, bias, steps), each
    step a dict: "x", "output", "input_grad" (lists, one tensor per rank), "weight_grad",
    "bias_grad", "running_mean", "running_var" (after the step).
    """
    import torch
    from torch import nn

    init = torch.Generator().manual_seed(seed)
    weight = 0.5 + torch.rand(channels, generator=init)
    bias = torch.rand(channels, generator=init) - 0.5
    bn = nn.BatchNorm2d(channels, eps=eps, momentum=momentum).double()
    with torch.no_grad():
        bn.weight.copy_(weight)
        bn.bias.copy_(bias)
    data = [torch.Generator().manual_seed(seed + 1 + r) for r in range(len(sizes))]
    found = []
    for _ in range(steps):
        xs, grads = [], []
        for r, n in enumerate(sizes):
            shape = (n, channels, size, size)
            xs.append(torch.randn(shape, generator=data[r]) * (1 + r) + 2 * r)
            grads.append(torch.randn(shape, generator=data[r]))
        x = torch.cat(xs).double().requires_grad_()
        bn.zero_grad(set_to_none=True)
        y = bn(x)
        y.backward(torch.cat(grads).double())
        found.append({"x": [t.double() for t in xs], "output": list(y.detach().split(sizes)),
                      "input_grad": list(x.grad.split(sizes)), "weight_grad": bn.weight.grad.clone(),
                      "bias_grad": bn.bias.grad.clone(), "running_mean": bn.running_mean.clone(),
                      "running_var": bn.running_var.clone()})
    return weight.double(), bias.double(), found


def _stats_used(x, y, weight, bias, eps: float):
    """The per-channel (mean, variance, fit residual) a layer normalised ``x`` with, read from its output.

    Fits y = a·x + c per channel; BatchNorm's y = weight·(x − mean)/√(var + eps) + bias gives
    a = weight/√(var + eps) and c = bias − a·mean.
    """
    xs, ys = x.double().transpose(0, 1).flatten(1), y.double().transpose(0, 1).flatten(1)
    xc = xs - xs.mean(1, keepdim=True)
    slope = (xc * (ys - ys.mean(1, keepdim=True))).sum(1) / (xc * xc).sum(1)
    offset = ys.mean(1) - slope * xs.mean(1)
    residual = float((ys - (slope[:, None] * xs + offset[:, None])).abs().max())
    return (bias - offset) / slope, (weight / slope) ** 2 - eps, residual


def _explain_output(xs: list, ys: list, weight, bias, eps: float) -> str:
    """Why a first step's outputs differ from BatchNorm's on the global batch: the statistics used, named."""
    import torch

    dims = (0, 2, 3)
    counts = [x[:, 0].numel() for x in xs]
    n, world = sum(counts), len(xs)
    whole = torch.cat(xs)
    mean, var = whole.mean(dims), whole.var(dims, unbiased=False)
    local = [(x.mean(dims), x.var(dims, unbiased=False)) for x in xs]
    plain_mean = torch.stack([m for m, _ in local]).mean(0)
    plain_var = torch.stack([v for _, v in local]).mean(0)
    within = sum(c * v for c, (_, v) in zip(counts, local)) / n
    sizes = " and ".join(str(len(x)) for x in xs) if world == 2 else "different numbers of"
    used = [_stats_used(x, y, weight, bias, eps) for x, y in zip(xs, ys)]
    scale = max(1.0, float(whole.abs().max()))
    if max(residual for _, _, residual in used) > 1e-3 * scale:
        return ("the outputs are not the inputs normalised per channel: compute one mean and one variance per "
                "channel, over the batch and the pixels (dimensions 0, 2 and 3), then (x − mean) / √(var + eps) "
                "· weight + bias.")
    if all(_near(m, lm) and _near(v, lv) for (m, v, _), (lm, lv) in zip(used, local)):
        return ("each rank normalised its slice with its own mean and variance, as plain BatchNorm does: add up "
                "Σx, Σx² and the count over the ranks (one all-reduce) before you compute them.")
    if all(_near(m, plain_mean) for m, _, _ in used):
        also = (" (and the variance as the plain average of the ranks' variances)"
                if all(_near(v, plain_var) for _, v, _ in used) else "")
        return (f"you took the mean as the plain average of the ranks' means{also}. The ranks hold {sizes} "
                f"samples, so a rank's mean does not count as much as another's: all-reduce the sums and the "
                f"count, and divide the global Σx by the global n.")
    if all(_near(m, mean) for m, _, _ in used):
        if all(_near(v, plain_var) or _near(v, within) for _, v, _ in used):
            return ("the mean is right, but the variance is an average of the ranks' variances: that misses how "
                    "far the ranks' means are from each other. Use the global Σx² / n − mean².")
        if all(_near(v, var * n / (n - 1)) for _, v, _ in used):
            return (f"you normalised with the unbiased variance (÷ n − 1). BatchNorm normalises with the biased "
                    f"one, Σx² / n − mean², and keeps the unbiased one (× n/(n − 1), n = {n}, the global count) "
                    f"only for running_var.")
        return "the mean is right, but the variance is not: Σx² / n − mean², with the global sums and count."
    plain = [_stats_used(x, y, torch.ones_like(weight), torch.zeros_like(bias), eps) for x, y in zip(xs, ys)]
    if all(_near(m, mean) and _near(v, var) for m, v, _ in plain):
        return "the statistics are right, but the output lacks weight and bias: return x̂ · weight + bias."
    return ("the outputs differ from BatchNorm's on the global batch, and so does the mean they were "
            "normalised with: the global mean is the global Σx over the global n.")


def _explain_running(got_mean, got_var, xs, momentum: float) -> str:
    """Why the running statistics after the first step (from 0 and 1) are not BatchNorm's."""
    import torch

    dims = (0, 2, 3)
    whole = torch.cat(xs)
    n = whole[:, 0].numel()
    mean, var = whole.mean(dims), whole.var(dims, unbiased=False)
    unbiased = var * n / (n - 1)
    if _near(got_mean, torch.zeros_like(mean)) and _near(got_var, torch.ones_like(var)):
        return ("running_mean and running_var never changed: update them in training mode, "
                "running = (1 − momentum) · running + momentum · batch statistic, or eval() normalises "
                "with 0 and 1.")
    if _near(got_mean, (1 - momentum) * mean):
        return ("the running statistics moved by 1 − momentum, not momentum: momentum is the weight of the "
                "new batch, running = (1 − momentum) · running + momentum · batch (running.lerp_(new, momentum)).")
    if _near(got_mean, mean) and (_near(got_var, var) or _near(got_var, unbiased)):
        return ("the running statistics are the batch's own, with no momentum: running = (1 − momentum) · "
                "running + momentum · batch statistic.")
    if _near(got_mean, momentum * mean) and _near(got_var, (1 - momentum) + momentum * var):
        return (f"running_var holds the biased variance (÷ n). BatchNorm keeps the unbiased one there, "
                f"var · n/(n − 1) with n = {n}, the global count, while it normalises with the biased one.")
    return ("the running statistics after the first step are not BatchNorm's: running_mean should be "
            "momentum · the global mean, and running_var (1 − momentum) + momentum · the global unbiased "
            "variance.")


@dataclass
class _Steps:
    """What each rank's layer computed at each step, and what nn.BatchNorm2d computes on the global batch."""

    saved: dict  # {rank: [one dict per step, keys _KEYS]}, as the script saved them
    want: list  # one dict per step, from _syncbn_reference
    weight: object  # the layer's weight and bias, as the skeleton sets them
    bias: object
    sizes: list  # each rank's samples
    setting: dict  # SETTINGS, as the skeleton logged them (rank 0's)
    world: int
    logged: object  # every rank's metrics (a DataFrame): the collectives each step made

    def worst(self, key: str, per_rank: bool = True) -> tuple[float, int]:
        """(largest gap, step) over the steps (and ranks) for one saved quantity; inf where it is missing."""
        gaps = []
        for s, wanted in enumerate(self.want):
            for r in range(self.world):
                got = self.saved[r][s][key]
                target = wanted[key][r] if per_rank else wanted[key]
                gaps.append((float("inf") if got is None or got.shape != target.shape else _gap(got, target), s + 1))
        return max(gaps)


@check
def check_syncbn(target="scripts/ex03_syncbn.py", *, timeout_s: float = 180) -> Feedback:
    """Exercise 03-syncbn: a synchronised BatchNorm built from one differentiable all-reduce computes
    what ``nn.BatchNorm2d`` computes on the whole global batch, in forward and backward.

    Launches the script on 2 ranks, or ``LABKIT_RANKS`` (every GPU, if there are two or more),
    which hold different numbers of samples on purpose. The script saves what its layer computed at each step; the
    check draws the same seeded data itself, runs ``nn.BatchNorm2d`` (float64) on every rank's
    samples together, and compares: the outputs, the input gradients, the weight and bias
    gradients added over the ranks, and the running statistics. A mismatch is named by the
    statistics the outputs were normalised with (read back from them).

    Args:
        target: the exercise's script, or a finished Run of it.
        timeout_s: seconds the launch may take.

    Returns:
        a Feedback; a mistake in the script is a finding, never an exception.

    Example (exercises/03_syncbn.ipynb)::

        labkit.check_syncbn("scripts/ex03_syncbn.py")
    """
    feedback, run = launched(EXERCISE, target, timeout_s=timeout_s, name="check-03-syncbn", **_ranks(2))
    steps = _read(feedback, run)
    outputs_right = _outputs(feedback, steps)
    if outputs_right:
        _gradients(feedback, steps)
    _running_statistics(feedback, steps, outputs_right)
    _one_all_reduce(feedback, steps.logged)
    return feedback


def _one_all_reduce(feedback: Feedback, df) -> None:
    """One all-reduce a step in forward and one in backward, on every rank: the task's ONE apply."""
    if "forward_all_reduces" not in df.columns or "backward_all_reduces" not in df.columns:
        feedback.stop("the ranks logged no count of their all-reduces: keep the skeleton's loop as it is.")
    counts = df.dropna(subset=["forward_all_reduces"])
    forward, backward = (" or ".join(str(n) for n in sorted(set(counts[c].astype(int))))
                         for c in ("forward_all_reduces", "backward_all_reduces"))
    feedback.expect(forward == backward == "1",
                    "one all-reduce a step in forward (Σx, Σx² and the count together) and one in backward",
                    f"a step made {forward} all-reduce(s) in forward and {backward} in backward, where one "
                    f"each is enough: put Σx, Σx² and the count in one tensor (torch.cat) and call "
                    f"AllReduceSum.apply once; its backward makes backward's one.", hint=2)


def _read(feedback: Feedback, run) -> _Steps:
    """What the ranks saved, next to BatchNorm's on the same data; stops if the script saved something else."""
    df = _metrics(feedback, run, SETTINGS)
    saved = _saved(feedback, run, "ex03")
    sizes = df.dropna(subset=["channels"]).groupby("rank")["samples"].first().astype(int).tolist()
    setting = _config(df, SETTINGS)
    steps = int(setting["steps"])
    weight, bias, want = _syncbn_reference(int(setting["seed"]), sizes, int(setting["channels"]),
                                           int(setting["size"]), steps, momentum=float(setting["momentum"]),
                                           eps=float(setting["eps"]))
    world = run.nproc
    broken = [r for r in range(world) if len(saved[r]) != steps or any(
        set(s) != set(_KEYS) or s["output"] is None or s["output"].shape != w["output"][r].shape
        for s, w in zip(saved[r], want))]
    if broken:
        feedback.stop(f"{_on(broken, world)} saved something else than the skeleton saves (an output of the "
                      f"input's shape at each of the {steps} steps): keep the skeleton's loop as it is.")
    return _Steps(saved, want, weight, bias, sizes, setting, world, df)


def _outputs(feedback: Feedback, steps: _Steps) -> bool:
    """Every rank's outputs against BatchNorm's on the global batch; True when they agree."""
    sizes, total, count = steps.sizes, sum(steps.sizes), len(steps.want)
    shards = " and ".join(map(str, sizes)) if steps.world == 2 else ", ".join(map(str, sizes))
    gap, step = steps.worst("output")
    if gap <= TOLERANCE:
        feedback.ok(f"the ranks hold {shards} samples ({total} together, uneven on purpose), and every rank's "
                    f"outputs equal nn.BatchNorm2d's on all {total} at once, at each of the {count} steps "
                    f"(largest gap {gap:.1e}; tolerance {TOLERANCE:g})")
        return True
    if step == 1:
        outputs = [steps.saved[r][0]["output"] for r in range(steps.world)]
        feedback.fail(_explain_output(steps.want[0]["x"], outputs, steps.weight, steps.bias,
                                      float(steps.setting["eps"])), hint=2)
    else:
        feedback.fail(f"the outputs are right at the first step but not at step {step} (gap {gap:.1e}): each step "
                      f"must use that step's statistics only.", hint=2)
    return False


def _gradients(feedback: Feedback, steps: _Steps) -> None:
    """The input gradients, then the weight and bias gradients added over the ranks (as DDP would)."""
    saved, world = steps.saved, steps.world
    gap, _ = steps.worst("input_grad")
    missing = any(saved[r][0]["input_grad"] is None for r in range(world))
    if gap <= TOLERANCE:
        feedback.ok(f"so are the input gradients (largest gap {gap:.1e}): the gradient flows back through the "
                    f"all-reduce to every rank's inputs")
    elif missing:
        feedback.fail("no gradient reached the inputs: do not detach x or compute the output under "
                      "torch.no_grad(); only the running statistics' update belongs there.", hint=1)
    else:
        feedback.fail(f"the outputs are right, but the input gradients are not (off by up to {gap:.1e}): the "
                      f"gradient does not travel back through the all-reduce. Every rank's loss depends on every "
                      f"rank's inputs, so AllReduceSum.backward must all-reduce grad_output too; a plain "
                      f"dist.all_reduce in forward is invisible to autograd.", hint=1)
    shares = []
    for s, wanted in enumerate(steps.want):
        parts = [saved[r][s][k] for r in range(world) for k in ("weight_grad", "bias_grad")]
        if any(p is None for p in parts):
            shares.append(float("inf"))
            continue
        got = [sum(saved[r][s][k].double() for r in range(world)) for k in ("weight_grad", "bias_grad")]
        shares.append(max(_gap(got[0], wanted["weight_grad"]), _gap(got[1], wanted["bias_grad"])))
    feedback.expect(max(shares) <= TOLERANCE,
                    f"the weight and bias gradients, added over the ranks as DDP would, equal BatchNorm's "
                    f"(largest gap {max(shares):.1e})",
                    "the weight and bias gradients, added over the ranks, are not BatchNorm's: the output is "
                    "x̂ · weight + bias, with weight and bias the layer's own parameters.", hint=3)


def _running_statistics(feedback: Feedback, steps: _Steps, outputs_right: bool) -> None:
    """running_mean and running_var after every step; a wrong update is named by what it computed."""
    saved, world, momentum = steps.saved, steps.world, float(steps.setting["momentum"])
    gap_mean, step_mean = steps.worst("running_mean", per_rank=False)
    gap_var, step_var = steps.worst("running_var", per_rank=False)
    if max(gap_mean, gap_var) <= TOLERANCE:
        feedback.ok(f"running_mean and running_var follow BatchNorm's on every rank: momentum {momentum:g}, "
                    f"the unbiased global variance (largest gap {max(gap_mean, gap_var):.1e})")
    elif min(step_mean, step_var) == 1 and any(saved[r][0][k] is None for r in range(world)
                                               for k in ("running_mean", "running_var")):
        feedback.fail("the layer has no running statistics any more: keep the buffers of nn.BatchNorm2d and "
                      "update them in place.", hint=3)
    else:
        first = {r: (saved[r][0]["running_mean"], saved[r][0]["running_var"]) for r in range(world)}
        step = min(s for s, g in ((step_mean, gap_mean), (step_var, gap_var)) if g > TOLERANCE)
        want = steps.want[0]
        right_first = all(_gap(m, want["running_mean"]) <= TOLERANCE and _gap(v, want["running_var"]) <= TOLERANCE
                          for m, v in first.values())
        if right_first:
            feedback.fail(f"the running statistics are right after the first step, not after step {step}: keep "
                          f"(1 − momentum) of the old value each time, running.lerp_(new, momentum).", hint=3)
        elif not outputs_right:
            feedback.fail("the running statistics are not BatchNorm's either: they follow from the global mean "
                          "and variance, momentum · mean into running_mean and the unbiased variance into "
                          "running_var.", hint=3)
        else:
            feedback.fail(_explain_running(*first[0], want["x"], momentum), hint=3)
