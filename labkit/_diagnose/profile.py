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
      gradient computation, on the lane "backward (main thread)"; on GPUs the kernels that are
      not NCCL's;
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
    if gpu.any():   # GPUs: the kernels themselves; NCCL's are the communication
        nccl = gpu & events["name"].str.contains("nccl", case=False)
        compute = events[gpu & ~nccl & (events["cat"] == "kernel")].assign(label="kernel")
        comm = events[nccl].assign(label="all-reduce kernel")
    else:           # CPU ranks: autograd's computations, and gloo's threads
        compute = events[events["name"].str.startswith("autograd::engine::evaluate_function")]
        compute = compute.assign(lane="backward (main thread)", label="gradient computation")
        comm = events[events["collective"] == "all_reduce"]
        comm = comm.assign(lane=[f"gloo thread {tid}" for tid in comm["tid"]], label="all-reduce of a bucket")
    return phases, compute, comm


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
