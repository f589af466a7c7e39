"""One DDP step, taken apart: its phases, its gradient computations and its all-reduces, from a trace.

Lesson 07 profiles DDP steps with ``torch.profiler`` and reads each rank's Chrome trace with
``labkit.read_trace``. This module picks out of such a trace what the lesson draws and checks::

    trace = labkit.read_trace(run.run_dir / "trace_rank0.json")
    phases, compute, comm = labkit.step_events(trace, step=6)
    labkit.plot_timeline(pd.concat([phases, compute, comm]))
    labkit.allreduce_bytes(run)          # bytes all-reduced in each profiled step, and their types

and says what PowerSGD should send for a model (``powersgd_numbers``).
"""

from __future__ import annotations

from pathlib import Path


def step_events(trace, step: int):
    """The parts of one profiled DDP step: its phases, its backward computations, its all-reduces.

    - **phases**: the script's ``record_function`` labels ``forward``, ``backward`` and
      ``optimizer``, and the loader's ``next()`` (``enumerate(DataLoader)...``), labelled "data";
    - **compute**: on CPU ranks autograd's work, one ``autograd::engine::evaluate_function`` per
      gradient computation, on the lane "backward (main thread)"; on GPUs the kernels that those
      computations launched: not the forward's, not the optimizer's, not DDP's copy of the
      averaged buckets into the gradients once the backward pass is over;
    - **comm**: on CPU ranks each bucket's all-reduce, on the lane of the gloo thread that ran
      it; on GPUs NCCL's kernels.

    Each comes with a ``label`` column, for ``labkit.plot_timeline``.

    Args:
        trace: a DataFrame from ``labkit.read_trace``.
        step: the profiled step (``ProfilerStep#N``) to take apart.

    Returns:
        (phases, compute, comm): three DataFrames of trace rows.

    Raises:
        ValueError: the trace holds no event of that step.

    Example (lesson 07)::

        phases, compute, comm = labkit.step_events(trace, 6)
        labkit.plot_timeline(pd.concat([phases, compute, comm]))
    """
    events = trace[trace["step"] == step]
    if events.empty:
        steps = sorted(int(s) for s in trace["step"].dropna().unique())
        raise ValueError(f"the trace holds no event of step {step}; its profiled steps: {steps}")
    loading = events["name"].str.startswith("enumerate(DataLoader)")
    phases = events[events["name"].isin(["forward", "backward", "optimizer"]) | loading]
    phases = phases.assign(label=phases["name"].where(~loading[phases.index], "data"))
    gpu = events["device"] == "gpu"
    if gpu.any():   # GPUs: the kernels of the backward pass; NCCL's are the communication
        nccl = gpu & events["name"].str.contains("nccl", case=False)
        kernels = events[gpu & ~nccl & (events["cat"] == "kernel")]
        compute = kernels[_gradient_kernels(trace, events, kernels)].assign(label="gradient computation")
        comm = events[nccl].assign(label="all-reduce kernel")
    else:           # CPU ranks: autograd's computations, and gloo's threads
        compute = events[events["name"].str.startswith("autograd::engine::evaluate_function")]
        compute = compute.assign(lane="backward (main thread)", label="gradient computation")
        comm = events[events["collective"] == "all_reduce"]
        comm = comm.assign(lane=[f"gloo thread {tid}" for tid in comm["tid"]], label="all-reduce of a bucket")
    return phases, compute, comm


def _gradient_kernels(trace, events, kernels):
    """Which GPU kernels compute gradients: those that autograd's computations launched.

    A kernel's row and the CUDA runtime call that launched it, on a CPU thread, share a
    ``correlation`` number. A kernel computes gradients when that call ran inside one of
    autograd's ``autograd::engine::evaluate_function`` events (on GPUs, autograd runs them on a
    thread of its own). So the forward's kernels, the optimizer's, and DDP's copy of the averaged
    buckets into the gradients (launched once every computation is done) do not count, though
    the GPU may run them late. A trace without those launches or those events: the kernels that
    start inside the step's ``backward`` range (from its earliest start to its latest end, on the
    GPU's timeline or the CPU's); every kernel where the step has no such range either.

    Args:
        trace: a DataFrame from ``labkit.read_trace`` (the whole trace: the launches are read there).
        events: its rows of one step.
        kernels: rows of ``events``, the kernels to sort.

    Returns:
        a boolean Series, aligned with ``kernels``: True for a gradient computation.
    """
    import bisect

    import pandas as pd

    from labkit._diagnose.trace import _union

    cpu = trace[(trace["device"] == "cpu") & trace["correlation"].notna()]
    launched_at = dict(zip(cpu["correlation"].astype(int), cpu["start_ms"]))
    launches = [launched_at.get(int(c)) if c is not pd.NA else None for c in kernels["correlation"]]
    autograd = trace[trace["name"].str.startswith("autograd::engine::evaluate_function")]
    if autograd.empty or all(t is None for t in launches):   # the backward range decides
        backward = events[events["name"] == "backward"]
        first = float(backward["start_ms"].min()) if len(backward) else float("-inf")
        last = float(backward["end_ms"].max()) if len(backward) else float("inf")
        return kernels["start_ms"].between(first, last, inclusive="left").astype(bool)
    spans = _union(zip(autograd["start_ms"], autograd["end_ms"]))   # nested calls: one span
    starts = [start for start, _ in spans]

    def in_autograd(t: float | None) -> bool:
        i = -1 if t is None else bisect.bisect_right(starts, t) - 1
        return i >= 0 and t <= spans[i][1]

    return pd.Series([in_autograd(t) for t in launches], index=kernels.index, dtype=bool)


def allreduce_bytes(run, *, rank: int = 0, name: str = "trace_rank{rank}.json"):
    """The bytes a rank all-reduced in each profiled step, and the types they were sent as.

    Args:
        run: a ``Run`` whose ranks saved their traces in its folder (or the folder itself).
        rank: whose trace to read.
        name: the trace's file name in the run folder (``{rank}`` is filled in).

    Returns:
        (a pandas Series of bytes indexed by step, a set of dtype tuples as the profiler names
        them, e.g. ``{("float",)}`` or ``{("c10::BFloat16",)}``).

    Raises:
        FileNotFoundError: no such trace.

    Example (lesson 07: bf16 compression halves the bytes)::

        sent, types = labkit.allreduce_bytes(hooked["bf16"])
    """
    from labkit._diagnose.trace import read_trace

    folder = Path(getattr(run, "run_dir", run))
    trace = read_trace(folder / name.format(rank=rank))
    found = trace[trace["collective"] == "all_reduce"]
    return found.groupby("step")["bytes"].sum(), set(found["dtypes"].map(tuple))


def powersgd_numbers(model, rank: int = 4, min_rate: float = 2) -> int:
    """The numbers PowerSGD all-reduces for one step of ``model``, as its rule decides.

    Each parameter with two dimensions or more is a matrix of n rows (its first dimension) and m
    columns (the rest, flattened). PowerSGD sends n·r + m·r numbers for it (two thin factors of
    rank r) when that is at least ``min_rate`` times fewer than n·m; every other parameter goes
    as it is. (PyTorch's ``PowerSGDState`` calls ``min_rate`` ``min_compression_rate``.)

    Args:
        model: the model DDP wraps (its parameters' shapes are read).
        rank: PowerSGD's ``matrix_approximation_rank``.
        min_rate: the least compression for which a matrix is compressed.

    Returns:
        the number of values all-reduced per step.

    Raises:
        ValueError: ``rank`` below 1 or ``min_rate`` not positive.

    Example (lesson 07)::

        ratio = plain_numbers / labkit.powersgd_numbers(SmallResNet(width=8, norm="group"))
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be a whole number >= 1, got {rank!r}")
    if not min_rate > 0:
        raise ValueError(f"min_rate must be positive, got {min_rate!r}")
    sent = 0
    for p in model.parameters():
        if p.dim() > 1:
            n, m = p.shape[0], p.numel() // p.shape[0]
            if (n + m) * rank * min_rate < n * m:
                sent += (n + m) * rank
                continue
        sent += p.numel()
    return sent
