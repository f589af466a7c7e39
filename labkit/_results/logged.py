"""What a run logged, read back by rank and step: the series lessons 02 to 06 check.

A lesson's script logs a few numbers with ``metrics.log``; its checks ask questions of them:
did every rank log the same accuracy, how many steps did an epoch take, how many all-reduces
did a step make, how long did a step take. The answers are a line of pandas each, but the same
line in several lessons (and a subtle one where a restarted run logged a step twice), so they
live here, tested once.

Kernel side; reading a run never imports torch.
"""

from __future__ import annotations

from labkit._errors import NoMetricsError


def _frame(run):
    """A run's metrics DataFrame (``run`` is a Run, or already a DataFrame)."""
    return run.metrics() if hasattr(run, "metrics") else run


def _need(run, df, columns: list[str], what: str) -> None:
    missing = [c for c in columns if c not in df.columns]
    if missing:
        name = getattr(run, "name", None) or df.attrs.get("run", "the run")
        raise NoMetricsError(
            f"run '{name}' logged no {', '.join(repr(c) for c in missing)}, so {what} is unknown. "
            f"HINT: launch the lesson's own script, which logs it with metrics.log(step, ...).")


def logged(run, columns, *, by: str = "step"):
    """Each rank's logged values of ``columns``, indexed by (rank, ``by``).

    A value logged twice for one rank and step (a restarted run redoes the steps after its
    checkpoint) counts once: the later line, from the attempt that went on.

    Args:
        run: a ``Run``, or its ``run.metrics()`` DataFrame.
        columns: one column name (returns a Series) or a list of them (a DataFrame); only lines
            that logged the first one are kept.
        by: the second level of the index, ``"step"`` or ``"epoch"``.

    Returns:
        a Series or DataFrame indexed by (``rank``, ``by``), sorted. ``.unstack("rank")`` gives
        one column per rank.

    Raises:
        NoMetricsError: the run logged none of ``columns[0]``, or not ``by`` with it.

    Example (lessons 02 and 05)::

        labkit.logged(ddp, "loss").unstack("rank")          # one column of losses per rank
        labkit.logged(drill, "batch_fp")                     # which batch each window ended on
        labkit.logged(fsdp, ["shard_rows", "full_rows"])
    """
    names = [columns] if isinstance(columns, str) else list(columns)
    df = _frame(run)
    _need(run, df, [*names, by], f"{names[0]} by {by}")
    rows = df[df[names[0]].notna()]
    order = [c for c in ("restart", "time") if c in rows.columns]
    rows = rows.sort_values(order, kind="stable") if order else rows
    found = rows.groupby(["rank", by])[names].last().sort_index()
    return found[names[0]] if isinstance(columns, str) else found


def steps_per_epoch(run) -> int:
    """Optimizer steps in the run's first epoch: the step at which it logged its first test
    accuracy (the lessons' scripts test the model at the end of every epoch).

    Raises:
        NoMetricsError: the run logged no ``test_acc``.

    Example (lesson 02)::

        labkit.steps_per_epoch(no_sampler) == NPROC * labkit.steps_per_epoch(ddp)
    """
    df = _frame(run)
    _need(run, df, ["test_acc"], "the length of an epoch")
    return int(df.dropna(subset=["test_acc"])["step"].min())


def late_loss(run, share: float = 0.25) -> float:
    """The mean loss over the last ``share`` of the samples the run trained on, all ranks
    together: the same samples in every run of a data set, whatever its world size.

    Args:
        run: a ``Run`` or its metrics; it logs ``loss`` and ``samples`` (per rank) each window.
        share: the fraction of the samples at the end, in (0, 1].

    Raises:
        ValueError: ``share`` is not in (0, 1].
        NoMetricsError: no ``loss`` or ``samples`` logged.

    Example (lesson 02)::

        labkit.late_loss(one_rank) < labkit.late_loss(unscaled)   # fewer steps, less learned
    """
    if not 0 < share <= 1:
        raise ValueError(f"share must be in (0, 1], got {share}. HINT: 0.25 is the last quarter.")
    df = _frame(run)
    _need(run, df, ["loss", "samples"], "the loss at the end")
    windows = df.dropna(subset=["loss"]).groupby("step").agg(loss=("loss", "mean"), samples=("samples", "sum"))
    seen = windows["samples"].cumsum()
    return float(windows.loc[seen > (1 - share) * seen.iloc[-1], "loss"].mean())


def bn_allreduces_per_step(run):
    """BatchNorm's all-reduces per training step, from the running total of ``labkit.syncbn``
    that rank 0 logged with each window (``bn_allreduces``): one figure per window after its first.

    Raises:
        NoMetricsError: the run logged no ``bn_allreduces``.

    Example (lesson 03)::

        (labkit.bn_allreduces_per_step(synced) == 2 * bn_layers).all()
    """
    df = _frame(run)
    _need(run, df, ["bn_allreduces"], "the all-reduces per step")
    rows = df.dropna(subset=["bn_allreduces"])
    rows = rows[rows["rank"] == 0].sort_values("step")
    return (rows["bn_allreduces"].diff() / rows["step"].diff()).dropna()


def ddp_allreduces_per_step(run) -> list[float]:
    """The distinct counts of DDP's gradient all-reduces per optimizer step, over the logged
    windows after each rank's first. The script logs ``allreduces``, the window's count from a
    communication hook (``labkit.comm.count_allreduces``), reset after each line.

    The first window is left out: in its first step DDP holds every gradient in one bucket,
    and only then rebuilds its buckets in the order the backward pass produced the gradients.

    Raises:
        NoMetricsError: the run logged no ``allreduces``.

    Example (lesson 04)::

        labkit.ddp_allreduces_per_step(runs["more accumulation"])    # [1.0]: one bucket per step
    """
    df = _frame(run)
    _need(run, df, ["allreduces"], "the all-reduces per step")
    rows = df.dropna(subset=["allreduces"]).sort_values(["rank", "step"])
    steps = rows.groupby("rank")["step"].diff().fillna(rows["step"])
    after_first = rows.groupby("rank").cumcount() > 0
    return sorted(set((rows["allreduces"] / steps)[after_first]))


def step_s(run):
    """Seconds per step in each steady window of every rank (warm-up windows left out): a
    window's time over the steps it holds.

    Raises:
        NoMetricsError: no ``samples`` logged (``Run.windows`` needs them).

    Example (lesson 03)::

        1000 * labkit.step_s(synced).median()      # ms per step
    """
    windows = run.windows()
    windows = windows.sort_values(["rank", "restart", "step"])
    steps = windows.groupby(["rank", "restart"])["step"].diff()
    steady = ~windows["warmup"] & steps.notna()
    return (windows["dt_s"] / steps)[steady].reset_index(drop=True)
