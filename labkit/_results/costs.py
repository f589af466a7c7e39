"""What each parallel strategy holds and sends, rank by rank: the course's one arithmetic of it.

Every figure a lesson checks against its runs, and every figure the planner draws, comes from
here: lesson 06's memory per rank under DDP and FSDP, lessons 11 and 12's strategy map (DDP,
FSDP, tensor and pipeline parallel, FSDP x TP), lesson 13's ZeRO table (``labkit.zero_*``)::

    ranks = costs.per_rank("FSDP", Shapes.of(model), 2, batch_size=128, optimizer="AdamW")
    ranks[0].params, ranks[0].optimizer, ranks[0].sent      # bytes
    labkit.expected_cost("FSDP", model, ranks=2, batch_size=128)   # lessons 11, 12: a table

A rank holds its parameters, their gradients and the optimizer's state (``OPTIMIZERS``: values
per parameter, and the step counter torch keeps per tensor), and sends, per step, what its
collectives weigh with ring algorithms (``SENT_PER_BYTE``). Standard library only: the planner
and ``labkit.comm`` share it without loading anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from labkit._results.shapes import Shapes, chunk, padded

#: Bytes each rank sends per byte of full buffer on a group of n ranks, with the ring
#: algorithms NCCL uses: nccl-tests' "bus bandwidth" factors (its doc/PERFORMANCE.md).
SENT_PER_BYTE = {
    "all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0 if n > 1 else 0.0, "reduce": lambda n: 1.0 if n > 1 else 0.0,
    "gather": lambda n: (n - 1) / n, "scatter": lambda n: (n - 1) / n,
    "send": lambda n: 1.0,
}
#: The strategies, as the lessons name them ("FSDP x TP" is the planner's 2-D).
STRATEGIES = ("one process", "DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "FSDP", "TP", "PP", "FSDP x TP")
#: Optimizer state per parameter: (values, bytes of the step counter torch keeps per tensor).
#: SGD with momentum keeps one buffer (lessons 11, 12); AdamW two moments and a float32 step
#: (lessons 06, 13).
OPTIMIZERS = {"SGD momentum": (1, 0), "AdamW": (2, 4)}


def sent_bytes(kind: str, nbytes: float, group_size: int) -> float:
    """Bytes one rank sends for a collective of ``nbytes`` (its full buffer) on ``group_size``
    ranks: 2(n-1)/n of it for an all-reduce, (n-1)/n for an all-gather or a reduce-scatter,
    all of it for a send."""
    return nbytes * SENT_PER_BYTE[kind](group_size)


@dataclass
class RankCost:
    """What one rank holds and sends in one step, in bytes.

    Attributes:
        params, grads, optimizer: parameters, gradients, optimizer values (moments, momentum).
        steps: the optimizer's step counters (AdamW: 4 bytes per tensor it updates).
        collectives: ``[(kind, full-buffer bytes, group size)]`` of one step.
    """

    params: int
    grads: int
    optimizer: int
    steps: int = 0
    collectives: list = field(default_factory=list)

    @property
    def state(self) -> int:
        """Everything the rank holds: parameters, gradients, optimizer values and steps."""
        return self.params + self.grads + self.optimizer + self.steps

    @property
    def sent(self) -> float:
        return sum(sent_bytes(kind, nbytes, group) for kind, nbytes, group in self.collectives)

    def by_kind(self) -> dict:
        """``{kind: full-buffer bytes}`` added up, as ``comm.count_collectives`` weighs them."""
        out = {}
        for kind, nbytes, _ in self.collectives:
            out[kind] = out.get(kind, 0) + nbytes
        return out


# -- ZeRO's table (lesson 13), on the units' value counts -------------------------------------
def zero_held(counts: list[int], world_size: int, stage: int, *, value_bytes: int,
              optimizer_values: int) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes one rank holds under ZeRO stage 0-3, each unit one flat
    buffer padded to a multiple of W (``labkit.zero_bytes`` says why)."""
    whole = sum(counts)
    if stage == 0:
        return whole * value_bytes, whole * value_bytes, optimizer_values * whole * value_bytes
    mine = sum(padded(n, world_size) for n in counts) // world_size
    params = mine if stage == 3 else mine * world_size
    grads = whole if stage == 1 else mine
    return params * value_bytes, grads * value_bytes, optimizer_values * mine * value_bytes


def zero_collectives(counts: list[int], world_size: int, stage: int, *, value_bytes: int) -> dict:
    """``{kind: full-buffer bytes}`` of one step under ZeRO stage 0-3 (``labkit.zero_traffic``)."""
    if stage == 0:
        return {"all_reduce": sum(counts) * value_bytes}
    flat = sum(padded(n, world_size) for n in counts) * value_bytes
    return {"all_gather": (2 if stage == 3 else 1) * flat, "reduce_scatter": flat}


# -- each strategy -----------------------------------------------------------------------------
def _held(values: int, tensors: int, shapes: Shapes, optimizer: tuple) -> dict:
    """A rank that holds ``values`` parameters in ``tensors`` tensors, with their gradients and state."""
    k, step = optimizer
    b = values * shapes.value_bytes
    return {"params": b, "grads": b, "optimizer": k * b, "steps": step * tensors}


def _fsdp(tensors: dict, shapes: Shapes, n: int, r: int, optimizer: tuple) -> dict:
    """Rank r's rows of every tensor, each cut by rows into n parts (``torch.chunk``), and FSDP's
    collectives: every weight gathered in forward and (the root's aside) again in backward,
    every gradient reduce-scattered, each tensor's rows padded to a multiple of n."""
    def numel(s, rows):
        return rows * _prod(s[1:])
    held = _held(sum(numel(s, chunk(s[0], n, r)) for s in tensors.values()), len(tensors), shapes, optimizer)
    vb, root = shapes.value_bytes, set(shapes.root())
    whole = sum(numel(s, padded(s[0], n)) for s in tensors.values()) * vb
    roots = sum(numel(s, padded(s[0], n)) for k, s in tensors.items() if k in root) * vb
    return {**held, "collectives": [("all_gather", 2 * whole - roots, n), ("reduce_scatter", whole, n)]}


def _prod(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def _needs_width(shapes: Shapes, strategy: str) -> int:
    if shapes.width is None:
        raise ValueError(f"{strategy} sends activations, whose size needs the model's width: "
                         f"{shapes.label} has none. HINT: plan an MLPStack (dim, depth) instead of a "
                         f"bare parameter count.")
    return shapes.width


def _tp_ready(shapes: Shapes, n: int, what: str) -> None:
    if not shapes.tp_cuts:
        raise ValueError(f"{what}: {shapes.label} says nothing of which layers tensor parallelism cuts. "
                         f"HINT: plan an MLPStack (dim, depth) instead of a bare parameter count.")
    for k, d in shapes.tp_cuts.items():
        size = shapes.tensors[k][d]
        if size % n:
            raise ValueError(f"{what} over {n} ranks cuts 4*dim = {size}, which must divide by {n}")


def _strategy(strategy: str, shapes: Shapes, w: int, r: int, batch_size: int, tp: int, opt: tuple) -> dict:
    """What rank r of w holds and sends under ``strategy`` (see ``per_rank``)."""
    vb, n_tensors = shapes.value_bytes, len(shapes.tensors)
    if strategy in ("one process", "DDP"):
        cost = _held(shapes.numel(), n_tensors, shapes, opt)
        return {**cost, "collectives": [("all_reduce", shapes.bytes(), w)] if strategy == "DDP" else []}
    if strategy.startswith("ZeRO-"):
        units, stage = shapes.units(), int(strategy[-1])
        params, grads, optimizer = zero_held(units, w, stage, value_bytes=vb, optimizer_values=opt[0])
        kinds = zero_collectives(units, w, stage, value_bytes=vb)
        return {"params": params, "grads": grads, "optimizer": optimizer, "steps": opt[1] * len(units),
                "collectives": [(kind, b, w) for kind, b in kinds.items()]}
    if strategy == "FSDP":
        return _fsdp(shapes.tensors, shapes, w, r, opt)
    if strategy == "TP":
        _tp_ready(shapes, w, "TP")
        act = batch_size * _needs_width(shapes, "TP") * vb
        cost = _held(sum(_prod(s) for s in shapes.tp_cut(w).values()), n_tensors, shapes, opt)
        return {**cost, "collectives": [("all_reduce", 2 * shapes.depth * act, w)]}
    if strategy == "PP":
        act = batch_size * _needs_width(shapes, "PP") * vb
        if shapes.depth % w:
            raise ValueError(f"PP cuts {shapes.depth} blocks into {w} equal stages: depth must divide by ranks")
        mine = shapes.stage(r, w)
        cost = _held(shapes.numel(mine), len(mine), shapes, opt)
        return {**cost, "collectives": [("send", act, 1)] * ((r > 0) + (r < w - 1))}   # a cut before, after
    if w % tp:
        raise ValueError(f"FSDP x TP: tp ({tp}) must divide the ranks ({w}) and 4*dim")
    _tp_ready(shapes, tp, "FSDP x TP")
    dp = w // tp                                     # TP's cut, then FSDP's rows over the data-parallel axis
    act = (batch_size // dp) * _needs_width(shapes, "FSDP x TP") * vb   # TP on its slice of the batch
    cost = _fsdp(shapes.tp_cut(tp), shapes, dp, r // tp, opt)
    cost["collectives"] = [("all_reduce", 2 * shapes.depth * act, tp), *cost["collectives"]]
    return cost


def per_rank(strategy: str, shapes: Shapes, world_size: int, *, batch_size: int, tp: int = 2,
             optimizer: str = "AdamW") -> list[RankCost]:
    """What each rank holds and sends per step under ``strategy``, worked out from the shapes.

    - **one process**, **DDP**: the whole model on every rank; DDP all-reduces every gradient.
    - **ZeRO-1, 2, 3**: lesson 13's flat units (``Shapes.units``), padded to a multiple of W;
      the optimizer state cut into W slices, then the gradients, then the parameters too.
    - **FSDP**: every parameter cut by rows into W parts (``torch.chunk``: the local shard
      ``labkit.memory.model_bytes`` counts); weights all-gathered in forward and (the root's
      aside) again in backward, gradients reduce-scattered, each padded to equal shards.
    - **TP**: fc1 (weight and bias) and fc2's weight cut into W slices; two all-reduces of the
      activations (global batch × width) per block.
    - **PP**: stage s holds its blocks (the first also the stem, the last the head) and sends
      the activations at each of its cuts once (forward or backward).
    - **FSDP x TP**: a (W / tp) × tp mesh: TP's cut, then FSDP's rows over the data-parallel
      axis; TP's all-reduces on the data-parallel slice of the batch.

    Args:
        strategy: one of ``STRATEGIES``.
        shapes: the model (``Shapes.of(model)``, ``Shapes.mlp_stack(...)``, ``Shapes.count(n)``).
        world_size: the ranks (1 for one process).
        batch_size: the global batch (activations sent by TP and PP).
        tp: the tensor-parallel group of FSDP x TP.
        optimizer: a key of ``OPTIMIZERS``.

    Returns:
        one ``RankCost`` per rank.

    Raises:
        ValueError: an unknown strategy or optimizer, a world size that does not divide as the
            strategy needs, or a model without the shapes it needs (TP and PP need a width).

    Example (lesson 06)::

        [r.params for r in per_rank("FSDP", Shapes.mlp_stack(dim=256, depth=4), 2, batch_size=16)]
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}: one of {', '.join(STRATEGIES)}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"ranks must be a whole number >= 1, got {world_size!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}: one of {', '.join(OPTIMIZERS)}")
    if strategy == "one process" and world_size != 1:
        raise ValueError(f"one process runs on 1 rank, not {world_size}. HINT: world_size=1.")
    opt = OPTIMIZERS[optimizer]
    return [RankCost(**_strategy(strategy, shapes, world_size, r, batch_size, tp, opt))
            for r in range(world_size)]


def expected_cost(strategy: str, model, *, ranks: int, batch_size: int, tp: int = 2):
    """What each rank should hold and send per step, worked out from the model's shapes.

    Lessons 11 and 12's map: lesson 06's ``MLPStack`` trained with SGD and momentum on float32
    (three copies of what a rank holds: weights, gradients, momentum), a global batch of
    ``batch_size``. The arithmetic is ``per_rank``'s (read it for each strategy).

    Args:
        strategy: "one process", "DDP", "FSDP", "TP", "FSDP x TP" or "PP" (or a ZeRO stage).
        model: the ``MLPStack`` (built as the script builds it; only its shapes are read).
        ranks: the ranks the run used (1 for one process).
        batch_size: the global batch.
        tp: the tensor-parallel group of "FSDP x TP".

    Returns:
        a DataFrame indexed by rank: ``param_bytes``, ``state_bytes``, ``sent_bytes``.

    Raises:
        ValueError: an unknown strategy, or ranks that do not divide as the strategy needs.

    Example (lesson 11)::

        want = labkit.expected_cost("DDP", MLPStack(dim=256, depth=4, in_features=256), ranks=2, batch_size=128)
    """
    import pandas as pd

    found = per_rank(strategy, Shapes.of(model), ranks, batch_size=batch_size, tp=tp, optimizer="SGD momentum")
    table = pd.DataFrame({"param_bytes": [r.params for r in found], "state_bytes": [r.state for r in found],
                          "sent_bytes": [float(r.sent) for r in found]}, index=pd.RangeIndex(ranks, name="rank"))
    return table
