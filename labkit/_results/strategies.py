"""Parallel strategies compared: what a run held, sent and saved, and what each strategy should.

Lessons 11 and 12 train lesson 06's ``MLPStack`` under several strategies (DDP, FSDP, tensor
parallel, pipeline parallel, FSDP × TP on a 2-D mesh) and prove each against one process. Their
scripts log, per rank, the bytes of model state held after the first step and the collectives
of every step, and save whole gradients and weights. This module reads those back::

    labkit.prove_same(tp, reference, label="tensor parallel", loss_tol=1e-4, tensor_tol=1e-5)
    labkit.measured_cost(tp)                 # per rank: param, state and sent bytes
    labkit.expected_cost("TP", model, ranks=2, batch_size=128)   # the same, from the shapes (_costs)
"""

from __future__ import annotations



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


def tensor_gaps(run, reference, name: str) -> dict:
    """How far each of a run's saved tensors is from the reference's, relative to its largest value.

    Args:
        run, reference: ``Run`` objects that saved ``<name>_rank<R>.pt``.
        name: "grads" (the first step's gradients) or "weights" (at the end).

    Returns:
        {tensor name: max|ours - reference| / max|reference|}.

    Raises:
        ValueError: the runs saved different tensor names or shapes.
        FileNotFoundError: a run saved nothing under ``name``.

    Example (lesson 14: only the experts' gradients are off)::

        gaps = labkit.tensor_gaps(every_gradient, reference, "grads")
        max(gap for name, gap in gaps.items() if ".experts." in name)
    """
    ours, ref = saved_tensors(run, name), saved_tensors(reference, name)
    if ours.keys() != ref.keys():
        raise ValueError(f"the runs saved different {name}: only in one of them: "
                         f"{sorted(set(ours) ^ set(ref))}")
    shapes = [k for k in ref if ours[k].shape != ref[k].shape]
    if shapes:
        raise ValueError(f"{name} of different shapes: {[(k, tuple(ours[k].shape), tuple(ref[k].shape)) for k in shapes]}")
    return {k: float((ours[k] - ref[k]).abs().max() / ref[k].abs().max()) for k in ref}


def tensor_gap(run, reference, name: str) -> float:
    """The largest difference between two runs' saved tensors, relative to each tensor's largest value.

    Args:
        run, reference: ``Run`` objects that saved ``<name>_rank<R>.pt``.
        name: "grads" (the first step's gradients) or "weights" (at the end).

    Returns:
        max over tensors of max|ours - reference| / max|reference| (``tensor_gaps``' largest).

    Raises:
        ValueError: the runs saved different tensor names or shapes.
        FileNotFoundError: a run saved nothing under ``name``.

    Example (lesson 11)::

        labkit.tensor_gap(tp, reference, "grads")     # a few parts in 1e7 on CPU
    """
    return max(tensor_gaps(run, reference, name).values())


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
    from labkit._results.compare import compare_losses

    same = compare_losses(run, reference, label=label, window_tol=loss_tol).check()
    for name, what in (("grads", "every gradient of the first step"), ("weights", "every weight at the end")):
        gap = tensor_gap(run, reference, name)
        if not gap <= tensor_tol:
            raise AssertionError(f"{label}: {what} is {gap:.1e} from one process's (relative), over the "
                                 f"tolerance {tensor_tol:g}")
        print(f"✓ {label}: {what} within {gap:.1e} of one process's (relative; tolerance {tensor_tol:g})")
    return same


def held_shards(run):
    """The shape of each rank's part of ``blocks.0.fc1.weight`` and ``blocks.0.fc2.weight``, and
    their placements where the run logged them (lesson 11's script does).

    Returns:
        a DataFrame indexed by rank: fc1_rows, fc1_cols, fc2_rows, fc2_cols (ints), then
        fc1_placement and fc2_placement (text such as "(Shard(dim=0),)") when logged.

    Raises:
        ValueError: the run logged no shapes.

    Example (lesson 11)::

        labkit.held_shards(tp)      # each rank: 1/W of fc1's rows and of fc2's columns
    """
    columns = ["fc1_rows", "fc1_cols", "fc2_rows", "fc2_cols"]
    df = _logged(run, columns, "the shapes each rank holds").set_index("rank")
    placements = [c for c in ("fc1_placement", "fc2_placement") if c in df.columns]
    return df[columns].astype(int).join(df[placements])


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
