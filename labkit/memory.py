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
Longer than labkit's ~300 lines on purpose: it is the scripts' one import for memory (lessons
05, 06 and 13 call ``memory.X``), and ``SavedTensorMeter`` alone is half of it.
``model_bytes`` counts a DTensor by its **local** shard (``to_local()``): under
FSDP that is what this rank holds.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

__all__ = ["SavedTensorMeter", "ModelBytes", "model_bytes", "tensor_bytes", "local_tensor",
           "cuda_peak_bytes", "reset_cuda_peak", "storage_bytes"]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: ``t.to_local()`` for a DTensor, ``t`` itself otherwise.

    Example (lesson 06)::

        memory.local_tensor(model.blocks[0].fc1.weight).shape   # (512, 256) on each of 2 ranks
    """
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


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


class SavedTensorMeter:
    """Count the bytes that autograd saves for backward while the ``with`` block runs.

    Built on ``torch.autograd.graph.saved_tensors_hooks``: every tensor an
    operation saves for its backward passes through the pack hook, which notes
    its **storage** and hands the tensor back unchanged (nothing is copied).

    Each storage is counted once, whole: a view saved by one op and its base
    saved by another, or one tensor saved by three ops, hold one block of
    memory, and that is what is counted. Storages of ``exclude`` (the model's
    parameters and buffers, which exist anyway) are left out; when ``exclude`` is a module, so
    is every ``nn.Parameter`` saved, such as the whole weights FSDP2 gathers into new parameters
    for the forward pass (lesson 06). A storage freed
    and its address reused within the block counts again, as the new storage it is.

    Nested hooks: only the innermost pair applies (PyTorch's rule). Inside a
    ``torch.utils.checkpoint(..., use_reentrant=False)`` region, checkpoint's own
    hooks take over, so what the region does not keep is, correctly, not
    counted; the region's inputs, which checkpoint does keep, it saves before
    entering the region, through these hooks, so they are counted.

    Args:
        exclude: an nn.Module (its parameters and buffers) or tensors to leave out.
        modules: optional ``{name: module}``; ``by_module`` then says which module
            saved each storage first ("other" outside them).

    Attributes (after or during the block):
        bytes: bytes of every distinct storage saved.
        storages: how many distinct storages.
        packed: how many times the pack hook ran (a tensor saved twice counts twice here).
        by_module: ``{name: bytes}`` when ``modules`` was given.

    Raises:
        TypeError: ``exclude`` or ``modules`` of the wrong kind.

    Example (lesson 05)::

        with memory.SavedTensorMeter(exclude=model) as meter:
            loss = F.cross_entropy(model(x), y)
        print(meter.bytes, "bytes held for backward")
        loss.backward()
        meter.held_bytes()   # now only what you still hold yourself: x (and y)
    """

    def __init__(self, *, exclude=(), modules: dict | None = None):
        self._parameters_too = isinstance(exclude, torch.nn.Module)  # FSDP2's gathered weights are parameters
        if isinstance(exclude, torch.nn.Module):
            exclude = [*exclude.parameters(), *exclude.buffers()]
        elif isinstance(exclude, torch.Tensor):
            exclude = [exclude]
        exclude = list(exclude)
        if not all(isinstance(t, torch.Tensor) for t in exclude):
            raise TypeError("exclude must be an nn.Module or tensors. "
                            "HINT: SavedTensorMeter(exclude=model).")
        if modules is not None and not (isinstance(modules, dict) and all(
                isinstance(m, torch.nn.Module) for m in modules.values())):
            raise TypeError("modules must be a dict of {name: nn.Module}. "
                            "HINT: modules={'block0': model.blocks[0], ...}.")
        self._exclude = {self._key(t)[0] for t in exclude}
        self._modules = dict(modules or {})
        self._reset()

    def _reset(self) -> None:
        self._storages: dict = {}   # key -> [nbytes, module name, weakrefs to saved tensors]
        self._retired: list = []    # [nbytes, module name] of storages freed, address reused
        self.packed = 0
        self._stack: list = []
        self._handles: list = []

    @staticmethod
    def _key(t: torch.Tensor):
        local = local_tensor(t)
        try:
            storage = local.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor without storage of its own
            return ("id", id(local)), local.numel() * local.element_size()
        return (str(local.device), storage.data_ptr()), storage.nbytes()

    @staticmethod
    def _is_parameter(t: torch.Tensor) -> bool:
        """A parameter, or a view of one (a linear layer saves its weight transposed)."""
        return isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)

    def _pack(self, t: torch.Tensor):
        self.packed += 1
        key, nbytes = self._key(t)
        if key in self._exclude or self._parameters_too and self._is_parameter(t):
            return t
        entry = self._storages.get(key)
        if entry is not None and not any(ref() is not None for ref in entry[2]):
            self._retired.append(self._storages.pop(key)[:2])  # gone; the address holds a new one
            entry = None
        if entry is None:
            owner = self._stack[-1] if self._stack else "other"
            entry = self._storages[key] = [nbytes, owner, []]
        entry[2].append(weakref.ref(t))
        return t

    def __enter__(self) -> "SavedTensorMeter":
        self._reset()
        for name, module in self._modules.items():
            # A hook that returns something replaces the module's input or output: these return None.
            self._handles.append(module.register_forward_pre_hook(self._enter_module(name)))
            self._handles.append(module.register_forward_hook(self._leave_module))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def _enter_module(self, name: str):
        def hook(module, args) -> None:
            self._stack.append(name)
        return hook

    def _leave_module(self, module, args, output) -> None:
        self._stack.pop()

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _counted(self) -> list:
        return self._retired + [entry[:2] for entry in self._storages.values()]

    @property
    def bytes(self) -> int:
        return sum(nbytes for nbytes, _ in self._counted())

    @property
    def storages(self) -> int:
        return len(self._counted())

    @property
    def by_module(self) -> dict:
        out = {name: 0 for name in self._modules}
        for nbytes, owner in self._counted():
            out[owner] = out.get(owner, 0) + nbytes
        return out

    def held_bytes(self) -> int:
        """Bytes of the saved storages still alive now.

        0 once backward has freed the graph, except for tensors that something
        else keeps alive (an input you still hold, a tensor you stored).
        """
        return sum(nbytes for nbytes, _, refs in self._storages.values()
                   if any(ref() is not None for ref in refs))


# -- CUDA -----------------------------------------------------------------------------------
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
