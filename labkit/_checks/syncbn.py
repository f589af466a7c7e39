"""Exercise 03: SyncBatchNorm from one differentiable all-reduce, against ``nn.BatchNorm2d``
on the global batch."""

from __future__ import annotations

from labkit._feedback import Feedback, attempt
from labkit._checks._common import _config, _gap, _metrics, _near, _on, _ranks, _saved

#: Exercise 03's tolerance on every comparison (lesson 03's): float32 sums added in another order.
TOL_03 = 1e-4
MOMENTUM_03, EPS_03 = 0.1, 1e-5
_KEYS_03 = ("output", "input_grad", "weight_grad", "bias_grad", "running_mean", "running_var")


def _syncbn_reference(seed: int, sizes: list[int], channels: int, size: int, steps: int):
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
    bn = nn.BatchNorm2d(channels, eps=EPS_03, momentum=MOMENTUM_03).double()
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


def _stats_used(x, y, weight, bias, eps: float = EPS_03):
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


def _explain_output(xs: list, ys: list, weight, bias) -> str:
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
    used = [_stats_used(x, y, weight, bias) for x, y in zip(xs, ys)]
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
    plain = [_stats_used(x, y, torch.ones_like(weight), torch.zeros_like(bias)) for x, y in zip(xs, ys)]
    if all(_near(m, mean) and _near(v, var) for m, v, _ in plain):
        return "the statistics are right, but the output lacks weight and bias: return x̂ · weight + bias."
    return ("the outputs differ from BatchNorm's on the global batch, and so does the mean they were "
            "normalised with: the global mean is the global Σx over the global n.")


def _explain_running(got_mean, got_var, xs, momentum: float = MOMENTUM_03) -> str:
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


def check_syncbn(target="scripts/ex03_syncbn.py", *, timeout: float = 180) -> Feedback:
    """Exercise 03-syncbn: a synchronised BatchNorm built from one differentiable all-reduce computes
    what ``nn.BatchNorm2d`` computes on the whole global batch, in forward and backward.

    Launches the script on 2 ranks (every GPU, if there are two or more), which hold different
    numbers of samples on purpose. The script saves what its layer computed at each step; the
    check draws the same seeded data itself, runs ``nn.BatchNorm2d`` (float64) on every rank's
    samples together, and compares: the outputs, the input gradients, the weight and bias
    gradients added over the ranks, and the running statistics. A mismatch is named by the
    statistics the outputs were normalised with (read back from them).

    Args:
        target: the exercise's script, or a finished Run of it.
        timeout: seconds the launch may take.

    Returns:
        a Feedback; a mistake in the script is a finding, never an exception.

    Example (exercises/03_syncbn.ipynb)::

        labkit.check_syncbn("scripts/ex03_syncbn.py")
    """
    feedback, run = attempt("03-syncbn", target, timeout=timeout, name="check-03-syncbn", **_ranks(2))
    if run is None:
        return feedback
    columns = ["samples", "channels", "size", "steps", "seed"]
    df = _metrics(feedback, run, columns)
    saved = None if df is None else _saved(feedback, run, "ex03")
    if saved is None:
        return feedback
    sizes = df.dropna(subset=["channels"]).groupby("rank")["samples"].first().astype(int).tolist()
    setting = {c: int(v) for c, v in _config(df, columns).items()}
    steps = setting["steps"]
    weight, bias, want = _syncbn_reference(setting["seed"], sizes, setting["channels"], setting["size"], steps)
    world, total = run.nproc, sum(sizes)
    broken = [r for r in range(world) if len(saved[r]) != steps or any(
        set(s) != set(_KEYS_03) or s["output"] is None or s["output"].shape != w["output"][r].shape
        for s, w in zip(saved[r], want))]
    if broken:
        feedback.fail(f"{_on(broken, world)} saved something else than the skeleton saves (an output of the "
                      f"input's shape at each of the {steps} steps): keep the skeleton's loop as it is.")
        return feedback

    def worst(key, per_rank=True):
        """(largest gap, step) over the steps (and ranks) for one saved quantity; inf where it is missing."""
        gaps = []
        for s in range(steps):
            for r in range(world):
                got = saved[r][s][key]
                wanted = want[s][key][r] if per_rank else want[s][key]
                gaps.append((float("inf") if got is None or got.shape != wanted.shape else _gap(got, wanted), s + 1))
        return max(gaps)

    shards = " and ".join(map(str, sizes)) if world == 2 else ", ".join(map(str, sizes))
    gap, step = worst("output")
    outputs_right = gap <= TOL_03
    if outputs_right:
        feedback.ok(f"the ranks hold {shards} samples ({total} together, uneven on purpose), and every rank's "
                    f"outputs equal nn.BatchNorm2d's on all {total} at once, at each of the {steps} steps "
                    f"(largest gap {gap:.1e}; tolerance {TOL_03:g})")
    elif step == 1:
        feedback.fail(_explain_output(want[0]["x"], [saved[r][0]["output"] for r in range(world)], weight, bias), hint=2)
    else:
        feedback.fail(f"the outputs are right at the first step but not at step {step} (gap {gap:.1e}): each step "
                      f"must use that step's statistics only.", hint=2)

    if outputs_right:
        gap, step = worst("input_grad")
        missing = any(saved[r][0]["input_grad"] is None for r in range(world))
        if gap <= TOL_03:
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
        for s in range(steps):
            parts = [saved[r][s][k] for r in range(world) for k in ("weight_grad", "bias_grad")]
            if any(p is None for p in parts):
                shares.append(float("inf"))
                continue
            got = [sum(saved[r][s][k].double() for r in range(world)) for k in ("weight_grad", "bias_grad")]
            shares.append(max(_gap(got[0], want[s]["weight_grad"]), _gap(got[1], want[s]["bias_grad"])))
        feedback.expect(max(shares) <= TOL_03,
                        f"the weight and bias gradients, added over the ranks as DDP would, equal BatchNorm's "
                        f"(largest gap {max(shares):.1e})",
                        "the weight and bias gradients, added over the ranks, are not BatchNorm's: the output is "
                        "x̂ · weight + bias, with weight and bias the layer's own parameters.", hint=3)

    gap_mean, step_mean = worst("running_mean", per_rank=False)
    gap_var, step_var = worst("running_var", per_rank=False)
    if max(gap_mean, gap_var) <= TOL_03:
        feedback.ok(f"running_mean and running_var follow BatchNorm's on every rank: momentum {MOMENTUM_03:g}, "
                    f"the unbiased global variance (largest gap {max(gap_mean, gap_var):.1e})")
    elif min(step_mean, step_var) == 1 and any(saved[r][0][k] is None for r in range(world)
                                               for k in ("running_mean", "running_var")):
        feedback.fail("the layer has no running statistics any more: keep the buffers of nn.BatchNorm2d and "
                      "update them in place.", hint=3)
    else:
        first = {r: (saved[r][0]["running_mean"], saved[r][0]["running_var"]) for r in range(world)}
        step = min(s for s, g in ((step_mean, gap_mean), (step_var, gap_var)) if g > TOL_03)
        right_first = all(_gap(m, want[0]["running_mean"]) <= TOL_03 and _gap(v, want[0]["running_var"]) <= TOL_03
                          for m, v in first.values())
        if right_first:
            feedback.fail(f"the running statistics are right after the first step, not after step {step}: keep "
                          f"(1 − momentum) of the old value each time, running.lerp_(new, momentum).", hint=3)
        elif not outputs_right:
            feedback.fail("the running statistics are not BatchNorm's either: they follow from the global mean "
                          "and variance, momentum · mean into running_mean and the unbiased variance into "
                          "running_var.", hint=3)
        else:
            feedback.fail(_explain_running(*first[0], want[0]["x"]), hint=3)
    return feedback
