"""Process tokens (is a pid still the process it was?), and how a rank or an agent ends.

Shared by the ranks, the agents and the launcher.

A rank watches its launcher, and the launcher its ranks, by pid; a pid the kernel has reused
for another program must not count. The token is the process's start time as Linux keeps it
(``/proc/<pid>/stat``, in clock ticks since boot: exact, and immune to clock changes).

Standard library only: the entry point imports this before the training script (and torch)
is loaded. The kernel-side process work (children, trees, signals) uses psutil instead:
``labkit._launch.procs``.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
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


def exit_code(code) -> int:
    """The exit status Python gives ``SystemExit(code)``: None is 0, an int itself, anything else
    (``sys.exit("message")``) is printed to stderr and gives 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def flush_streams() -> None:
    """Flush stdout and stderr; never raise (the process is ending: a stream may be closed, or
    a signal handler may have interrupted a write to it)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, RuntimeError):
            pass


def leave(code: int, flush=flush_streams) -> None:
    """End this process as Python would, then skip the interpreter's final teardown.

    In the interpreter's own order: the threading module's exit calls (they tell
    ``concurrent.futures`` pools to stop), the wait for non-daemon threads, the atexit
    handlers, then ``flush`` (a rank's also pushes its metrics) and ``os._exit``. What is
    skipped is the teardown of every module and the last garbage collection, which for a
    process that has loaded torch takes about half a second of CPU (the ranks and agents of a
    launch each pay it) and, in a rank, can die inside gloo's threads
    (``labkit._rank.entry._exit`` says how).
    """
    for call in reversed(getattr(threading, "_threading_atexits", [])):  # what Python calls first
        call()
    main_thread = threading.main_thread()
    for thread in threading.enumerate():
        if thread is not main_thread and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    flush()
    os._exit(code)
