"""Charts of runs and sweeps: loss (or any logged metric) curves, speedup against the ideal."""

from __future__ import annotations

from labkit._errors import NoMetricsError

_X_LABELS = {
    "step": "optimizer step",
    "samples": "samples seen (all ranks)",
    "time": "seconds since launch",
}


def metric_curve(df, *, x: str, y: str, start_time: float | None = None):
    """One curve from a metrics DataFrame: the mean of ``y`` over ranks at each logged step.

    Returns a DataFrame with columns ``x``, ``y``, ``round``, in logging order. A new round
    begins where rank 0 restarted, resumed or saw the world size change (``round_starts``): a
    torchrun restart (lesson 05), a node that left or joined (lesson 10). Ranks are averaged
    within a round only, so a node that joined and counts its restarts from 0 does not mix with
    the first round. ``attrs["round_x"]`` maps each round to the first ``x`` it logged anything
    at (a script that logs where it resumed gets its marker there, not at its first loss), and
    ``attrs["round_marks"]`` each round after the first to what changed
    (``labkit._results.rounds.what_changed``).

    Example::

        curve = metric_curve(run.metrics(), x="step", y="loss")
        curve.attrs["round_marks"]   # {1: 'restart 1'} after one torchrun restart
    """
    from labkit._results.rounds import round_of, round_starts, what_changed

    if x not in _X_LABELS:
        raise ValueError(f"x must be one of {sorted(_X_LABELS)}, got {x!r}")
    if y not in df.columns:
        raise NoMetricsError(
            f"run '{df.attrs.get('run', '?')}' logged no {y!r} (it logged: "
            f"{', '.join(c for c in df.columns if c not in ('rank', 'time', 'world_size'))})."
        )
    df = df.sort_values("time", kind="stable").copy()
    if x == "samples":
        if "samples" not in df.columns:
            raise NoMetricsError(f"run '{df.attrs.get('run', '?')}' logged no 'samples'.")
        df["_x"] = df["samples"].fillna(0).cumsum()
    elif x == "time":
        origin = start_time if start_time is not None else df["time"].min()
        df["_x"] = df["time"] - origin
    else:
        df["_x"] = df["step"]
    # step_back=False: a script may log a second experiment from step 0 in one run (lesson 13).
    starts = round_starts(df.loc[df["rank"] == 0].to_dict("records"), step_back=False)
    df["round"] = round_of(df["time"], starts)
    round_x = df.groupby("round", sort=False)["_x"].first().to_dict()
    df = df[df[y].notna()]
    curve = df.groupby(["round", "step"], sort=False).agg(
        x=("_x", "max"), y=(y, "mean")).reset_index()[["x", "y", "round"]]
    curve.attrs["round_x"] = round_x
    curve.attrs["round_marks"] = {k: what_changed(before, start)
                                  for k, (before, start) in enumerate(zip(starts, starts[1:]), 1)}
    return curve


def mark_round(ax, x, text: str, *, color, row: int = 0):
    """A dashed line at ``x`` where a round began, labelled ``text`` at the top of the axes
    (``row`` 1 writes it one line lower, so that two marks close together stay legible)."""
    ax.axvline(x, color=color, ls="--", lw=1, alpha=0.75)
    ax.annotate(text, (x, 1), xycoords=("data", "axes fraction"), xytext=(3, -12 - 10 * row),
                textcoords="offset points", fontsize=8, color=color)


def draw_curve(ax, curve, *, label: str, color=None, mark_restarts: bool = True):
    """Draw a curve from ``metric_curve``; a dashed line in the curve's colour marks where each
    round after the first began, saying what changed (a restart, the world size)."""
    line, = ax.plot(curve["x"], curve["y"], label=label, color=color, lw=1.6)
    if mark_restarts:
        marks = curve.attrs.get("round_marks", {})
        for k in sorted(set(curve["round"]) - {0}):
            first_x = curve.attrs.get("round_x", {}).get(
                k, curve.loc[curve["round"] == k, "x"].iloc[0])
            mark_round(ax, first_x, marks.get(k, f"round {k}"), color=line.get_color(),
                       row=(k - 1) % 2)
    return line


def _as_runs(runs):
    if hasattr(runs, "metrics"):
        return [runs]
    runs = list(runs)
    if not runs:
        raise ValueError("plot needs at least one run, got an empty list")
    return runs


def plot_metric(runs, y: str, *, x: str = "step", ax=None, title: str | None = None,
                logy: bool = False, labels=None):
    """Plot a logged metric of one or more runs, one line per run (mean over ranks).

    Args:
        runs: a Run or a list of Runs.
        y: the logged name, e.g. ``"loss"`` or ``"test_acc"``.
        x: ``"step"``, ``"samples"`` (all ranks together) or ``"time"`` (seconds since launch).
        ax: a matplotlib Axes to draw on (default: a new figure).
        labels: legend entries, one per run (default: the runs' names). When the runs trained
            on different data (CIFAR-10 and the synthetic set), each entry says which.

    Returns:
        the matplotlib Axes.

    Example (lesson 02)::

        labkit.plot_metric([single, ddp], "loss", x="samples")
    """
    import matplotlib.pyplot as plt

    runs = _as_runs(runs)
    labels = [run.name for run in runs] if labels is None else list(labels)
    if len(labels) != len(runs):
        raise ValueError(f"labels has {len(labels)} entries for {len(runs)} run(s): {labels}")
    data = [getattr(run, "data", None) for run in runs]
    if len({d for d in data if d}) > 1:  # e.g. a CIFAR-10 reference run next to a synthetic one
        labels = [f"{label} ({d or 'data unknown'})" for label, d in zip(labels, data)]
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.8))
    for run, label in zip(runs, labels):
        curve = metric_curve(run.metrics(), x=x, y=y, start_time=run.start_time)
        draw_curve(ax, curve, label=label)
    ax.set_xlabel(_X_LABELS[x])
    ax.set_ylabel(y)
    if logy:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title)
    return ax


def plot_loss(runs, *, x: str = "step", ax=None, title: str | None = None, labels=None):
    """Plot the training loss of one or more runs (``plot_metric`` with ``y="loss"``).

    Example (lesson 02)::

        labkit.plot_loss([single_run, ddp_run], x="samples", labels=["1 rank", "2 ranks"])
    """
    return plot_metric(runs, "loss", x=x, ax=ax, title=title, labels=labels)


def plot_throughput(run, *, warmup_windows: int = 1, ax=None, title: str | None = None):
    """Samples/s of every logging window, warm-up windows marked, the steady median drawn.

    This is how ``Run.throughput`` gets its figure: the same windows, the same
    warm-up, the median of the rest.

    Returns:
        the matplotlib Axes.

    Example (lesson 01)::

        labkit.plot_throughput(run)
    """
    import matplotlib.pyplot as plt

    windows = run.windows(warmup_windows=warmup_windows)
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.4))
    steady = windows[~windows["warmup"]]
    warm = windows[windows["warmup"]]
    ax.plot(steady["step"], steady["samples_per_s"], "o", ms=4, label="steady windows")
    ax.plot(warm["step"], warm["samples_per_s"], "x", color="tab:red", ms=7,
            label="warm-up windows (left out)")
    rate = run.throughput(warmup_windows=warmup_windows)
    per_rank = rate / max(1, windows["rank"].nunique())
    ax.axhline(per_rank, color="k", lw=1, ls="--", label=f"median: {per_rank:,.0f} samples/s per rank")
    ax.set_xlabel("optimizer step (end of window)")
    ax.set_ylabel("samples/s (one rank)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title or f"Throughput of {run.name}")
    return ax


def plot_speedup(sweep, *, ax=None, title: str | None = None):
    """Measured speedup against the ideal line, efficiency on a second axis.

    The bars on each point span the fastest and the slowest repeat. The caption
    under the chart says the hardware, backend and threads or devices per rank.

    Returns:
        the speedup Axes (the efficiency Axes is ``ax.efficiency_ax``).

    Example (lesson 02)::

        sweep = labkit.sweep("scripts/02_ddp.py", nproc=[1, 2], repeats=3)
        labkit.plot_speedup(sweep)
    """
    import matplotlib.pyplot as plt

    table = sweep.table()
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    base = table["samples_per_s"].iloc[0]
    n = table["nproc"]
    ideal = n / n.iloc[0]
    low = table["speedup"] - table["samples_per_s_min"] / base
    high = table["samples_per_s_max"] / base - table["speedup"]
    ax.plot(n, ideal, "k--", lw=1, label="ideal (linear)")
    ax.errorbar(n, table["speedup"], yerr=[low, high], fmt="o-", capsize=4, lw=2,
                label="measured (median, min–max)")
    ax.set_xlabel("ranks (nproc)")
    ax.set_ylabel("speedup")
    ax.set_xticks(list(n))
    ax.grid(alpha=0.3)
    eff = ax.twinx()
    eff.plot(n, table["efficiency"] * 100, "s:", color="tab:green", label="efficiency")
    eff.set_ylabel("efficiency (%)", color="tab:green")
    eff.set_ylim(0, 110)
    lines = ax.get_legend_handles_labels()
    more = eff.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="upper left",
              bbox_to_anchor=(1.13, 1.0), fontsize=9)  # outside: clear of both curves
    ax.set_title(title or f"Speedup of {sweep.name}")
    ax.figure.text(0.01, -0.02, sweep.caption, fontsize=8, ha="left", va="top")
    ax.efficiency_ax = eff
    return ax
