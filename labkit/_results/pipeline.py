"""Pipeline schedules: the order each stage works in, replayed, and read back from a run.

A pipeline-parallel step runs every micro-batch's forward (F) and backward (B) on every stage,
in an order its **schedule** decides. Lesson 12 logs, on every stage, when it worked on which
micro-batch, and checks the order against what the schedule prescribes, here written out::

    labkit.schedule_order("1f1b", stage=0, stages=2, microbatches=4)
    # [('F', 0), ('F', 1), ('B', 0), ('F', 2), ('B', 1), ('F', 3), ('B', 2), ('B', 3)]

and replays the orders with ideal timings (a forward 1 unit, a backward 2, messages free) to
find the bubble that order implies, (p - 1)/(m + p - 1) for both GPipe and 1F1B.

Reading a run (``schedule_events``) needs pandas; the schedules themselves are plain Python.
"""

from __future__ import annotations

#: The schedules this module writes out, by the names lessons and scripts use.
SCHEDULES = ("gpipe", "1f1b")


def _whole(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be a whole number >= {minimum}, got {value!r}")
    return value


def schedule_order(schedule: str, stage: int, *, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """The order in which one pipeline stage runs its forwards and backwards in one step.

    - **GPipe**: every micro-batch's forward, then every backward, in micro-batch order.
    - **1F1B**: a warm-up of ``stages - stage`` forwards (at most ``microbatches``), then one
      backward and one forward in turn while forwards remain, then the remaining backwards.
      This is the order of PyTorch's ``Schedule1F1B``.

    Args:
        schedule: "gpipe" or "1f1b" (any case: "GPipe", "1F1B").
        stage: this stage's number, 0 to ``stages - 1``.
        stages: the number of stages *p*.
        microbatches: the number of micro-batches *m*.

    Returns:
        a list of ``(phase, micro-batch)``: phase "F" or "B", micro-batches from 0.

    Raises:
        ValueError: an unknown schedule, or a stage, stage count or micro-batch count out of range.

    Example (lesson 12)::

        assert logged_order == labkit.schedule_order("GPipe", 1, stages=2, microbatches=8)
    """
    kind = str(schedule).lower()
    if kind not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}: use one of {', '.join(SCHEDULES)}")
    stages, microbatches = _whole("stages", stages, 1), _whole("microbatches", microbatches, 1)
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < stages:
        raise ValueError(f"stage must be 0 to {stages - 1} (stages={stages}), got {stage!r}")
    if kind == "gpipe":
        return [("F", i) for i in range(microbatches)] + [("B", i) for i in range(microbatches)]
    warmup = min(microbatches, stages - stage)            # 1F1B: p - s forwards first
    order, forward = [("F", i) for i in range(warmup)], warmup
    for backward in range(microbatches):                   # then one backward, one forward, ...
        order.append(("B", backward))
        if forward < microbatches:
            order.append(("F", forward))
            forward += 1
    return order


def most_in_flight(order) -> int:
    """The most micro-batches a stage holds at once: forwards done whose backward has not run.

    Each one keeps its activations alive until its backward, so this is the activation memory a
    schedule needs, in micro-batches.

    Args:
        order: one stage's ``(phase, micro-batch)`` list (``schedule_order``, or as logged).

    Returns:
        the largest number of micro-batches in flight (0 for an empty order).

    Raises:
        ValueError: a phase other than "F" or "B".

    Example (lesson 12: GPipe holds every micro-batch, 1F1B at most p - s)::

        labkit.most_in_flight(labkit.schedule_order("1f1b", 0, stages=4, microbatches=8))   # 4
    """
    done, most = {"F": 0, "B": 0}, 0
    for phase, _ in order:
        if phase not in done:
            raise ValueError(f"a phase is 'F' (forward) or 'B' (backward), got {phase!r}")
        done[phase] += 1
        most = max(most, done["F"] - done["B"])
    return most


def replay_schedule(orders, *, forward: float = 1.0, backward: float = 2.0) -> float:
    """The length of a step in which each stage runs its order, with these durations and free messages.

    Stage *s* runs its list in order. A forward of micro-batch *i* waits for stage *s - 1* to
    finish that forward; a backward waits for stage *s + 1* to finish that backward. Each waits
    for the stage's previous work, too. Nothing else costs time.

    Args:
        orders: one ``(phase, micro-batch)`` list per stage, stage 0 first.
        forward: the time of one forward of one micro-batch on one stage.
        backward: the time of one backward (about twice a forward: two products for each one).

    Returns:
        the time at which the last stage finishes its last work.

    Raises:
        ValueError: the orders wait on each other for ever (a deadlock), or a phase is not F or B.

    Example (lesson 12: the bubble an order implies)::

        orders = [labkit.schedule_order("gpipe", s, stages=2, microbatches=8) for s in range(2)]
        bubble = 1 - 8 * 3 / labkit.replay_schedule(orders)      # (p-1)/(m+p-1) = 1/9
    """
    todo = [list(order) for order in orders]
    clock, end = [0.0] * len(todo), {}
    while any(todo):
        ran = False
        for s, work in enumerate(todo):
            while work:
                phase, i = work[0]
                if phase not in ("F", "B"):
                    raise ValueError(f"a phase is 'F' (forward) or 'B' (backward), got {phase!r}")
                after = (s - 1, "F", i) if phase == "F" else (s + 1, "B", i)   # what it waits for
                if 0 <= after[0] < len(todo) and after not in end:
                    break
                took = forward if phase == "F" else backward
                clock[s] = end[(s, phase, i)] = max(clock[s], end.get(after, 0.0)) + took
                work.pop(0)
                ran = True
        if not ran:
            stuck = {s: work[0] for s, work in enumerate(todo) if work}
            raise ValueError(f"the stages' orders wait on each other for ever: each stage's next work "
                             f"{stuck} waits for work that never comes first. HINT: a forward needs the "
                             f"previous stage's forward of that micro-batch, a backward the next stage's "
                             f"backward of it, and each stage its own forward before its backward.")
    return max(clock, default=0.0)


def schedule_events(run, step: int | None = None):
    """What each stage logged about its work in one step: one row per forward or backward.

    The lesson's pipeline script logs ``phase`` ("F"/"B"), ``microbatch``, ``start`` and ``end``
    (wall-clock seconds) for every piece of work, and ``held``: the micro-batches the stage keeps
    for backward once that piece is done (PyTorch's ``stage.fwd_cache``).

    Args:
        run: a ``Run`` (or its ``run.metrics()`` DataFrame).
        step: the step to read (default: the last one logged).

    Returns:
        a DataFrame with columns rank, phase, microbatch, start, end (and held, where the run
        logged it); times in ms from the step's first start; sorted by rank, then start.

    Raises:
        ValueError: the run logged no ``phase``, or nothing at ``step``.

    Example (lesson 12)::

        events = labkit.schedule_events(gpipe)
    """
    df = run.metrics() if hasattr(run, "metrics") else run
    if "phase" not in df.columns:
        raise ValueError("the run logged no pipeline work (no 'phase' column). HINT: the script logs "
                         "metrics.log(step, phase=..., microbatch=..., start=..., end=...) for each piece.")
    df = df.dropna(subset=["phase"])
    step = int(df["step"].max()) if step is None else step
    columns = ["rank", "phase", "microbatch", "start", "end"] + (["held"] if "held" in df.columns else [])
    events = df[df["step"] == step][columns].copy()
    if events.empty:
        raise ValueError(f"no pipeline work logged at step {step}; steps logged: "
                         f"{sorted(int(s) for s in df['step'].unique())}")
    events[["start", "end"]] = (events[["start", "end"]] - events["start"].min()) * 1e3
    events["microbatch"] = events["microbatch"].astype(int)
    events["rank"] = events["rank"].astype(int)
    if "held" in events.columns:
        events["held"] = events["held"].astype(int)
    return events.sort_values(["rank", "start"]).reset_index(drop=True)


def stage_orders(events) -> list[list[tuple[str, int]]]:
    """Each stage's logged order, stage 0 first: ``[[('F', 0), ('F', 1), ...], ...]``.

    Args:
        events: rows of ``schedule_events``.

    Returns:
        one ``(phase, micro-batch)`` list per stage, in the order the stage started them.

    Example (lesson 12)::

        orders = labkit.stage_orders(events)
    """
    stages = sorted(int(r) for r in events["rank"].unique())
    ordered = events.sort_values(["rank", "start"])
    return [list(ordered[ordered["rank"] == s][["phase", "microbatch"]].itertuples(index=False, name=None))
            for s in stages]


def early_starts(events) -> list[str]:
    """Work that started before what it depends on had finished, one sentence each ([] if none).

    Stage *s + 1*'s forward of micro-batch *i* needs stage *s*'s forward of *i* finished; stage
    *s*'s backward of *i* needs stage *s + 1*'s backward of *i* finished.

    Args:
        events: rows of ``schedule_events``.

    Returns:
        a list of sentences naming each early start with its times.

    Example (lesson 12)::

        assert not labkit.early_starts(events)
    """
    at = {(int(r), p, int(i)): (s, e) for r, p, i, s, e in
          events[["rank", "phase", "microbatch", "start", "end"]].itertuples(index=False, name=None)}
    found = []
    for (rank, phase, i), (start, _) in sorted(at.items()):
        needs = (rank - 1, "F", i) if phase == "F" else (rank + 1, "B", i)
        if needs in at and start < at[needs][1]:
            found.append(f"stage {rank} started {phase} of micro-batch {i} at {start:.3f} ms, before stage "
                         f"{needs[0]} finished {needs[1]} of it at {at[needs][1]:.3f} ms")
    return found


def measured_bubble(events) -> float:
    """The share of (stages × the step's span) in which a stage computed nothing, as measured.

    Args:
        events: rows of ``schedule_events`` (wall clock: waits for messages and for the CPU count).

    Returns:
        a fraction, 0 to 1.

    Example (lesson 12)::

        print(f"{labkit.measured_bubble(events):.0%}")
    """
    span = events["end"].max() - events["start"].min()
    busy = (events["end"] - events["start"]).sum()
    return float(1 - busy / (events["rank"].nunique() * span)) if span > 0 else 0.0


def plot_schedule(events, *, ax=None, title: str | None = None):
    """Draw a pipeline step: one row per stage, a bar per forward (light blue) and backward (orange).

    Each bar holds its micro-batch's number where it fits; the white space is the bubble.

    Args:
        events: rows of ``schedule_events``.
        ax: the axes to draw on (a new figure if None).
        title: the axes' title.

    Returns:
        the matplotlib Axes.

    Raises:
        ValueError: no events.

    Example (lesson 12)::

        labkit.plot_schedule(labkit.schedule_events(gpipe), title="GPipe")
    """
    import matplotlib.pyplot as plt

    if len(events) == 0:
        raise ValueError("plot_schedule got no events: read them with labkit.schedule_events(run)")
    stages = sorted(int(r) for r in events["rank"].unique())
    if ax is None:
        _, ax = plt.subplots(figsize=(11, 0.6 + 0.6 * len(stages)))
    widest = float(events["end"].max())
    for e in events.itertuples():
        dark = e.phase == "B"
        ax.broken_barh([(e.start, e.end - e.start)], (e.rank - 0.4, 0.8),
                       color="tab:orange" if dark else "tab:blue", alpha=0.9 if dark else 0.5)
        if e.end - e.start > 0.015 * widest:
            ax.text((e.start + e.end) / 2, e.rank, str(e.microbatch), ha="center", va="center", fontsize=7)
    ax.set_yticks(stages, [f"stage {s}" for s in stages])
    ax.set_ylim(max(stages) + 0.6, min(stages) - 0.6)   # stage 0 on top
    ax.set_xlabel("ms since the step began (wall clock, all ranks)")
    if title is not None:
        ax.set_title(title, fontsize=10)
    return ax
