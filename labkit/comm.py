"""Count communication: DDP's gradient all-reduces (a hook), and any collective (a dispatch mode).

DDP groups gradients into buckets and all-reduces each bucket during
``backward()``. A *communication hook* replaces that all-reduce with a
function of your own; this one adds the bucket to a tally and then does
exactly what DDP does without a hook (PyTorch's ``allreduce_hook``: sum over
ranks, divide by the world size). Lesson 04 counts with it, rather than
assuming, how many all-reduces ``no_sync()`` saves::

    from labkit import comm
    model = DDP(model)
    counter = comm.count_allreduces(model)   # before the first backward
    ...
    metrics.log(step, allreduces=counter.calls, allreduced_bytes=counter.bytes)
    counter.reset()

Torch only; the counting itself is two additions per bucket, on the host.

Lessons 11 and 12 count every collective of a training step, whatever the strategy (DDP, FSDP,
tensor parallel, both on a 2-D mesh) and weighs it in bytes::

    with comm.count_collectives() as forward:
        loss = F.cross_entropy(model(x), y)
    forward.calls              # {"all_reduce": 4}: one per tensor-parallel block
    forward.bytes              # {"all_reduce": 65536}: the full buffer of each, added up
    forward.sent_bytes         # what each rank sends, by the ring algorithms' arithmetic

Lesson 14 counts the all-to-alls of a mixture of experts, whose parts differ in size from rank
to rank: for an all-to-all, ``sent_bytes`` is exact, read from its split sizes (what goes to the
other ranks; the part a rank sends itself never leaves it).
"""

# No `from __future__ import annotations` here: DDP checks the hook's annotations
# against the real dist.GradBucket and Future types, and would refuse strings.
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.nn.parallel import DistributedDataParallel

from labkit._results.costs import sent_bytes  # the ring algorithms' arithmetic, one table of it

__all__ = ["AllReduceCounter", "count_allreduces", "Collective", "CollectiveCounter", "count_collectives"]


@dataclass
class AllReduceCounter:
    """What DDP all-reduced since the last ``reset()``; ``count_allreduces`` makes one.

    Attributes:
        calls: bucket all-reduces (one per bucket per synchronised backward).
        bytes: bytes of gradient all-reduced (each bucket's flat buffer).
        process_group: the group DDP reduces over (None: every rank).

    Example (lesson 04: one process has nothing to count, so a fresh counter stands in)::

        counter = comm.count_allreduces(model) if ddp else comm.AllReduceCounter()
    """

    calls: int = 0
    bytes: int = 0
    process_group: object = None

    def reset(self) -> None:
        """Start counting from zero again (e.g. after logging a window)."""
        self.calls = self.bytes = 0


def _counting_allreduce(state: AllReduceCounter,
                        bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    state.calls += 1
    state.bytes += buffer.numel() * buffer.element_size()
    return default_hooks.allreduce_hook(state.process_group, bucket)  # what DDP does without a hook


def count_allreduces(model: DistributedDataParallel) -> AllReduceCounter:
    """Register a hook on ``model`` that counts its gradient all-reduces, then does them as usual.

    Gradients are the same as without the hook: the hook calls PyTorch's own
    default all-reduce. Only DDP's gradient buckets are counted, not the
    collectives a script issues itself (a metric's ``all_reduce``, a
    synchronised BatchNorm's statistics).

    Args:
        model: a ``DistributedDataParallel`` model that has not run backward
            yet and has no communication hook.

    Returns:
        The ``AllReduceCounter`` the hook adds to.

    Raises:
        TypeError: ``model`` is not wrapped in DDP.
        ValueError: ``model`` already has a communication hook.

    Example (lesson 04)::

        counter = comm.count_allreduces(model)
        with model.no_sync():
            loss.backward()          # counter.calls stays 0: no_sync skips the all-reduce
    """
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(
            f"count_allreduces needs a DistributedDataParallel model, got {type(model).__name__}. "
            f"HINT: wrap first, then count: counter = count_allreduces(DDP(model)); without DDP "
            f"(one process) there are no gradient all-reduces to count.")
    hooks = getattr(model, "_comm_hooks", [])  # DDP keeps the hooks it was given here
    if hooks:
        names = ", ".join(getattr(hook, "__name__", "?") for hook, _ in hooks)
        raise ValueError(f"this model already has a communication hook ({names}); DDP takes one. "
                         f"HINT: count once, keep the counter it returns, and reset() it to start over.")
    counter = AllReduceCounter(process_group=model.process_group)
    model.register_comm_hook(counter, _counting_allreduce)
    return counter


# -- every collective, whatever issues it ----------------------------------------------------------
#: The name PyTorch gives each collective (as a c10d op, or a functional collective) -> its kind.
_KINDS = {
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce",
    "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "_allgather_base_": "all_gather", "allgather_": "all_gather", "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "broadcast_": "broadcast", "broadcast": "broadcast",
    "alltoall_": "all_to_all", "alltoall_base_": "all_to_all", "all_to_all_single": "all_to_all",
    "reduce_": "reduce", "gather_": "gather", "scatter_": "scatter",
    "send": "send",   # point to point (pipeline stages); its receive is the other rank's part
}


@dataclass(frozen=True)
class Collective:
    """One collective a rank took part in (lessons 11 and 12).

    Attributes:
        kind: ``"all_reduce"``, ``"all_gather"``, ``"reduce_scatter"``, ``"broadcast"``, ...,
            or ``"send"`` (point to point, as pipeline stages talk).
        bytes: the size of its full buffer: the tensor all-reduced, an all-gather's output,
            a reduce-scatter's input (the size nccl-tests calls the message size).
        group_size: the ranks in its group (a tensor-parallel group, FSDP's, everyone).
        sent: for an all-to-all, the bytes of its input that go to the other ranks (lesson 14:
            a mixture of experts sends each rank a different number of rows); None otherwise.
    """

    kind: str
    bytes: int
    group_size: int
    sent: float | None = None

    @property
    def sent_bytes(self) -> float:
        """Bytes this rank sends for it with ring algorithms: 2(n-1)/n of the buffer for an
        all-reduce, (n-1)/n for an all-gather or a reduce-scatter; 0 in a group of one; all
        of it for a send. For an all-to-all, exactly what goes to the other ranks (``sent``,
        read from its split sizes), where it was known."""
        if self.sent is not None:
            return self.sent
        return sent_bytes(self.kind, self.bytes, self.group_size)


def _tensors_bytes(value) -> int:
    """Bytes of the tensors in one argument (a tensor, or a list of them, nested)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensors_bytes(v) for v in value)
    return 0


def _group(args):
    """The ProcessGroup a collective runs on, from its arguments: a c10d op carries the group
    itself, a functional collective its group's name. None when neither is there."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    for value in args:
        if isinstance(value, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(value)
            except RuntimeError:   # another script object (a ReduceOp, options)
                continue
        if isinstance(value, str):
            try:
                return _resolve_process_group(value)
            except (KeyError, ValueError, RuntimeError):   # "sum", "avg": not a group name
                continue
    return None


def _group_size(args) -> int:
    """The size of the group a collective runs on (every rank when its group is not named)."""
    group = _group(args)
    if group is not None:
        return group.size()
    return dist.get_world_size() if dist.is_initialized() else 1


def _all_to_all_sent(name: str, args: tuple) -> float | None:
    """Bytes an all-to-all sends to the other ranks: its input, less this rank's own part, read
    from the split sizes (equal parts when none are given). None when the arguments are not
    an all-to-all's that this knows."""
    group = _group(args)
    if group is None:
        return None
    me, size = group.rank(), group.size()
    if name == "alltoall_":   # lists of tensors: the one at this rank's index stays here
        return float(sum(_tensors_bytes(t) for i, t in enumerate(args[1]) if i != me))
    if name == "alltoall_base_":   # output, input, group, output_split_sizes, input_split_sizes
        rows, splits = args[1], args[4]
    elif name == "all_to_all_single":   # functional: input, output_split_sizes, input_split_sizes
        rows, splits = args[0], args[2]
    else:
        return None
    total = _tensors_bytes(rows)
    if rows.dim() == 0 or rows.shape[0] == 0:
        return 0.0
    own = list(splits)[me] if len(splits) else rows.shape[0] // size
    return float(total - own * total // rows.shape[0])


class CollectiveCounter(TorchDispatchMode):
    """Counts and weighs every collective issued while it is active; ``count_collectives()``
    makes one (lessons 11 and 12).

    A *dispatch mode* sees every operation PyTorch runs, as it runs it, whoever calls it: DDP's
    reducer, FSDP's all-gathers and reduce-scatters, the all-reduces a DTensor plan puts in
    forward and in backward. PyTorch's own ``torch.distributed.tensor.debug.CommDebugMode``
    counts collectives this way; this one also adds each one's full-buffer bytes and group size
    (and imports nothing heavy: CommDebugMode loads the compiler stack, seconds per rank).

    Attributes:
        collectives: a ``Collective`` per call, in order.
        calls: ``{kind: number of calls}``.
        bytes: ``{kind: full-buffer bytes, added up}``.
        sent_bytes: bytes this rank sends in all of them, by the ring algorithms' arithmetic.
    """

    def __init__(self):
        super().__init__()
        self.collectives: list[Collective] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        dtensor = sys.modules.get("torch.distributed.tensor")   # loaded if a DTensor exists
        if dtensor is not None and any(issubclass(t, dtensor.DTensor) for t in types):
            # A DTensor first turns the operation into plain operations and collectives on
            # its local tensors; those come back through this mode, and are counted then.
            return NotImplemented
        out = func(*args, **kwargs)
        packet = getattr(func, "_overloadpacket", None)
        kind = _KINDS.get(getattr(packet, "__name__", ""))
        if kind and "c10d" in str(packet):
            values = [*args, *kwargs.values()]
            full = max([_tensors_bytes(v) for v in values] + [_tensors_bytes(out)])
            sent = _all_to_all_sent(packet.__name__, args) if kind == "all_to_all" else None
            self.collectives.append(Collective(kind, full, _group_size(values), sent))
        return out

    @property
    def calls(self) -> dict:
        return {kind: sum(c.kind == kind for c in self.collectives) for kind in self._kinds()}

    @property
    def bytes(self) -> dict:
        return {kind: sum(c.bytes for c in self.collectives if c.kind == kind) for kind in self._kinds()}

    @property
    def sent_bytes(self) -> float:
        return sum(c.sent_bytes for c in self.collectives)

    def _kinds(self) -> list:
        return list(dict.fromkeys(c.kind for c in self.collectives))


def count_collectives() -> CollectiveCounter:
    """A context manager that counts the collectives this rank takes part in while it is active.

    Every collective that goes through PyTorch's dispatcher is seen: DDP's gradient
    all-reduces, FSDP2's all-gathers and reduce-scatters, tensor parallelism's all-reduces in
    forward and in backward (backward runs inside ``loss.backward()``: put that in the block),
    and the point-to-point sends between pipeline stages (kind ``"send"``).

    Returns:
        A ``CollectiveCounter``; read ``calls``, ``bytes`` and ``sent_bytes`` after the block.

    Example (lessons 11 and 12)::

        with comm.count_collectives() as backward:
            loss.backward()
        metrics.log(step, backward_calls=sum(backward.calls.values()), sent=backward.sent_bytes)
    """
    return CollectiveCounter()
