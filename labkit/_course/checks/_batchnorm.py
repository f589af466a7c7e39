"""Exercise 03's reference and diagnoses: what ``nn.BatchNorm2d`` computes on the global batch,
and, when a learner's layer differs, which statistics it used instead (each rank's own, the
biased variance, ...). Imports torch only when called."""

from __future__ import annotations

from labkit._course.checks._common import _near


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
