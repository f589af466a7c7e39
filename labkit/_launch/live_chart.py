"""The live view's chart: the loss of every rank so far, across restarts and elastic rounds.

A run's metrics lines come in rounds: a new round begins where rank 0 restarted, resumed, or
saw the world size change (``round_starts``). A rank's lines come in stretches, one per process
of that rank. The chart draws one line per rank and stretch, so a rank absent from a round (its
node had left, lesson 10) has a gap there, and marks where each round after the first began.
"""

from __future__ import annotations


def rounds_of(records: list[dict], starts: list[dict] | None = None) -> list[int]:
    """The round of each line: 0 until rank 0 first restarted or changed world size, then 1, ...
    (``round_of``). A new round is a new set of processes: a rank absent from one (a node that
    left) comes back in a later one, not where it left off, and a node that joined counts its
    restarts from 0. ``starts``: the rounds' first lines (``round_starts``), if known."""
    from labkit._results.rounds import round_of, round_starts

    starts = round_starts(records, step_back=False) if starts is None else starts
    return round_of([r["time"] for r in records], starts)


def stretches(records: list[dict], rounds: list[int]) -> list[int]:
    """The stretch of each line: one process of its rank, from its start to its end. A rank's
    stretch ends where its own lines say it started again (its restart count or world size
    changed, or it logged ``resumed_from``), or where the run's round changed (``rounds_of``: a
    node that joins may start again at restart 0 and the same world size, as a new rank 1).
    A rank that started again a moment before rank 0 did keeps its new stretch when the round
    then changes. ``rounds``: each line's round (``rounds_of``)."""
    from labkit._results.rounds import begins_again

    numbers = [0] * len(records)
    count = 0
    for rank in {r.get("rank") for r in records}:
        mine = sorted((i for i, r in enumerate(records) if r.get("rank") == rank),
                      key=lambda i: records[i]["time"])
        early = False  # started again, and the round it started is still to come
        for before, i in zip([None, *mine], mine):
            line = records[i]
            if before is not None:
                new_round = rounds[i] != rounds[before]
                if begins_again(line, records[before], step_back=False):
                    count, early = count + 1, not new_round
                elif new_round:
                    count, early = count + (not early), False
            else:
                count += 1
            numbers[i] = count
    return numbers


def mark_rounds(ax, starts: list[dict]) -> None:
    """A dashed line where each round after the first began (``starts``: rank 0's first line of
    each), at the step rank 0 went on from, saying what changed (``what_changed``): ``restart 1``
    (torchrun restarted the workers), ``1 rank`` (a node left or joined), or both."""
    from labkit._results.rounds import what_changed
    from labkit._results.plots import mark_round

    for k, (before, start) in enumerate(zip(starts, starts[1:])):
        mark_round(ax, start["step"], what_changed(before, start), color="0.3", row=k % 2)


def loss_figure(records: list[dict], rounds: list[int], starts: list[dict], title: str):
    """The loss of every rank so far: one line per rank and round, each round after the first
    marked where it began (a restart, or a node that left or joined). A rank absent from a
    round (its node had left, lesson 10) has a gap there, not a line across it. None before
    any loss. Every record goes to ``metric_curve``, not only those with a loss."""
    if not any(isinstance(r.get("loss"), (int, float)) for r in records):
        return None
    import pandas as pd
    from matplotlib.figure import Figure

    from labkit._results.plots import draw_curve, metric_curve

    df = pd.DataFrame.from_records(records)
    df["loss"] = pd.to_numeric(df["loss"], errors="coerce")
    df["stretch"] = stretches(records, rounds)
    ranks = sorted(df.loc[df["loss"].notna(), "rank"].unique())
    fig = Figure(figsize=(7, 3.4), dpi=90)
    ax = fig.subplots()
    for colour, rank in enumerate(ranks):
        mine = df[df["rank"] == rank].sort_values("time", kind="stable")
        label = f"rank {rank}"
        for _, part in mine.groupby("stretch", sort=False):
            if part["loss"].notna().any():
                draw_curve(ax, metric_curve(part, x="step", y="loss"), label=label,
                           color=f"C{colour % 10}", mark_restarts=False)
                label = "_nolegend_"  # one legend entry per rank
    mark_rounds(ax, starts)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (each rank's own batches)" if len(ranks) > 1 else "loss")
    ax.grid(alpha=0.3)
    if len(ranks) > 1:
        ax.legend(fontsize=8, ncol=min(4, len(ranks)))
    ax.set_title(wrap_title(title), fontsize=10)
    fig.tight_layout()
    return fig


PART_SEP = " · "   # between the parts of a progress line (LiveView._progress joins them)


def wrap_title(title: str, width: int = 72) -> str:
    """The progress line as a chart title: broken between its ``PART_SEP`` parts into lines of at
    most ``width`` characters (a part longer than that keeps its own line), so that none is cut off."""
    lines, line = [], ""
    for part in title.split(PART_SEP):
        if line and len(line) + len(PART_SEP) + len(part) > width:
            lines.append(line)
            line = part
        else:
            line = f"{line}{PART_SEP}{part}" if line else part
    return "\n".join(lines + [line])
