"""What each parallel strategy should hold and send, worked out from the model's shapes.

The arithmetic of lessons 11 and 12's strategy map, written once: for lesson 06's ``MLPStack``
trained with SGD and momentum, what each rank holds (parameters, gradients and momentum: three
copies of its parameters) and sends per step (ring algorithms: an all-reduce over *n* ranks sends
2(n-1)/n of its buffer, an all-gather or reduce-scatter (n-1)/n; a pipeline stage sends its
tensors once). The lessons check it, rank by rank and to the byte, against what their runs
counted (``labkit.measured_cost``)::

    labkit.expected_cost("FSDP", MLPStack(dim=256, depth=4, in_features=256), ranks=2, batch_size=128)

Pure arithmetic on the model's shapes; pandas for the table it returns.
"""

from __future__ import annotations

#: The strategies ``expected_cost`` knows, as the lessons' map names them.
STRATEGIES = ("one process", "DDP", "FSDP", "TP", "FSDP x TP", "PP")
#: The MLPStack layers tensor parallelism cuts (fc1 by its outputs, fc2 by its inputs).
TP_LAYERS = ("fc1", "fc2")


def _chunk(rows: int, parts: int, index: int) -> int:
    """Rows of part ``index`` when ``rows`` are cut into ``parts`` as torch.chunk (and FSDP2) cut them."""
    size = -(-rows // parts)
    return max(0, min(size, rows - index * size))


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class _Shapes:
    """The shapes of an MLPStack's parameters, and the arithmetic of cutting them."""

    def __init__(self, model):
        params = dict(model.named_parameters())
        self.shape = {k: list(p.shape) for k, p in params.items()}
        self.size = {k: p.element_size() for k, p in params.items()}
        self.cut = {k for k in params if k.split(".")[-2] in TP_LAYERS and not k.endswith("fc2.bias")}
        self.roots = {k for k in params if not k.startswith("blocks.")}
        self.dim, self.depth = model.blocks[0].fc1.in_features, len(model.blocks)

    def bytes(self, names=None) -> int:
        return sum(_numel(s) * self.size[k] for k, s in self.shape.items() if names is None or k in names)

    def tp(self, n: int) -> dict:
        """This rank's shape of every tensor under TP over n ranks: fc1 by its outputs, fc2 by its inputs."""
        out = {}
        for k, s in self.shape.items():
            s = list(s)
            if k in self.cut:
                s[1 if k.endswith("fc2.weight") else 0] //= n
            out[k] = s
        return out

    def fsdp_held(self, shapes: dict, n: int, r: int) -> int:
        """Bytes of rank r's rows of every tensor, each cut by rows into n parts."""
        return sum(_chunk(s[0], n, r) * _numel(s[1:]) * self.size[k] for k, s in shapes.items())

    def fsdp_sent(self, shapes: dict, n: int) -> float:
        """FSDP's traffic per rank per step: weights gathered in forward and (the root's aside) again in
        backward, gradients reduce-scattered; each tensor's rows padded to a multiple of n."""
        padded = {k: -(-s[0] // n) * n * _numel(s[1:]) * self.size[k] for k, s in shapes.items()}
        whole, root = sum(padded.values()), sum(v for k, v in padded.items() if k in self.roots)
        return (n - 1) / n * (whole + (whole - root) + whole)

    def stage(self, s: int, stages: int) -> int:
        """Bytes of pipeline stage s: its blocks, and the stem (first stage) or the head (last)."""
        per = self.depth // stages
        mine = tuple(f"blocks.{b}." for b in range(s * per, (s + 1) * per))
        return self.bytes({k for k in self.shape if k.startswith(mine) or (s == 0 and k.startswith("stem."))
                           or (s == stages - 1 and k.startswith("head."))})


def _ring(n: int) -> float:
    """Bytes an all-reduce over n ranks sends per byte of its buffer (ring algorithm)."""
    return 2 * (n - 1) / n


def expected_cost(strategy: str, model, *, ranks: int, batch_size: int, tp: int = 2):
    """What each rank should hold and send per step, worked out from the model's shapes.

    For lesson 06's ``MLPStack`` trained with SGD and momentum on float32 (three copies of the
    parameters a rank holds: weights, gradients, momentum), a global batch of ``batch_size``:

    - **one process**: the whole model; sends nothing.
    - **DDP**: the whole model on every rank; all-reduces every gradient: 2(n-1)/n · P bytes.
    - **FSDP**: each parameter cut by rows into n parts (``torch.chunk``); all-gathers the
      weights in forward and again in backward (but the root's, which stay gathered) and
      reduce-scatters the gradients: (n-1)/n · (P + (P - root) + P), where each parameter counts
      with its rows padded to a multiple of n (FSDP's collectives send equal shards).
    - **TP**: ``fc1`` (weight and bias) and ``fc2``'s weight cut into n slices, the rest whole;
      two all-reduces per block of the activations, batch × dim: 2(n-1)/n · 2 · depth · batch · dim · 4.
    - **PP**: stage s holds its blocks (stage 0 also the stem, the last the head); every stage
      sends the activations at its cuts, batch × dim once per cut it has (forward or back).
    - **FSDP x TP**: ``ranks / tp`` × ``tp`` mesh: TP's cut, then FSDP's rows over the data-parallel
      dimension; TP's all-reduces on the data-parallel slice of the batch, FSDP's gathers and
      reduce-scatters of TP's slices.

    Args:
        strategy: one of ``STRATEGIES``.
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

    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}: one of {', '.join(STRATEGIES)}")
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be a whole number >= 1, got {ranks!r}")
    m = _Shapes(model)
    total, dim, depth = m.bytes(), m.dim, m.depth
    activation = batch_size * dim * 4                        # float32 activations, the whole batch
    if strategy == "one process" or ranks == 1 and strategy != "FSDP x TP":
        held, sent = [total] * ranks, [0.0] * ranks
    elif strategy == "DDP":
        held, sent = [total] * ranks, [_ring(ranks) * total] * ranks
    elif strategy == "FSDP":
        held = [m.fsdp_held(m.shape, ranks, r) for r in range(ranks)]
        sent = [m.fsdp_sent(m.shape, ranks)] * ranks
    elif strategy == "TP":
        if 4 * dim % ranks:
            raise ValueError(f"TP over {ranks} ranks cuts 4*dim = {4 * dim}, which must divide by {ranks}")
        split = m.bytes(m.cut)
        held, sent = [total - split + split // ranks] * ranks, [_ring(ranks) * 2 * depth * activation] * ranks
    elif strategy == "PP":
        if depth % ranks:
            raise ValueError(f"PP cuts {depth} blocks into {ranks} equal stages: depth must divide by ranks")
        held = [m.stage(s, ranks) for s in range(ranks)]
        sent = [activation * ((s > 0) + (s < ranks - 1)) for s in range(ranks)]   # a cut before, a cut after
    else:  # FSDP x TP: TP's cut, then FSDP's rows over the data-parallel dimension
        if ranks % tp or 4 * dim % tp:
            raise ValueError(f"FSDP x TP: tp ({tp}) must divide the ranks ({ranks}) and 4*dim ({4 * dim})")
        dp, shapes = ranks // tp, m.tp(tp)
        held = [m.fsdp_held(shapes, dp, r // tp) for r in range(ranks)]
        tp_sent = _ring(tp) * 2 * depth * (batch_size // dp) * dim * 4      # on its slice of the batch
        sent = [tp_sent + m.fsdp_sent(shapes, dp)] * ranks
    return pd.DataFrame({"param_bytes": held, "state_bytes": [3 * h for h in held],
                         "sent_bytes": [float(s) for s in sent]}, index=pd.RangeIndex(ranks, name="rank"))
