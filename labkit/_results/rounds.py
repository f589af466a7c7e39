"""What a round of a run is: the lines that begin one, which round a line is in, what changed.

A round is one stretch of training with one set of processes: the run's first start, then
every torchrun restart (lesson 05) and every change of the world size, as nodes leave and join
(lesson 10). Rank 0's lines say where each round began (``round_starts``); every line belongs
to the last round that began at or before its time (``round_of``). Read by ``elastic`` (lesson
10's tables and charts), ``plots`` (every loss curve) and the launcher's live chart. Standard
library only.
"""

from __future__ import annotations


def _given(value) -> bool:
    """A value a line holds: not missing, and not the NaN a DataFrame puts where it is missing."""
    return value is not None and value == value


def _value(row: dict, key: str, default=None):
    value = row.get(key)
    return value if _given(value) else default


def round_starts(records, *, step_back: bool = True) -> list[dict]:
    """Rank 0's lines that begin a round, in time order (the first line is the first round's).

    A round begins where rank 0's world size or torchrun's restart count changes, where it logs
    ``resumed_from``, and (``step_back``) where its step goes back. The live chart leaves the last
    out: a script may log a second experiment from step 0 in one run. Every rank's line then
    belongs to the last round that began at or before its time.

    Example::

        starts = round_starts(df.to_dict("records"))
        [(r["world_size"], r.get("resumed_from")) for r in starts]
    """
    zero = sorted((r for r in records if r.get("rank") == 0), key=lambda r: r["time"])
    return [row for previous, row in zip([None, *zero], zero)
            if previous is None or begins_again(row, previous, step_back=step_back)]


def begins_again(row: dict, previous: dict, *, step_back: bool = True) -> bool:
    """True where one rank's line ``row`` says its rank started again after ``previous``: its
    world size or restart count changed, it logged ``resumed_from``, or (``step_back``) its
    step went back."""
    return (_given(row.get("resumed_from"))
            or _value(row, "world_size") != _value(previous, "world_size")
            or _value(row, "restart", 0) != _value(previous, "restart", 0)
            or (step_back and row["step"] < previous["step"]))


def round_of(times, starts: list[dict]) -> list[int]:
    """The round of each time: the last of ``starts`` (``round_starts``) that began at or before
    it; a time before the first start (a rank that logged a moment before rank 0) is in round 0."""
    from bisect import bisect_right

    begun = [row["time"] for row in starts]
    return [max(0, bisect_right(begun, t) - 1) for t in times]


def what_changed(before: dict, start: dict) -> str:
    """What began a round (``start``, rank 0's first line of it) after the round that began at
    ``before``: ``"restart 1"`` (torchrun restarted the workers), ``"1 rank"`` (a node left or
    joined), both, or ``"resumed"`` (the script logged ``resumed_from`` and nothing else changed).

    Example::

        what_changed({"restart": 0, "world_size": 4}, {"restart": 1, "world_size": 2})
        # 'restart 1, 2 ranks'
    """
    changed = []
    restart = _value(start, "restart", 0)
    if restart != _value(before, "restart", 0):
        changed.append(f"restart {int(restart)}")
    size = _value(start, "world_size")
    if size is not None and size != _value(before, "world_size"):
        changed.append(f"{int(size)} rank{'s' * (size != 1)}")
    return ", ".join(changed) or "resumed"
