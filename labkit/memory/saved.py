"""``SavedTensorMeter``: what autograd keeps for backward, each storage counted once, and
``local_tensor``, the part of a tensor this rank holds (both as ``labkit.memory.X``)."""

from __future__ import annotations

import weakref

import torch


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: ``t.to_local()`` for a DTensor, ``t`` itself otherwise.

    Example (lesson 06)::

        memory.local_tensor(model.blocks[0].fc1.weight).shape   # (512, 256) on each of 2 ranks
    """
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


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
            return (str(local.device), storage.data_ptr()), storage.nbytes()
        except (RuntimeError, NotImplementedError):  # a tensor without storage of its own (a
            # wrapper such as a functional collective's AsyncCollectiveTensor): counted by itself
            return ("id", id(local)), local.numel() * local.element_size()

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
