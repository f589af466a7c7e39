"""Count DDP's gradient all-reduces: a communication hook that counts, then all-reduces as usual.

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
"""

# No `from __future__ import annotations` here: DDP checks the hook's annotations
# against the real dist.GradBucket and Future types, and would refuse strings.
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

__all__ = ["AllReduceCounter", "count_allreduces"]


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
