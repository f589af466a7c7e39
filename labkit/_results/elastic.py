"""An elastic run read back round by round: who trained, from where, and the loss (lesson 10).

A round is one stretch of training with one set of ranks: the job's first start, then every
restart after a node left or joined (``labkit._launch.elastic`` makes them happen). Kernel
side; pandas and matplotlib are imported when a function is called.
"""

from __future__ import annotations

from labkit._results.rounds import round_of, round_starts


def _assign_rounds(df) -> list[int]:
    """The round of each line of an elastic run's metrics (``round_of`` its ``round_starts``)."""
    return round_of(df["time"], round_starts(df.to_dict("records")))


def elastic_losses(run):
    """The loss of every step of an elastic run, round by round (lesson 10).

    A round is one stretch of training with one set of ranks: the job's first start, then
    every restart after a node left or joined. Steps done again after a restart appear once
    per round that did them. A step that not every rank of its round logged (a rank killed
    before its buffered lines reached the disk) is left out.

    Args:
        run: a ``Run`` whose script logs ``loss`` every step (and ``resumed_from`` when it
            resumes, as lesson 10's does).

    Returns:
        a DataFrame with ``round``, ``step``, ``world_size``, ``time_s`` (seconds since the
        launch) and ``loss`` (the mean over the ranks of that round).

    Example (lesson 10)::

        losses = labkit.elastic_losses(run)
        losses.groupby("round")["loss"].last()
    """
    df = run.metrics()
    df = df.assign(round=_assign_rounds(df))
    origin = run.info.get("start_time") or df["time"].min()
    df = df[df["loss"].notna()].copy()
    out = df.groupby(["round", "step"], sort=True).agg(
        world_size=("world_size", "max"), time=("time", "max"), loss=("loss", "mean"),
        ranks=("rank", "nunique")).reset_index()
    # A node killed mid-run takes the lines its ranks had not yet written: a step that not
    # every rank of its round logged has no mean loss over the round's ranks, so it is left out.
    out = out[out["ranks"] == out["world_size"]]
    out["time_s"] = out["time"] - origin
    return out[["round", "step", "world_size", "time_s", "loss"]]


def elastic_rounds(run):
    """One row per round of an elastic run: who trained, from where, to where (lesson 10).

    Returns:
        a DataFrame with ``round``, ``world_size``, ``start_s`` and ``end_s`` (seconds since the
        launch), ``resumed_from`` (the checkpoint's step, None for the first round),
        ``first_step``, ``last_step`` (the steps it logged a loss for), ``steps`` (how many) and
        ``last_checkpoint`` (the last step it saved a checkpoint at, None if it saved none).

    Example (lesson 10)::

        rounds = labkit.elastic_rounds(run)
        rounds[["round", "world_size", "resumed_from", "first_step"]]
    """
    import pandas as pd

    df = run.metrics()
    df = df.assign(round=_assign_rounds(df))
    origin = run.info.get("start_time") or df["time"].min()
    zero = df[df["rank"] == 0].copy()
    losses = elastic_losses(run)
    rows = []
    for number, part in zero.groupby("round"):
        mine = losses[losses["round"] == number]
        resumed = part["resumed_from"].dropna() if "resumed_from" in part else pd.Series([], dtype=float)
        saved = part["checkpoint_saved"].dropna() if "checkpoint_saved" in part else pd.Series([], dtype=float)
        rows.append({
            "round": number, "world_size": int(part["world_size"].max()),
            "start_s": part["time"].min() - origin, "end_s": part["time"].max() - origin,
            "resumed_from": int(resumed.iloc[0]) if len(resumed) else None,
            "first_step": int(mine["step"].min()) if len(mine) else None,
            "last_step": int(mine["step"].max()) if len(mine) else None,
            "steps": len(mine),
            "last_checkpoint": int(saved.max()) if len(saved) else None,
        })
    counts = ["resumed_from", "first_step", "last_step", "last_checkpoint"]
    return pd.DataFrame(rows).astype({name: "Int64" for name in counts})  # None stays missing


class Resumes:
    """Each round of an elastic run, set against the round before it (lesson 10).

    ``labkit.elastic_resumes(run, tol=...)`` makes one. ``table`` has a row per round: ``round``,
    ``world_size``, ``restart`` (the highest restart count torchrun gave its ranks),
    ``resumed_from``, ``saved_before`` (the last checkpoint logged as saved before the round
    began: by the round before, or by an earlier one when that round was too short to save any),
    ``reached_before`` (the last step it trained), ``first_step``, ``redone`` (the steps the
    round before had already trained), ``compared`` (how many of them
    both rounds logged in full) and ``max_gap`` (the largest loss difference among those).
    ``check(ckpt_every=...)`` asserts that every restart went on from the last checkpoint, with
    nothing skipped, at most ``ckpt_every`` steps redone, each redone step's loss within
    ``tol``, at least one redone step compared in the whole run, and every step trained.
    """

    def __init__(self, table, steps: set, tol: float):
        self.table, self.steps, self.tol = table, steps, tol

    def check(self, *, ckpt_every: int) -> "Resumes":
        """Raise AssertionError naming the first restart that lost, skipped or changed something.

        An empty comparison fails too: a run whose redone steps were all lost (or that redid
        none) cannot show that a restart restored the model, so it proves nothing.
        """
        self.check_resume_points(ckpt_every=ckpt_every)
        for row in self.table.iloc[1:].itertuples():
            where = f"round {row.round} ({row.world_size} rank(s))"
            # A round stopped after logging a checkpoint step but before saving it redoes
            # ckpt_every steps (the script logs a step's loss, then saves): more proves a miss.
            assert len(row.redone) <= ckpt_every, (
                f"{where} redid steps {row.redone}: more than {ckpt_every}, so a checkpoint was missed")
            assert not row.compared or row.max_gap <= self.tol, (
                f"{where} redid steps {row.redone} with losses up to {row.max_gap:.2e} away from the "
                f"first time (tolerance {self.tol:.0e}): the resumed state is not the saved one (were "
                f"the model's weights loaded?)")
        assert self.table["compared"].sum() > 0, (
            "no step done twice could be compared (none redone, or their lines were lost with a "
            "killed node): nothing shows that a restart restored the model and optimizer. Kill a "
            "node between two checkpoints, and have the script flush its metrics lines.")
        last = max(self.steps)
        missed = sorted(set(range(1, last + 1)) - self.steps)
        assert not missed, f"steps {missed} were never trained (in any round)"
        return self

    def check_resume_points(self, *, ckpt_every: int) -> "Resumes":
        """The part of ``check`` about where each restart went on: from the last checkpoint the
        round before saved (or the next one, written just before it was stopped), with its first
        step right after it. For a run whose losses cannot be compared across rounds.

        Example::

            labkit.elastic_resumes(run, tol=1e-4).check_resume_points(ckpt_every=5)
        """
        import pandas as pd

        for row in self.table.iloc[1:].itertuples():
            where = f"round {row.round} ({row.world_size} rank(s))"
            assert not pd.isna(row.resumed_from), f"{where} did not resume from a checkpoint"
            saved, reached = row.saved_before, row.reached_before
            assert not pd.isna(saved), (
                f"{where} resumed from step {row.resumed_from}, but no round before it logged a checkpoint")
            # A round stopped between writing a checkpoint and logging that it did has one more on
            # disk than its lines say: the next one, at a step it reached, is as good to go on from.
            written = row.resumed_from == saved + ckpt_every and not pd.isna(reached) and row.resumed_from <= reached
            assert row.resumed_from == saved or written, (
                f"{where} resumed from step {row.resumed_from}, but the last checkpoint saved before it was "
                f"step {saved} (and the round before reached step {reached}): it read "
                f"{'an older' if row.resumed_from < saved else 'the wrong'} checkpoint")
            assert row.first_step == row.resumed_from + 1, (
                f"{where} resumed from step {row.resumed_from} but trained first step "
                f"{row.first_step}: steps were skipped")
        return self

    def __repr__(self) -> str:
        return self.table.to_string(index=False)

    def _repr_html_(self) -> str:
        return self.table.to_html(index=False)


def elastic_resumes(run, *, tol: float) -> Resumes:
    """What each restart of an elastic run resumed from and redid, for ``.check()`` (lesson 10).

    Args:
        run: an elastic ``Run`` whose script logs ``loss`` every step, ``resumed_from`` when it
            resumes and ``checkpoint_saved`` when it saves (as lesson 10's does).
        tol: the largest loss difference allowed between a step and the same step done again.

    Returns:
        a ``Resumes``: ``.table`` (one row per round) and ``.check(ckpt_every=...)``.

    Example (lesson 10)::

        labkit.elastic_resumes(run, tol=1e-4).check(ckpt_every=5)
    """
    import pandas as pd

    rounds = elastic_rounds(run)
    losses = elastic_losses(run).set_index(["round", "step"])["loss"]
    df = run.metrics()
    df = df.assign(round=_assign_rounds(df))
    restarts = df.groupby("round")["restart"].max() if "restart" in df else {}
    rows, previous, saved = [], None, None
    for row in rounds.itertuples():
        redone, gaps = [], []
        if previous is not None and not pd.isna(row.resumed_from) and not pd.isna(previous.last_step):
            redone = list(range(int(row.resumed_from) + 1, int(previous.last_step) + 1))
            gaps = [abs(losses[row.round, s] - losses[previous.round, s]) for s in redone
                    if (row.round, s) in losses.index and (previous.round, s) in losses.index]
        rows.append({"round": row.round, "world_size": row.world_size,
                     "restart": int(restarts.get(row.round, 0)),
                     "resumed_from": row.resumed_from,
                     "saved_before": saved,
                     "reached_before": None if previous is None else previous.last_step,
                     "first_step": row.first_step, "redone": redone, "compared": len(gaps),
                     "max_gap": max(gaps) if gaps else float("nan")})
        previous = row
        if not pd.isna(row.last_checkpoint):  # a round that saved none leaves the one before in place
            saved = row.last_checkpoint
    table = pd.DataFrame(rows).astype({"resumed_from": "Int64", "saved_before": "Int64", "reached_before": "Int64",
                                       "first_step": "Int64"})
    return Resumes(table, set(losses.index.get_level_values("step")), tol)


def plot_elastic(run, *, axes=None, title: str | None = None):
    """World size and loss over time, with the moments nodes left and joined (lesson 10).

    Args:
        run: an elastic ``Run`` (its ``info["events"]`` marks the kills and joins).
        axes: two matplotlib Axes (world size, loss) to draw on; new ones by default.
        title: the figure's title.

    Returns:
        the two Axes.

    Example (lesson 10)::

        labkit.plot_elastic(run)
    """
    import matplotlib.pyplot as plt

    losses = elastic_losses(run)
    rounds = elastic_rounds(run)
    if axes is None:
        _, axes = plt.subplots(2, 1, figsize=(9, 5), sharex=True,
                               gridspec_kw={"height_ratios": [1, 2]})
    top, bottom = axes
    sizes = [int(w) for w in rounds["world_size"]]
    for row in rounds.itertuples():
        top.hlines(row.world_size, row.start_s, row.end_s, color="k", lw=3)
    for k, (before, after) in enumerate(zip(rounds.itertuples(), list(rounds.itertuples())[1:])):
        for ax in axes:  # between two rounds nobody trains: the rendezvous re-forms the world
            ax.axvspan(before.end_s, after.start_s, color="0.92", lw=0,
                       label="nobody trains: a new round forms" if k == 0 and ax is bottom else None)
    top.set(ylabel="world size", ylim=(0, max(sizes + [1]) + 0.8), yticks=sorted(set(sizes)))
    for number, part in losses.groupby("round"):
        bottom.plot(part["time_s"], part["loss"], marker=".", ms=3, lw=1.2,
                    label=f"round {number}: {int(part['world_size'].iloc[0])} rank(s), steps "
                          f"{int(part['step'].min())}–{int(part['step'].max())}")
    bottom.set(xlabel="seconds since launch", ylabel="training loss (mean of ranks)")
    origin = run.info.get("start_time") or 0
    for event in run.info.get("events", []):
        if event.get("time") is None:
            continue
        kill = event["event"] == "KillNode"
        for ax in axes:
            ax.axvline(event["time"] - origin, color="tab:red" if kill else "tab:green",
                       ls=":" if kill else "--", lw=1.5)
        top.annotate(f"node {event.get('node')} {'killed' if kill else 'joins'}",
                     (event["time"] - origin, 0.2), xytext=(3, 0), textcoords="offset points",
                     fontsize=8, color="tab:red" if kill else "tab:green")
    bottom.legend(fontsize=8)
    top.set_title(title or f"{run.name}: world size and loss as nodes leave and join")
    return axes
