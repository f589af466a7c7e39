"""A rank's SIGTERM: keep what it logged, and let a rank that is already ending end by itself.

torchrun ends every other rank with SIGTERM as soon as one fails (and a scheduler may send
one too). ``flush_on_sigterm`` makes that signal write the rank's last metrics lines to disk
first, then end the rank by it as it would have; ``ending`` is set once the script has
returned or raised, and a SIGTERM after that gives the rank a few seconds to finish on its
own. Used by ``labkit._rank.entry``.

Standard library only (a rank loads it before the script and torch).
"""

from __future__ import annotations

import os
import signal
import threading

from labkit import metrics
from labkit._rank import proc


def flush_output() -> None:
    """Push the metrics buffer, stdout and stderr to disk; never raise (the rank is ending)."""
    try:
        metrics.flush()
    except RuntimeError:  # a signal handler interrupted a write to the same buffer
        pass
    proc.flush_streams()


# Set once the script has returned or raised: the rank is then on its way out.
ending = threading.Event()
_ENDING_GRACE_S = 5.0


def _die_by_sigterm() -> None:
    """End the rank by SIGTERM (``_die_now``), unless it is already ending.

    Once the script has returned or raised, the rank is already ending: it has a failure to
    record, or only its exit left. torchrun stops every other rank as soon as one fails, and
    killing this one then would lose its own error, or report a rank that finished as killed
    (CI saw both). So it is given ``_ENDING_GRACE_S`` to end by itself, then killed as before.
    """
    if ending.is_set():
        timer = threading.Timer(_ENDING_GRACE_S, _die_now)
        timer.daemon = True  # entry's _exit waits for non-daemon threads
        timer.start()
        return
    _die_now()


def _die_now() -> None:
    """Flush what this rank wrote, then end it by SIGTERM, as if no handler had been set."""
    flush_output()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    else:  # signal.signal works only in the main thread; libc's signal() works in any
        try:
            import ctypes

            ctypes.CDLL(None).signal(int(signal.SIGTERM), 0)  # 0 is SIG_DFL
        except (OSError, AttributeError):
            os._exit(128 + signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)


def _on_sigterm(signum, frame) -> None:
    _die_by_sigterm()


def _sigterm_watch(read_fd: int) -> None:
    while True:
        try:
            received = os.read(read_fd, 64)
        except OSError:
            return
        if not received:
            return
        # A script that set a SIGTERM handler of its own (lesson 09's agreed stop) handles the
        # signal itself: the pipe hears every SIGTERM, whoever's handler runs.
        if signal.SIGTERM in received and signal.getsignal(signal.SIGTERM) is _on_sigterm:
            _die_by_sigterm()


def _undo_in_child() -> None:
    """A forked child (a DataLoader worker) shares the pipe: its SIGTERM must not end the rank."""
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except ValueError:  # forked from a thread other than the main one
        pass


def flush_on_sigterm() -> None:
    """Keep the metrics lines a rank logged in its last half second when SIGTERM ends it.

    torchrun sends SIGTERM to every other rank when one fails; the default action
    kills at once, and what the metrics buffer held was lost (lesson 05's check
    compares the lines logged just before a crash). Python runs a signal handler
    only in the main thread, and only once it is back in Python: a rank blocked in
    a gloo or NCCL collective never is. So the handler also writes the signal's
    number to a pipe (``signal.set_wakeup_fd``) from whichever thread received it,
    and a watcher thread that reads the pipe flushes and ends the rank. Whichever
    of the two comes first does it; both do the same. A script that sets its own
    SIGTERM handler (a clean stop on a scheduler's signal) replaces both: the
    watcher then leaves the rank alone.
    """
    if not hasattr(signal, "set_wakeup_fd") or os.name != "posix":
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    try:
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except ValueError:  # not the main thread: leave the default action
        os.close(read_fd)
        os.close(write_fd)
        return
    signal.signal(signal.SIGTERM, _on_sigterm)
    os.register_at_fork(after_in_child=_undo_in_child)
    threading.Thread(target=_sigterm_watch, args=(read_fd,), name="labkit-sigterm", daemon=True).start()
