"""Process bookkeeping shared by the launcher and the per-rank entry point.

Standard library only: the entry point imports this before the training script
(and torch) is loaded, so it must be cheap and safe everywhere.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

#: The launching kernel's pid and process token, which every rank watches (see _entry).
LAUNCHER_PID_ENV = "LABKIT_LAUNCHER_PID"
LAUNCHER_TOKEN_ENV = "LABKIT_LAUNCHER_TOKEN"


def process_token(pid: int) -> str | None:
    """Return a string that identifies *this* incarnation of ``pid``.

    On Linux it is the process start time from ``/proc/<pid>/stat``, so a pid
    that the kernel has reused for another program gives a different token.
    Elsewhere it is ``"alive"`` while the pid exists. ``None`` if the process
    is gone.
    """
    stat = Path(f"/proc/{pid}/stat")
    if sys.platform.startswith("linux"):
        try:
            text = stat.read_text()
        except OSError:
            return None
        # The command name (field 2) may contain spaces; fields after ")" are fixed.
        fields = text.rsplit(")", 1)[1].split()
        if fields and fields[0] == "Z":  # a zombie has finished running
            return None
        return fields[19] if len(fields) > 19 else "alive"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        return "alive"
    return "alive"


def is_same_process(pid: int, token: str | None) -> bool:
    """True while ``pid`` still runs and is the process that ``token`` named."""
    current = process_token(pid)
    if current is None:
        return False
    return token is None or current == token


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to ``pid`` and, when it leads its own process group, to the group.

    torchrun starts every rank in a new session, so a rank's process group
    holds the rank and its DataLoader workers, and nothing else: signalling
    the group takes the workers down with it.
    """
    try:
        # Never the caller's own group: that would signal the notebook's kernel.
        if hasattr(os, "getpgid") and os.getpgid(pid) == pid != os.getpgrp():
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _ancestors() -> set[int]:
    """This process and every process above it (never to be killed as the cluster's)."""
    found, pid = set(), os.getpid()
    while pid > 1 and pid not in found:
        found.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
    return found


def marked_processes(marker: bytes) -> list[int]:
    """Pids of processes whose environment holds ``marker`` (Linux /proc), but not this one or
    its ancestors. slurmstepd leaves its slurmd's process tree (it is re-parented to init), so
    a job's processes are found by the ``SLURM_CONF=...`` they all inherited (lesson 09's
    one-host cluster, ``labkit._slurm_cluster``)."""
    if not os.path.isdir("/proc"):
        return []
    mine, found = _ancestors(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in mine:
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if marker in environ.split(b"\0"):
            found.append(int(entry))
    return found
