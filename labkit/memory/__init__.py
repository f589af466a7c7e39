"""Measure memory, do not estimate it: bytes held for backward, and bytes of model state per rank.

Lessons 05 and 06 use it, in scripts and notebooks alike::

    from labkit import memory
    with memory.SavedTensorMeter(exclude=model) as meter:
        loss = model(x).sum()
    meter.bytes                       # what autograd keeps for backward (activations)
    memory.model_bytes(model, optimizer)   # ModelBytes(params=..., grads=..., optimizer=...)
    memory.cuda_peak_bytes(device)    # on GPU: torch.cuda.max_memory_allocated; else None

Lesson 13 builds ZeRO by hand and measures what each rank holds (``labkit.zero_bytes`` says what
it should hold)::

    memory.storage_bytes(model.parameters())   # the memory blocks behind them, each once, whole

Everything here counts real tensors, so it works on any device, CPU included.
It is the scripts' one import for memory (lessons 05, 06 and 13 call ``memory.X``);
``SavedTensorMeter``, half of it, lives in ``saved.py`` and is imported here.
``model_bytes`` counts a DTensor by its **local** shard (``to_local()``): under
FSDP that is what this rank holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from labkit.memory.saved import SavedTensorMeter, local_tensor

__all__ = ["SavedTensorMeter", "ModelBytes", "model_bytes", "tensor_bytes", "local_tensor",
           "cuda_peak_bytes", "reset_cuda_peak", "storage_bytes"]


def tensor_bytes(tensors) -> int:
    """Bytes of the local parts of ``tensors`` (each tensor object counted once).

    ``numel × element_size`` of each local tensor: the data itself, exactly.
    Allocator rounding, and FSDP's padding of a shard whose rows do not divide
    evenly, are not included.

    Args:
        tensors: a tensor, or an iterable of tensors (``model.parameters()``).

    Returns:
        the number of bytes, an int.

    Raises:
        TypeError: an item is not a tensor.

    Example (lessons 05 and 06)::

        memory.tensor_bytes([torch.zeros(10, dtype=torch.float32)])   # 40
    """
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    tensors = list(tensors)  # all alive at once: no two of them can share an id()
    seen, total = set(), 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensor_bytes counts tensors, got a {type(t).__name__}. "
                            f"HINT: pass model.parameters() or a list of tensors.")
        if id(t) in seen:
            continue
        seen.add(id(t))
        local = local_tensor(t)
        total += local.numel() * local.element_size()
    return total


@dataclass(frozen=True)
class ModelBytes:
    """Bytes of model state that this rank holds, counted from its local tensors.

    Attributes:
        params: parameters (under FSDP: this rank's shards).
        grads: the parameters' ``.grad`` tensors that exist now.
        optimizer: every tensor in the optimizer's state (momentum, Adam's moments, step counters).
    """

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def model_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> ModelBytes:
    """Parameter, gradient and optimizer-state bytes on this rank, exact, on any device.

    Call it after ``optimizer.step()`` and before ``zero_grad``: then gradients
    and optimizer state both exist.

    Args:
        model: the model (DDP- or FSDP-wrapped is fine).
        optimizer: its optimizer, or None to count no optimizer state.

    Returns:
        ModelBytes(params, grads, optimizer).

    Raises:
        TypeError: ``model`` is not an nn.Module, or ``optimizer`` not an Optimizer.

    Example (lesson 06)::

        used = memory.model_bytes(model, optimizer)
        metrics.log(step, param_bytes=used.params, grad_bytes=used.grads, optim_bytes=used.optimizer)
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}. "
                        f"HINT: pass the model you train, e.g. memory.model_bytes(model, optimizer).")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}. "
                        f"HINT: pass the optimizer itself, not its state_dict().")
    params = list(model.parameters())
    state = [] if optimizer is None else [
        value for per_param in optimizer.state.values() for value in per_param.values()
        if isinstance(value, torch.Tensor)]
    return ModelBytes(params=tensor_bytes(params),
                      grads=tensor_bytes(p.grad for p in params if p.grad is not None),
                      optimizer=tensor_bytes(state))


def reset_cuda_peak(device=None) -> None:
    """Start a new peak for ``cuda_peak_bytes`` (does nothing without CUDA, or before CUDA is used).

    Example (lessons 05 and 06)::

        memory.reset_cuda_peak(device)
        train_step()
        peak = memory.cuda_peak_bytes(device)   # None on a CPU
    """
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats(device)


def cuda_peak_bytes(device=None) -> int | None:
    """The most bytes the CUDA caching allocator handed out since the last reset, or None without CUDA.

    ``torch.cuda.max_memory_allocated``: tensors only, not the allocator's
    reserve nor the CUDA context. None (not 0) where there is no GPU, so a
    chart or check can say "not measured" instead of drawing a false zero.

    Args:
        device: the GPU (default: the current one).

    Returns:
        bytes as an int, or None without CUDA (or before this process has used it).
    """
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    return int(torch.cuda.max_memory_allocated(device))


# -- the memory behind tensors (lesson 13) ------------------------------------------------------
def storage_bytes(tensors) -> int:
    """Bytes of the memory blocks (storages) behind ``tensors``: each block once, and whole.

    Where ``tensor_bytes`` counts each tensor's own numbers, this counts the memory they live
    in: many views into one flat buffer count as that buffer, its padding included; a tensor
    whose storage was freed (resized to 0 bytes, as ZeRO-3 frees a gathered unit) counts 0.
    A DTensor counts its local shard's storage.

    Args:
        tensors: a tensor, or an iterable of tensors.

    Returns:
        the number of bytes, an int.

    Raises:
        TypeError: an item is not a tensor.

    Example (lesson 13)::

        flat = torch.zeros(10)
        memory.storage_bytes([flat[:3], flat[3:7]])   # 40: one buffer of 10 floats
    """
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    seen, total = set(), 0
    for t in list(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"storage_bytes counts tensors, got a {type(t).__name__}. "
                            f"HINT: pass model.parameters() or a list of tensors.")
        storage = local_tensor(t).untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if storage.nbytes() and key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total
