"""Parallel strategies compared: what a run held, sent and saved, and what each strategy should.

Lessons 11 and 12 train lesson 06's ``MLPStack`` under several strategies (DDP, FSDP, tensor
parallel, pipeline parallel, FSDP × TP on a 2-D mesh) and prove each against one process. Their
scripts log, per rank, the bytes of model state held after the first step and the collectives
of every step, and save whole gradients and weights. This module reads those back::

    labkit.prove_same(tp, reference, label="tensor parallel", loss_tol=1e-4, tensor_tol=1e-5)
    labkit.measured_cost(tp)                 # per rank: param, state and sent bytes
    labkit.expected_cost("TP", model, ranks=2, batch_size=128)   # the same, from the shapes

``expected_cost`` is the arithmetic of the lessons' strategy map, written once: what each rank
holds (parameters, gradients and SGD's momentum: three copies of its parameters) and sends per
step (ring algorithms: an all-reduce over *n* ranks sends 2(n-1)/n of its buffer, an
all-gather or reduce-scatter (n-1)/n; a pipeline stage sends its tensors once).
"""

from __future__ import annotations

#: The strategies ``expected_cost`` knows, as the lessons' map names them.
STRATEGIES = ("one process", "DDP", "FSDP", "TP", "FSDP x TP", "PP")
#: The MLPStack layers tensor parallelism cuts (fc1 by its outputs, fc2 by its inputs).
TP_LAYERS = ("fc1", "fc2")


def _frame(run):
    return run.metrics() if hasattr(run, "metrics") else run


def _logged(run, columns: list[str], what: str):
    df = _frame(run)
    missing = [c for c in columns if c not in df.columns]
    if missing:
        name = getattr(run, "name", "the run")
        raise ValueError(f"{name} logged no {', '.join(missing)}: {what}. HINT: launch the lesson's "
                         f"script (scripts/11_tp.py or 12_pp.py) as the lesson does.")
    return df.dropna(subset=columns[:1])


def saved_tensors(run, name: str) -> dict:
    """What the run's ranks saved as ``<name>_rank<R>.pt`` in its folder, merged: {name: whole tensor}.

    Each rank saves the tensors it holds whole (a pipeline stage its own; under tensor parallel
    rank 0 saves every tensor, gathered), so the merge is the whole model.

    Args:
        run: a ``Run`` whose script saved ``grads`` and ``weights`` (lessons 11 and 12).
        name: the file's stem: "grads" or "weights".

    Returns:
        a dict of CPU tensors by parameter name.

    Raises:
        FileNotFoundError: no rank saved ``<name>_rank<R>.pt``.

    Example (lesson 11)::

        labkit.saved_tensors(tp, "weights")["blocks.0.fc1.weight"].shape
    """
    import torch

    paths = sorted(run.run_dir.glob(f"{name}_rank*.pt"))
    if not paths:
        raise FileNotFoundError(f"no {name}_rank<R>.pt in {run.run_dir}. HINT: the script saves them "
                                f"with save({name!r}, ...) into --out, the run folder by default.")
    merged = {}
    for path in paths:
        merged.update(torch.load(path, map_location="cpu", weights_only=True))
    return merged


def tensor_gap(run, reference, name: str) -> float:
    """The largest difference between two runs' saved tensors, relative to each tensor's largest value.

    Args:
        run, reference: ``Run`` objects that saved ``<name>_rank<R>.pt``.
        name: "grads" (the first step's gradients) or "weights" (at the end).

    Returns:
        max over tensors of max|ours - reference| / max|reference|.

    Raises:
        ValueError: the runs saved different tensor names or shapes.
        FileNotFoundError: a run saved nothing under ``name``.

    Example (lesson 11)::

        labkit.tensor_gap(tp, reference, "grads")     # a few parts in 1e7 on CPU
    """
    ours, ref = saved_tensors(run, name), saved_tensors(reference, name)
    if ours.keys() != ref.keys():
        raise ValueError(f"the runs saved different {name}: only in one of them: "
                         f"{sorted(set(ours) ^ set(ref))}")
    shapes = [k for k in ref if ours[k].shape != ref[k].shape]
    if shapes:
        raise ValueError(f"{name} of different shapes: {[(k, tuple(ours[k].shape), tuple(ref[k].shape)) for k in shapes]}")
    return max(float((ours[k] - ref[k]).abs().max() / ref[k].abs().max()) for k in ref)


def prove_same(run, reference, *, label: str, loss_tol: float, tensor_tol: float):
    """Assert that a run computed what the reference computed: its loss at every step, its first
    gradients and its final weights, each within a stated tolerance; print a ✓ line for each.

    Args:
        run: the run under test.
        reference: one process on the whole batch (lessons 11 and 12).
        label: what the ✓ lines call the run.
        loss_tol: absolute tolerance on the loss at every logged step.
        tensor_tol: tolerance of ``tensor_gap`` for "grads" and "weights".

    Returns:
        the ``LossComparison`` of the losses (``.plot()`` draws it).

    Raises:
        AssertionError: a tolerance is missed; the message gives the gap.

    Example (lesson 11)::

        same = labkit.prove_same(tp, reference, label="tensor parallel", loss_tol=1e-4, tensor_tol=1e-5)
    """
    from labkit._compare import compare_losses

    same = compare_losses(run, reference, label=label, window_tol=loss_tol).check()
    for name, what in (("grads", "every gradient of the first step"), ("weights", "every weight at the end")):
        gap = tensor_gap(run, reference, name)
        if not gap <= tensor_tol:
            raise AssertionError(f"{label}: {what} is {gap:.1e} from one process's (relative), over the "
                                 f"tolerance {tensor_tol:g}")
        print(f"✓ {label}: {what} within {gap:.1e} of one process's (relative; tolerance {tensor_tol:g})")
    return same


def held_shards(run):
    """The shape of each rank's part of ``blocks.0.fc1.weight`` and ``blocks.0.fc2.weight``.

    Returns:
        a DataFrame indexed by rank: fc1_rows, fc1_cols, fc2_rows, fc2_cols (ints).

    Raises:
        ValueError: the run logged no shapes.

    Example (lesson 11)::

        labkit.held_shards(tp)      # each rank: 1/W of fc1's rows and of fc2's columns
    """
    columns = ["fc1_rows", "fc1_cols", "fc2_rows", "fc2_cols"]
    return _logged(run, columns, "the shapes each rank holds").set_index("rank")[columns].astype(int)


def last_step(run):
    """Each rank's line of the last step: its collectives by kind and the bytes it sent.

    Returns:
        a DataFrame indexed by rank (columns as the script logged them: ``sent_bytes``,
        ``forward_all_reduce``, ``bytes_all_reduce``, ``sends``, ...).

    Raises:
        ValueError: the run logged no ``sent_bytes``.

    Example (lesson 11)::

        labkit.last_step(tp)[["forward_all_reduce", "backward_all_reduce", "sent_bytes"]]
    """
    df = _logged(run, ["sent_bytes"], "the bytes each rank sent per step")
    return df[df["step"] == df["step"].max()].set_index("rank")


def measured_cost(run):
    """What each rank held after the first step, and sent in the last step, as the run counted it.

    Returns:
        a DataFrame indexed by rank: ``param_bytes``, ``state_bytes`` (parameters, gradients and
        optimizer state) and ``sent_bytes``.

    Raises:
        ValueError: the run logged no model state or no sent bytes.

    Example (lesson 11)::

        labkit.measured_cost(ddp)
    """
    held = _logged(run, ["param_bytes", "grad_bytes", "optim_bytes"], "the model state each rank holds")
    held = held.set_index("rank")[["param_bytes", "grad_bytes", "optim_bytes"]].astype(int)
    out = held[["param_bytes"]].assign(state_bytes=held.sum(axis=1))
    return out.assign(sent_bytes=last_step(run)["sent_bytes"].astype(float))


#: How ``collectives_per_step`` names the kinds of collective.
KIND = {"all_reduce": "all-reduce", "all_gather": "all-gather", "reduce_scatter": "reduce-scatter", "send": "send"}


def collectives_per_step(run) -> str:
    """What rank 0 took part in during the last step, by kind: "4 all-reduce, 2 all-gather".

    Example (lesson 12's map)::

        labkit.collectives_per_step(fsdp)
    """
    last = last_step(run).loc[0]
    calls = {}
    for column, n in last.items():
        if column.startswith(("forward_", "backward_")) and n == n and n:
            kind = column.split("_", 1)[1]
            calls[kind] = calls.get(kind, 0) + int(n)
    sends = last.get("sends", 0)
    if sends == sends and sends:
        calls["send"] = int(sends)
    return ", ".join(f"{n} {KIND.get(kind, kind)}" for kind, n in calls.items()) or "none"


def _chunk(rows: int, parts: int, index: int) -> int:
    """Rows of part ``index`` when ``rows`` are cut into ``parts`` as torch.chunk (and FSDP2) cut them."""
    size = -(-rows // parts)
    return max(0, min(size, rows - index * size))


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


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
    params = dict(model.named_parameters())
    size = {name: p.element_size() for name, p in params.items()}
    total = sum(p.numel() * size[n] for n, p in params.items())
    cut = {n for n in params if n.split(".")[-2] in TP_LAYERS and not n.endswith("fc2.bias")}
    split = sum(params[n].numel() * size[n] for n in cut)
    dim, depth = model.blocks[0].fc1.in_features, len(model.blocks)
    activation = batch_size * dim * 4                        # float32 activations, the whole batch
    ring = lambda n: 2 * (n - 1) / n                         # an all-reduce, per byte of its buffer

    def tp_shape(name, n):                                    # this rank's shape of a tensor under TP
        shape = list(params[name].shape)
        if name in cut:
            axis = 1 if name.endswith("fc2.weight") else 0   # fc2 by its inputs, fc1 by its outputs
            shape[axis] //= n
        return shape

    def fsdp_bytes(shapes, n, r):                             # rank r's rows of every tensor, cut by FSDP
        return sum(_chunk(s[0], n, r) * _numel(s[1:]) * size[k] for k, s in shapes.items())

    def padded(shapes, n, names=None):                        # what FSDP's collectives carry: equal shards
        return sum(-(-s[0] // n) * n * _numel(s[1:]) * size[k] for k, s in shapes.items()
                   if names is None or k in names)

    roots = {n for n in params if not n.startswith("blocks.")}

    if strategy == "one process" or ranks == 1 and strategy != "FSDP x TP":
        held, sent = [total] * ranks, [0.0] * ranks
    elif strategy == "DDP":
        held, sent = [total] * ranks, [ring(ranks) * total] * ranks
    elif strategy == "FSDP":
        shapes = {k: list(p.shape) for k, p in params.items()}
        held = [fsdp_bytes(shapes, ranks, r) for r in range(ranks)]
        whole = padded(shapes, ranks)
        sent = [(ranks - 1) / ranks * (whole + (whole - padded(shapes, ranks, roots)) + whole)] * ranks
    elif strategy == "TP":
        if 4 * dim % ranks:
            raise ValueError(f"TP over {ranks} ranks cuts 4*dim = {4 * dim}, which must divide by {ranks}")
        held = [total - split + split // ranks] * ranks
        sent = [ring(ranks) * 2 * depth * activation] * ranks
    elif strategy == "PP":
        if depth % ranks:
            raise ValueError(f"PP cuts {depth} blocks into {ranks} equal stages: depth must divide by ranks")
        per = depth // ranks
        held, sent = [], []
        for s in range(ranks):
            mine = [n for n in params if n.startswith(tuple(f"blocks.{b}." for b in range(s * per, (s + 1) * per)))
                    or (s == 0 and n.startswith("stem.")) or (s == ranks - 1 and n.startswith("head."))]
            held.append(sum(params[n].numel() * size[n] for n in mine))
            sent.append(activation * ((s > 0) + (s < ranks - 1)))    # a cut before it, a cut after it
    else:  # FSDP x TP
        if ranks % tp or 4 * dim % tp:
            raise ValueError(f"FSDP x TP: tp ({tp}) must divide the ranks ({ranks}) and 4*dim ({4 * dim})")
        dp = ranks // tp
        shapes = {k: tp_shape(k, tp) for k in params}
        local = padded(shapes, dp)                            # what a TP rank holds, padded for FSDP
        held = [fsdp_bytes(shapes, dp, r // tp) for r in range(ranks)]
        sent = [ring(tp) * 2 * depth * (batch_size // dp) * dim * 4
                + (dp - 1) / dp * (local + (local - padded(shapes, dp, roots)) + local)] * ranks
    return pd.DataFrame({"param_bytes": held, "state_bytes": [3 * h for h in held],
                         "sent_bytes": [float(s) for s in sent]}, index=pd.RangeIndex(ranks, name="rank"))
