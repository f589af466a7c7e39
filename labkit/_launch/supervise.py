"""Stopping a launch, and asking its ranks where they are.

``stop`` ends every torchrun agent and every rank (SIGTERM, a grace period, then SIGKILL by
recorded pid): after success, failure, timeout or interrupt, nothing is left. On a timeout,
``request_stacks`` asks every live rank for its Python stacks (SIGUSR1, which the rank's entry
point hands to faulthandler) and ``read_stacks`` says where each one was
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
    """{rank: where it was}, from the dumps ``request_stacks`` asked for."""
    found = {}
    for rank, (path, offset) in marks.items():
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                text = f.read().decode("utf-8", errors="replace")
        except OSError:
            continue
        where = stacks.where(text, script, stacks.FAULTHANDLER)
        if where:
            found[rank] = where
    return found
