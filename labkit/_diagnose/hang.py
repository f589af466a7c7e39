"""Reading a hung run from outside: py-spy dumps of every rank while the run hangs (lesson 10).

``py-spy dump --pid PID`` prints the Python stack of a running process without stopping it
and without any code in it: what you would type in a second terminal while a job hangs.
``labkit.py_spy_dump()`` is an event of ``launch``: once every rank has been quiet for
``after_quiet_s`` seconds, labkit runs exactly that command for each rank, prints what it
says in the cell, and keeps it::

    spy = labkit.py_spy_dump(after_quiet_s=2)
    try:
        labkit.launch("scripts/10_hang.py", nproc=2, events=[spy], hang_timeout_s=5)
    except labkit.LaunchTimeout as err:
        ...
    spy.dumps[0]        # rank 0's stack, as py-spy printed it
    spy.stacks[0]       # 'scripts/10_hang.py:31 in <module>, inside all_reduce'

py-spy reads another process's memory, which needs ptrace permission: root, a container
started with ``--cap-add=SYS_PTRACE``, or ``kernel.yama.ptrace_scope`` at 0 (Linux); sudo
on macOS. Where it cannot attach, ``spy.skipped`` says why and nothing else breaks.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from labkit._diagnose import stacks
from labkit._launch import procs
from labkit._launch.events import Event

_ANSI = re.compile(r"\x1b\[[0-9;]*m")   # py-spy colours its output when the environment asks
_PTRACE_HINT = ("attaching to another process needs ptrace permission: run as root, start the "
                "container with --cap-add=SYS_PTRACE, or set kernel.yama.ptrace_scope to 0 "
                "(Linux); use sudo on macOS.")


def py_spy_executable() -> str | None:
    """The py-spy next to this Python (the course environment's), else the one on PATH."""
    here = Path(sys.executable).parent / ("py-spy.exe" if os.name == "nt" else "py-spy")
    if here.is_file():
        return str(here)
    return shutil.which("py-spy")


def dump_stack(pid: int, *, native: bool = False, timeout_s: float = 20.0) -> str:
    """``py-spy dump --pid PID``: the Python stack of every thread of a running process.

    Args:
        pid: the process to read (it keeps running).
        native: also show C/C++ frames (``--native``): where inside gloo or NCCL it waits.
        timeout_s: give up after this long.

    Returns:
        py-spy's output.

    Raises:
        FileNotFoundError: py-spy is not installed (with a HINT).
        PermissionError: py-spy may not attach to the process (why, and what would allow it).
        RuntimeError: py-spy failed otherwise (its message).

    Example (lesson 10)::

        print(labkit.dump_stack(1234))
    """
    exe = py_spy_executable()
    if exe is None:
        raise FileNotFoundError("py-spy is not installed. HINT: pip install py-spy (the course's "
                                "environment has it; run `make lab` again after a git pull).")
    argv = [exe, "dump", "--pid", str(int(pid))] + (["--native"] if native else [])
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "CLICOLOR_FORCE")}
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s,
                             env=dict(env, NO_COLOR="1"))
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"py-spy did not answer within {timeout_s:g} s for pid {pid}") from None
    text = _ANSI.sub("", out.stdout + out.stderr).strip()
    if out.returncode != 0:
        if re.search(r"permission|not permitted|ptrace", text, re.IGNORECASE):
            raise PermissionError(f"py-spy could not attach to pid {pid}: {text.splitlines()[-1]} "
                                  f"HINT: {_PTRACE_HINT}")
        raise RuntimeError(f"py-spy failed on pid {pid} (exit code {out.returncode}): {text}")
    return _ANSI.sub("", out.stdout)


class PySpyDump(Event):
    """Run ``py-spy dump`` on every live rank once the run has been quiet for a while.

    Attributes (after it fired):
        dumps: {rank: py-spy's output}.
        stacks: {rank: where its script waits}, e.g. ``'scripts/x.py:31 in <module>, inside
            all_reduce (distributed_c10d.py)'`` (the form of ``LaunchTimeout.stacks``).
        commands: {rank: the command that was run}.
        skipped: why nothing was dumped ("" when it worked).
        pids: {rank: pid}.
        seconds: {rank: how long its dump took}.
    """

    def __init__(self, after_quiet_s: float = 2.0, *, native: bool = False):
        super().__init__()
        if isinstance(after_quiet_s, bool) or not isinstance(after_quiet_s, (int, float)) \
                or not after_quiet_s > 0:
            raise ValueError(f"after_quiet_s must be a positive number of seconds, got "
                             f"{after_quiet_s!r}")
        self.after_quiet_s = float(after_quiet_s)
        self.native = native
        self.what = f"py-spy dump of every rank after {self.after_quiet_s:g} s without output"
        self.dumps: dict[int, str] = {}
        self.stacks: dict[int, str] = {}
        self.commands: dict[int, str] = {}
        self.pids: dict[int, int] = {}
        self.seconds: dict[int, float] = {}
        self.skipped = ""

    def check(self, plan) -> None:
        limit = plan.hang_timeout_s if plan.hang_timeout_s is not None else plan.timeout_s
        if limit is not None and self.after_quiet_s >= limit:
            raise ValueError(
                f"py_spy_dump(after_quiet_s={self.after_quiet_s:g}) would come after the run is "
                f"stopped (hang_timeout_s/timeout_s {limit:g} s). HINT: a smaller after_quiet_s, "
                f"e.g. {max(1, limit / 2):g}.")

    def due(self, progress) -> bool:
        return progress.quiet_s is not None and progress.quiet_s >= self.after_quiet_s

    def fire(self, ctx, progress) -> dict:
        script = ctx.extra.get("script", "")
        self.pids = dict(sorted(procs.live_ranks(ctx.run_dir).items()))
        ctx.emit(f"── every rank quiet for {progress.quiet_s:.1f} s: py-spy dump of each ──")
        for rank, pid in self.pids.items():
            command = f"py-spy dump --pid {pid}" + (" --native" if self.native else "")
            self.commands[rank] = command
            ctx.emit(f"$ {command}     # rank {rank}")
            began = time.monotonic()
            try:
                text = dump_stack(pid, native=self.native)
            except (FileNotFoundError, PermissionError, RuntimeError) as err:
                self.skipped = str(err)
                ctx.emit(f"skipped: {err}")
                break
            self.seconds[rank] = time.monotonic() - began
            self.dumps[rank] = text
            found = stacks.where(text, script, stacks.PY_SPY) if script else None
            if found:
                self.stacks[rank] = found
            shown = stacks.excerpt(text.rstrip().splitlines(), script, stacks.PY_SPY)
            for line in shown:
                ctx.emit(f"[py-spy rank{rank}] {line}")
            hidden = len(text.rstrip().splitlines()) - len(shown)
            if hidden > 0:
                ctx.emit(f"[py-spy rank{rank}] … {hidden} more line(s): other threads (spy.dumps[{rank}])")
        return {"pids": {str(r): p for r, p in self.pids.items()},
                "seconds": {str(r): round(t, 4) for r, t in self.seconds.items()},
                "stacks": {str(r): s for r, s in self.stacks.items()}, "skipped": self.skipped}


def py_spy_dump(after_quiet_s: float = 2.0, *, native: bool = False) -> PySpyDump:
    """An event for ``launch(events=[...])``: ``py-spy dump`` every rank once all are quiet.

    Args:
        after_quiet_s: seconds without a printed line or a metrics line from any rank (a hang)
            before the dumps are taken. Keep it below ``hang_timeout_s``.
        native: also show C/C++ frames (``py-spy dump --native``).

    Returns:
        the event; after the launch, its ``dumps``, ``stacks`` and ``skipped`` say what it found.

    Example (lesson 10)::

        spy = labkit.py_spy_dump(after_quiet_s=2)
        labkit.launch("scripts/10_hang.py", nproc=2, events=[spy], hang_timeout_s=5)
    """
    return PySpyDump(after_quiet_s, native=native)
