"""Synchronised BatchNorm for every backend (gloo on CPU too), and a converter that swaps it in.

PyTorch's ``nn.SyncBatchNorm`` runs on GPUs only: ``DDP`` refuses a CPU model
that holds one ("SyncBatchNorm layers only work with GPU modules"). Lesson 03
builds the same idea from plain parts, and its scripts use it on CPU ranks::

    from labkit import syncbn
    model = syncbn.convert_sync_batchnorm(model)   # BEFORE DDP(model)

The idea fits in one collective per layer. Each rank sums its slice of the
batch, per channel: the values, their squares and how many there are. One
``all_reduce`` adds those up over the ranks, and from the totals every rank
gets the mean and variance of the *whole* global batch::

    mean = Σx / n        var = Σx² / n − mean²

The all-reduce is differentiable (``all_reduce_sum``): backward all-reduces
the gradient, because every rank's loss depends on every rank's inputs through
the shared statistics. Autograd does the rest.

Two honest caveats. ``Σx²/n − mean²`` loses precision when a channel's mean
is far larger than its spread (``nn.SyncBatchNorm`` all-gathers each rank's
mean, variance and count and merges them instead); BatchNorm inputs are near
zero mean, and in float32 this layer agrees with ``nn.BatchNorm2d`` on the
whole batch to about 1e-5 (tests/test_syncbn.py, and lesson 03's check). And
it is slower than ``nn.SyncBatchNorm``'s fused CUDA kernels: on GPUs, use
PyTorch's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["all_reduce_sum", "allreduce_counts", "SyncBatchNorm", "convert_sync_batchnorm"]

_issued = {"forward": 0, "backward": 0}  # all-reduces all_reduce_sum issued in this process


class _AllReduceSum(torch.autograd.Function):
    """y = Σ_ranks x, with dL/dx = Σ_ranks dL/dy: every rank's loss reads every rank's x."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        total = tensor.clone()  # all_reduce works in place; the input stays as autograd saw it
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        _issued["forward"] += 1
        return total

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad = grad_output.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        _issued["backward"] += 1
        return grad, None


def all_reduce_sum(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """The sum of ``tensor`` over the ranks of ``group``, differentiable (unlike ``dist.all_reduce``).

    Every rank must call it, in the same order, in forward and in backward,
    like any collective.

    Args:
        tensor: this rank's part; same shape and dtype on every rank.
        group: the process group (default: every rank).

    Returns:
        A new tensor, the sum over ranks; ``tensor`` is not modified.

    Raises:
        RuntimeError: no process group is initialised.

    Example (lesson 03)::

        totals = all_reduce_sum(torch.stack([x.sum(), (x * x).sum()]))
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("all_reduce_sum needs a process group. "
                           "HINT: call dist.init_process_group(...) first (torchrun sets the rest).")
    return _AllReduceSum.apply(tensor, group)


def allreduce_counts() -> dict:
    """How many all-reduces ``all_reduce_sum`` has issued in this process, so far.

    Returns:
        ``{"forward": n, "backward": m}``: running totals (take differences
        to count one step). Collectives that ``nn.SyncBatchNorm`` or DDP
        issue are not included.

    Example (lesson 03)::

        before = sum(syncbn.allreduce_counts().values())
        train_step()
        per_step = sum(syncbn.allreduce_counts().values()) - before
    """
    return dict(_issued)


def _world_size(group) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1  # plain `python script.py`: one process, nothing to synchronise
    return dist.get_world_size(group)


class SyncBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics are those of the global batch, on any backend.

    A drop-in for ``nn.BatchNorm1d/2d/3d`` (same parameters, buffers and
    state_dict keys), usually made by ``convert_sync_batchnorm``. In training
    mode every call all-reduces one small tensor (2 numbers per channel and a
    count), and its backward one more: like any collective, every rank must
    run the same forward passes in training mode. In ``eval()`` mode it uses the running statistics, like
    BatchNorm, and communicates nothing. Without a process group it is plain
    BatchNorm.

    Running statistics are updated like BatchNorm's: ``momentum`` (or a
    cumulative average when it is None), with the *unbiased* variance
    (× n/(n−1), n the global count) in ``running_var``. Every rank computes the
    same update, so the buffers stay equal on all ranks.

    Args:
        num_features: channels (C of an (N, C, ...) input).
        eps, momentum, affine, track_running_stats: as for ``nn.BatchNorm2d``.
        process_group: the ranks to synchronise over (default: every rank).

    Raises:
        ValueError: (in forward) an input with fewer than 2 dimensions, or
            whose dimension 1 is not ``num_features``.

    Example (lesson 03)::

        bn = SyncBatchNorm(16)
        y = bn(torch.randn(4, 16, 8, 8))   # statistics of all ranks' 4·W images
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, process_group=None,
                 device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype)
        self.process_group = process_group

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2 or x.size(1) != self.num_features:
            raise ValueError(
                f"SyncBatchNorm({self.num_features}) expects input (N, {self.num_features}, ...), "
                f"got shape {tuple(x.shape)}. HINT: dimension 1 holds the channels.")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        if not self.training and self.running_mean is not None:
            # Inference: normalise with the running statistics; each sample on its own.
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                False, 0.0, self.eps)
        synced = self.training and _world_size(self.process_group) > 1
        if not synced:  # one process (or eval without running stats): BatchNorm itself
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                True, self._update_factor(), self.eps)

        # Per channel: Σx, Σx² and the count, over this rank's slice; then over all ranks.
        channels = x.size(1)
        dims = [0, *range(2, x.dim())]           # every dimension but the channels
        xf = x if x.dtype in (torch.float32, torch.float64) else x.float()  # never in half
        count = torch.full((1,), x.numel() // channels, dtype=xf.dtype, device=x.device)
        local = torch.cat([xf.sum(dims), (xf * xf).sum(dims), count])
        total = self.sum_over_ranks(local)       # the one collective of forward
        n = total[-1]
        mean = total[:channels] / n
        var = (total[channels:2 * channels] / n - mean * mean).clamp_min(0)  # biased, like BN

        if self.track_running_stats:
            with torch.no_grad():               # the same update on every rank
                factor = self._update_factor()
                unbiased = var * (n / (n - 1).clamp_min(1))
                self.running_mean.lerp_(mean.to(self.running_mean.dtype), factor)
                self.running_var.lerp_(unbiased.to(self.running_var.dtype), factor)

        shape = (1, channels) + (1,) * (x.dim() - 2)
        out = (xf - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out.to(x.dtype)

    def sum_over_ranks(self, local: torch.Tensor) -> torch.Tensor:
        """Σ over ranks of [Σx per channel, Σx² per channel, count], differentiably.

        Lesson 03's check script overrides it with a plain ``dist.all_reduce``
        (autograd cannot see it) to show what goes wrong without the backward
        all-reduce: right outputs, wrong input gradients.
        """
        return all_reduce_sum(local, self.process_group)

    def _update_factor(self) -> float:
        """Count this batch in num_batches_tracked; return BatchNorm's exponential_average_factor."""
        if not (self.training and self.track_running_stats):
            return 0.0
        self.num_batches_tracked.add_(1)
        if self.momentum is None:                # cumulative moving average
            return 1.0 / float(self.num_batches_tracked)
        return self.momentum


def convert_sync_batchnorm(module: nn.Module, process_group=None) -> nn.Module:
    """Swap every ``nn.BatchNorm1d/2d/3d`` in ``module`` for a ``labkit.syncbn.SyncBatchNorm``.

    Like ``nn.SyncBatchNorm.convert_sync_batchnorm``, but the result runs on any
    backend. Each new layer keeps the old one's settings (eps, momentum, affine,
    track_running_stats), its weight and bias (the same Parameter objects), its
    running statistics and ``num_batches_tracked``, and its train/eval mode.

    Call it **before** ``DDP(model)``: DDP registers its gradient hooks and its
    list of buffers to broadcast on the modules it is given.

    Args:
        module: a model, or a single BatchNorm layer.
        process_group: the ranks to synchronise over (default: every rank).

    Returns:
        The converted module (``module`` itself, changed in place, unless it
        is a BatchNorm layer: then the new layer).

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
        ValueError: ``module`` is already wrapped in DDP, or holds a lazy
            BatchNorm whose size is not known yet.

    Example (lesson 03)::

        model = syncbn.convert_sync_batchnorm(SmallResNet()).to(device)
        model = DDP(model)
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"convert_sync_batchnorm needs an nn.Module, got {type(module).__name__}. "
                        f"HINT: pass the model itself, e.g. convert_sync_batchnorm(SmallResNet()).")
    if isinstance(module, nn.parallel.DistributedDataParallel):
        raise ValueError("the model is already wrapped in DistributedDataParallel. HINT: convert "
                         "first, then wrap: DDP(convert_sync_batchnorm(model)); DDP hooks the "
                         "layers it is given.")
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        if isinstance(module, nn.modules.lazy.LazyModuleMixin) and module.has_uninitialized_params():
            raise ValueError(f"{type(module).__name__} does not know its size yet. "
                             f"HINT: run one forward pass before converting.")
        new = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_group)
        if module.affine:
            new.weight, new.bias = module.weight, module.bias       # the same Parameters
        new.running_mean, new.running_var = module.running_mean, module.running_var
        new.num_batches_tracked = module.num_batches_tracked
        new.train(module.training)
        return new
    for name, child in module.named_children():
        module.add_module(name, convert_sync_batchnorm(child, process_group))
    return module
