"""The launcher's process work: which ranks still run, their children, signals to a tree.

psutil reads processes the same way on Linux and macOS, and tells a reused pid by its start
time. It is the kernel's side only: a rank imports nothing but the standard library before
its script (``labkit._rank.proc`` has the token both sides compare).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import psutil

from labkit import _rundir
from labkit._rank import proc
from labkit._rank.zygote import NAME as zygote_name

#: Seconds a process may seem to have started after the pid file that names it was written
#: (the file's time and the process's start time come from two clocks).
_CLOCK_SLACK_S = 2.0


def children(pid: int) -> list[int]:
    """The pids whose parent is ``pid`` (none when it is gone); for an agent's zygote
    (``labkit._rank.zygote``), the ranks it forked in its place.

    Example (an elastic run's node killed whole: its agent and the ranks it started)::

        ranks = children(agent.pid)
    """
    try:
        kids = psutil.Process(pid).children()
    except psutil.Error:
        return []
    found = []
    for kid in kids:
        try:
            zygote = kid.name() == zygote_name
        except psutil.Error:
            continue
        found.extend(children(kid.pid) if zygote else [kid.pid])
    return found


def running(pid: int) -> bool:
    """True while ``pid`` runs (a zombie has finished; a pid nobody has is not running).

    Example::

        assert not running(agent_pid), "the agent outlived its launcher"
    """
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to ``pid`` and, when it leads its own process group, to the group.

    torchrun starts every rank in a new session, so a rank's process group holds the rank and
    its DataLoader workers, and nothing else: signalling the group takes the workers down with
    it. Never the caller's own group: that would signal the notebook's kernel.

    Example::

        kill_tree(rank_pid, signal.SIGKILL)
    """
    try:
        if hasattr(os, "getpgid") and os.getpgid(pid) == pid != os.getpgrp():
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def processes_with_env(name: str, value: str) -> list[int]:
    """Pids of the processes whose environment sets ``name=value``, but not this one or its
    ancestors (never to be killed as the cluster's).

    slurmstepd leaves its slurmd's process tree (it is re-parented to init), so a job's
    processes are found by the ``SLURM_CONF`` they all inherited (``tools/slurm_cluster.py``).

    Example::

        processes_with_env("SLURM_CONF", "/tmp/labkit-slurm-x/slurm.conf")
    """
    mine = {p.pid for p in psutil.Process().parents()} | {os.getpid()}
    wanted = f"{name}={value}"
    return [candidate.pid for candidate in psutil.process_iter()
            if candidate.pid not in mine and wanted in _environment(candidate)]


def _environment(process: psutil.Process) -> list[str]:
    """Every ``NAME=value`` of a process's environment ([] when it is gone or not ours).

    On Linux, read whole from /proc: slurmstepd writes its title ("slurmstepd: [1.0]") over
    the start of its environment, and psutil's ``environ()`` stops at the first empty entry,
    so it would see none of what follows.
    """
    try:
        if sys.platform.startswith("linux"):
            with open(f"/proc/{process.pid}/environ", "rb") as f:
                return f.read().decode(errors="replace").split("\0")
        return [f"{k}={v}" for k, v in process.environ().items()]
    except (OSError, psutil.Error):  # gone, a zombie, or another user's
        return []


def recorded_ranks(run_dir: str | os.PathLike) -> dict[int, tuple[int, str | None, float]]:
    """{rank: (pid, token, when its pid file was written)} as each rank's entry point recorded
    it (latest attempt)."""
    found = {}
    for rank, path in _rundir.pid_files(run_dir).items():
        try:
            data = json.loads(path.read_text())
            found[rank] = (int(data["pid"]), data.get("token"), path.stat().st_mtime)
        except (ValueError, KeyError, TypeError, OSError):
            continue
    return found


def is_rank(pid: int, token: str | None, written: float) -> bool:
    """True while ``pid`` runs and is the rank that wrote its pid file at time ``written``.

    On Linux the rank's token (its start time in clock ticks) is exact. Elsewhere the token
    only says "alive", so psutil's start time must not be later than the pid file: a process
    started after the rank wrote it is another program that got the pid.
    """
    if token not in (None, "alive"):
        return proc.is_same_process(pid, token)
    try:
        process = psutil.Process(pid)
        return (process.status() != psutil.STATUS_ZOMBIE
                and process.create_time() <= written + _CLOCK_SLACK_S)
    except psutil.Error:
        return False


def live_ranks(run_dir: str | os.PathLike) -> dict[int, int]:
    """{rank: pid} of recorded ranks that still run.

    Example::

        for rank, pid in live_ranks(run.run_dir).items(): ...
    """
    return {rank: pid for rank, (pid, token, written) in recorded_ranks(Path(run_dir)).items()
            if is_rank(pid, token, written)}
