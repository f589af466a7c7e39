"""Things labkit does to a run while it runs, each when the run reaches a given point.

``launch(..., events=[...])`` takes them (lesson 10)::

    spy = labkit.py_spy_dump(after_quiet_s=2)          # a hang: read every rank's stack
    labkit.launch(script, nproc=2, events=[spy], hang_timeout_s=4)
    labkit.launch(script, nproc=1, nnodes=2, min_nodes=1, max_restarts=3,
                  events=[labkit.kill_node(1, at_step=12), labkit.add_node(at_step=24)])

The launcher's poll loop asks a ``Driver`` about them several times a second. The driver
reads how far the run has got (``Progress``: the highest step any rank has logged, and how
long every rank has been quiet), and fires the next event once it is due. Events fire in
the order given, each once; what each did is kept in ``run.info["events"]``, with the time
and the step, so a chart can mark it afterwards.

``Progress`` is also what ``hang_timeout_s`` asks: a run in which no rank has printed or logged
anything for that long is stopped as hung.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from labkit import _rundir
from labkit._launch.tail import LineTail, parse_records

_READ_EVERY_S = 0.2


class Progress:
    """How far a run has got, read from its folder (cheaply, at most every 0.2 s).

    Attributes:
        step: the highest step any rank has logged (None before the first metrics line).
        world_size: the world size stamped on rank 0's newest metrics line (None before one).
        world_steps: how many steps rank 0 has logged since the world took that size.
        quiet_s: seconds since any rank last printed a line or logged metrics (None until one
            has: a run still starting up is not quiet, it has not spoken yet).
    """

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self.step: int | None = None
        self.world_size: int | None = None
        self._steps_at_size: set[int] = set()
        self._tails: dict[str, LineTail] = {}
        self._sizes: dict[str, int] = {}
        self._last_change: float | None = None
        self._last_read = 0.0
        self._newest = -1.0

    def update(self, *, force: bool = False) -> "Progress":
        now = time.monotonic()
        if not force and now - self._last_read < _READ_EVERY_S:
            return self
        self._last_read = now
        changed = False
        for path in _rundir.metrics_files(self.run_dir):
            tail = self._tails.setdefault(str(path), LineTail(path))
            records, _ = parse_records(tail.new_lines())
            for record in records:
                changed = True
                self.step = record["step"] if self.step is None else max(self.step, record["step"])
                if record["rank"] == 0 and record.get("time", 0) >= self._newest:
                    self._newest = record.get("time", 0)
                    if record.get("world_size") != self.world_size:
                        self.world_size, self._steps_at_size = record.get("world_size"), set()
                    self._steps_at_size.add(record["step"])
        for _attempt, _rank, path in _rundir.rank_logs(self.run_dir):
            size = _size(path)
            if size != self._sizes.get(str(path), 0):
                self._sizes[str(path)] = size
                changed = True
        if changed:
            self._last_change = now
        return self

    @property
    def world_steps(self) -> int:
        return len(self._steps_at_size)

    @property
    def quiet_s(self) -> float | None:
        return None if self._last_change is None else time.monotonic() - self._last_change


def _size(path) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


@dataclass
class Context:
    """What an event may use when it fires: the run and the launcher's pieces."""

    run_dir: Path
    emit: object                 # print a line in the cell
    agents: object               # labkit._launch.agents.Agents (or elastic.ElasticAgents)
    streams: object              # labkit._launch.streams.Streams
    start_agent: object = None   # callable() -> node: start one more agent (elastic runs)
    extra: dict = field(default_factory=dict)


class Event:
    """One thing to do to a running launch, once, when ``due(progress)`` says so.

    Subclasses set ``what`` (a short description for messages) and implement ``due`` and
    ``fire``; ``fire`` returns a dict recorded in ``run.info["events"]``.
    """

    what = "an event"

    def __init__(self):
        self.fired = False
        self.record: dict | None = None

    def due(self, progress: Progress) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError

    def fire(self, ctx: Context, progress: Progress) -> dict:  # pragma: no cover - abstract
        raise NotImplementedError

    def check(self, plan) -> None:
        """Raise ValueError/TypeError (with a HINT) if this event cannot work with ``plan``."""

    def check_order(self, earlier: tuple) -> None:
        """Raise ValueError (with a HINT) if this event cannot come after ``earlier``."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__}: {self.what}{', fired' if self.fired else ''}>"


def check_events(events, plan) -> tuple:
    """The events of a launch, checked at the door: Event objects, not yet used, each
    possible with this launch."""
    if events is None:
        return ()
    if isinstance(events, Event):
        events = [events]
    if isinstance(events, (str, bytes)) or not hasattr(events, "__iter__"):
        raise TypeError(f"events must be a list of labkit events, e.g. "
                        f"[labkit.kill_node(1, at_step=12)], got {events!r}")
    events = tuple(events)
    for event in events:
        if not isinstance(event, Event):
            raise TypeError(f"events must hold labkit events (labkit.kill_node, labkit.add_node, "
                            f"labkit.py_spy_dump), got {event!r}")
        if event.fired:
            raise ValueError(f"{event!r} has already fired in an earlier launch. HINT: make a new "
                             f"one for each launch; the old one keeps what it found.")
        event.check(plan)
    for i, event in enumerate(events):
        event.check_order(events[:i])
    if len({id(e) for e in events}) != len(events):
        raise ValueError("the same event object is listed twice. HINT: make one per thing to do.")
    return events


class Driver:
    """Fires a launch's events in order, each once, when due."""

    def __init__(self, events: tuple, ctx: Context, progress: Progress, info: dict):
        self.pending = list(events)
        self.ctx = ctx
        self.progress = progress
        self.info = info
        self.info.setdefault("events", [])

    def poll(self) -> None:
        if not self.pending:
            return
        self.progress.update()
        while self.pending and self.pending[0].due(self.progress):
            event = self.pending.pop(0)
            record = {"event": type(event).__name__, "what": event.what, "time": time.time(),
                      "step": self.progress.step}
            record.update(event.fire(self.ctx, self.progress) or {})
            event.fired, event.record = True, record
            self.info["events"].append(record)
            self.progress.update(force=True)

    def finish(self) -> None:
        """Say which events never fired (the run ended first)."""
        for event in self.pending:
            self.ctx.emit(f"note: {event.what} did not happen: the run ended first "
                          f"(last logged step {self.progress.step}).")
            self.info["events"].append({"event": type(event).__name__, "what": event.what,
                                        "time": None, "step": None, "fired": False})
