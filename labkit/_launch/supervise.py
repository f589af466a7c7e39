"""Stopping a launch, and asking its ranks where they are.

``stop`` ends every torchrun agent and every rank (SIGTERM, a grace period, then SIGKILL by
recorded pid): after success, failure, timeout or interrupt, nothing is left. On a timeout,
``request_stacks`` asks every live rank for its Python stacks (SIGUSR1, which the rank's entry
point hands to faulthandler) and ``wait_for_stacks`` says where each one was, once it has
(``labkit._diagnose.stacks``). Kernel side.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from labkit._diagnose import stacks
from labkit._launch import procs


def stop(agents, run_dir: Path, *, grace_s: float = 3.0) -> None:
    """End every torchrun agent and every rank: SIGTERM, a grace period, then SIGKILL by
    recorded pid (``agents``: a ``labkit._launch.agents.Agents``).

    Example (the launcher's last step, whatever happened)::

        stop(agents, run.run_dir)
    """
    agents.stop(grace_s)
    deadline = time.monotonic() + 5.0
    while True:
        alive = procs.live_ranks(run_dir)
        if not alive:
            return
        for pid in alive.values():
            procs.kill_tree(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            print(f"labkit: could not stop pids {sorted(alive.values())}", file=sys.stderr)
            return
        time.sleep(0.05)


def request_stacks(run_dir: Path, streams) -> dict[int, tuple[str, int]]:
    """Ask every live rank to print its Python stacks (SIGUSR1 → faulthandler).

    Returns {rank: (log path, offset)}: the dump is what the log holds after offset
    (``streams``: the launch's ``Streams``, which knows each rank's newest log).
    """
    marks = {}
    if not hasattr(signal, "SIGUSR1"):
        return marks
    for rank, pid in procs.live_ranks(run_dir).items():
        mark = streams.log_size(rank)
        if mark is None:
            continue
        try:
            os.kill(pid, signal.SIGUSR1)
            marks[rank] = mark
        except ProcessLookupError:
            pass
    return marks


def read_stacks(marks: dict[int, tuple[str, int]], script: str) -> dict[int, str]:
    """{rank: where it was}, from the dumps ``request_stacks`` asked for, as far as they are
    written: only whole lines are read, so an answer found is final (a dump starts with the
    innermost frames, the ones ``stacks.where`` names)."""
    return _where(_dumps(marks), script)


def wait_for_stacks(marks: dict[int, tuple[str, int]], script: str, *, poll=lambda: None,
                    timeout_s: float = 2.0, every_s: float = 0.05) -> dict[int, str]:
    """``read_stacks`` once every asked rank has written where it is and no new line has come
    since the last read (the rest of its dump is there too), or after ``timeout_s`` (a rank
    whose threads are all outside ``script`` never says: it costs the whole wait). ``poll``
    runs before each read (the launcher reads the ranks' lines as they come).

    Example (what a timeout does)::

        marks = request_stacks(run_dir, streams)
        where = wait_for_stacks(marks, "scripts/10_hang.py", poll=streams.poll)
    """
    deadline, dumps = time.monotonic() + timeout_s, None
    while True:
        time.sleep(every_s)
        poll()
        dumps, before = _dumps(marks), dumps
        found = _where(dumps, script)
        if (len(found) == len(marks) and dumps == before) or time.monotonic() > deadline:
            return found


def _dumps(marks: dict[int, tuple[str, int]]) -> dict[int, str]:
    """{rank: what its log holds after its mark, up to its last whole line}."""
    dumps = {}
    for rank, (path, offset) in marks.items():
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                text = f.read().decode("utf-8", errors="replace")
        except OSError:
            continue
        dumps[rank] = text[:text.rfind("\n") + 1]
    return dumps


def _where(dumps: dict[int, str], script: str) -> dict[int, str]:
    found = {rank: stacks.where(text, script, stacks.FAULTHANDLER) for rank, text in dumps.items()}
    return {rank: where for rank, where in found.items() if where}
