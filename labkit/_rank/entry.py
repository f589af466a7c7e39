"""Per-rank entry point: ``python -m labkit._rank.entry SCRIPT [ARGS...]``.

labkit.launch asks torchrun to start every rank here instead of in the script
itself. Before running the script as ``__main__`` (exactly as ``python SCRIPT``
would) it:

1. records its pid, so that the launcher can kill it if torchrun cannot;
2. starts a watcher thread that ends the rank, and its DataLoader workers,
   when torchrun or the launching kernel disappears (a kernel killed with
   SIGKILL must leave no orphans);
3. sends stderr to the same file as stdout, so a traceback stays in order
   with the prints that led to it;
4. lets the launcher ask for every thread's Python stack with SIGUSR1 (how a
   timeout names the line a hung rank is stuck on);
5. writes the rank's last metrics lines to disk when torchrun ends it with
   SIGTERM (as it does to every healthy rank when one fails), then dies by
   that signal as it would have, unless the script has already returned or
   raised (see ``labkit._rank.sigterm``);
6. once the script has returned, stops its DataLoader workers while the interpreter
   still works (see ``_stop_loader_workers``);
7. ends the rank without the interpreter's final teardown (see ``_exit``);
8. on a fatal signal from native code (SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL) prints
   every thread's Python stack before the rank dies by it, so that a crash inside PyTorch
   or gloo says which line of the script called into it (``labkit._launch.failures``).

An uncaught exception is written, with its traceback, to torchrun's error file
and to the run folder's ``errors/`` for LaunchError to report.

Standard library only until the script itself runs.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import runpy
import signal
import sys
import threading
import time
import traceback

from labkit import _rundir, metrics
from labkit._rank import layout, proc, sigterm

_POLL_S = 0.5


def _watch(parent_pid: int, launcher_pid: int | None, launcher_token: str | None) -> None:
    """End this rank (and its process group) when torchrun or the launcher is gone."""
    while True:
        time.sleep(_POLL_S)
        parent_gone = os.getppid() != parent_pid
        launcher_gone = launcher_pid is not None and not proc.is_same_process(
            launcher_pid, launcher_token
        )
        if parent_gone or launcher_gone:
            metrics.flush()
            if os.getpgid(0) == os.getpid():
                os.killpg(os.getpid(), signal.SIGKILL)  # takes DataLoader workers too
            os._exit(1)


def _script_traceback(exc: BaseException, script: str) -> str:
    """The traceback from the script's first frame on (runpy's frames dropped)."""
    tb = traceback.TracebackException.from_exception(exc)
    frames = list(tb.stack)
    script_abs = os.path.abspath(script)
    for i, frame in enumerate(frames):
        if os.path.abspath(frame.filename) == script_abs:
            tb.stack = traceback.StackSummary.from_list(frames[i:])
            break
    return "".join(tb.format())


def _record_failure(exc: BaseException, script: str, run_dir: str, rank: int, exit_code: int) -> None:
    if isinstance(exc, SystemExit):
        # The script chose to exit (argparse does on a bad option, after printing
        # why): its own words are in the output, a traceback would only add noise.
        text = ""
        message = f"SystemExit: the script exited with code {exc.code}"
    else:
        text = _script_traceback(exc, script)
        message = f"{type(exc).__name__}: {exc}"
        sys.stderr.write(text)
        sys.stderr.flush()
    now = time.time()
    # torchrun's own format, so its summary shows the real cause too.
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        _rundir.write_json(
            error_file,
            {"message": {"message": message,
                         "extraInfo": {"py_callstack": text, "timestamp": str(int(now))}}},
        )
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    path = _rundir.error_file(run_dir, rank, restart)
    path.parent.mkdir(parents=True, exist_ok=True)
    _rundir.write_json(
        path,
        {"rank": rank, "restart": restart, "pid": os.getpid(), "time": now,
         "exit_code": exit_code, "type": type(exc).__name__,
         "message": message.split(": ", 1)[1], "traceback": text},
    )


def _stop_loader_workers() -> int:
    """Shut down the worker processes of every DataLoader the script left running; how many.

    A loader with ``persistent_workers`` keeps its workers until its iterator is freed, and a
    script's globals are freed only in the interpreter's teardown, which ``_exit`` skips. Left
    to PyTorch's atexit handling, torch 2.11 (on our GPU machine) then waited 5 s per worker of
    a loader that pins memory (PyTorch issue 81794): lesson 08's rank with 8 workers took 57 s
    for 2.4 s of training, and 15 s with this. torch 2.14 shuts them down in an atexit handler
    of its own. Shutting them down here is what freeing the iterator would do; the search for
    them costs ~15 ms.
    """
    loaders = sys.modules.get("torch.utils.data.dataloader")
    kind = getattr(loaders, "_MultiProcessingDataLoaderIter", None)
    if kind is None:  # the script used no DataLoader workers
        return 0
    running = [obj for obj in gc.get_objects() if issubclass(type(obj), kind)]  # type(): no __class__ lookups
    for iterator in running:
        iterator._shutdown_workers()  # what its __del__ calls; a second call does nothing
    return len(running)


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m labkit._rank.entry SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    script = argv[0]
    run_dir = _rundir.from_env()
    rank = int(os.environ.get("RANK", "0"))

    if run_dir:
        os.dup2(sys.stdout.fileno(), sys.stderr.fileno())
        pid_file = _rundir.pid_file(run_dir, rank)
        pid_file.parent.mkdir(parents=True, exist_ok=True)
        _rundir.write_json(pid_file, {"pid": os.getpid(), "token": proc.process_token(os.getpid())})
        layout.record_layout(run_dir)  # several nodes: which node and local rank this rank is
    launcher_pid = os.environ.get(proc.LAUNCHER_PID_ENV)
    threading.Thread(
        target=_watch,
        args=(os.getppid(), int(launcher_pid) if launcher_pid else None,
              os.environ.get(proc.LAUNCHER_TOKEN_ENV) or None),
        name="labkit-watch",
        daemon=True,
    ).start()
    faulthandler.enable(all_threads=True)  # to stderr, which is stdout's file from here on
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    sigterm.flush_on_sigterm()

    # Look like `python SCRIPT ARGS`: argv, sys.path[0] and __main__.
    sys.argv = [script, *argv[1:]]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    try:
        try:
            runpy.run_path(script, run_name="__main__")
        finally:
            sigterm.ending.set()
        _stop_loader_workers()
    except SystemExit as exc:
        code = proc.exit_code(exc.code)  # sys.exit("message") prints it and exits 1
        if code == 0:
            _stop_loader_workers()
            return 0
        if run_dir:
            _record_failure(exc, script, run_dir, rank, code)
        return code
    except BaseException as exc:  # noqa: BLE001 - every failure is reported, then re-signalled by the exit code
        if run_dir:
            _record_failure(exc, script, run_dir, rank, 1)
        else:
            traceback.print_exc()
        return 1
    finally:
        metrics.flush()
    return 0


def _exit(code: int) -> None:
    """End the rank as Python would, then skip the interpreter's teardown (``proc.leave``).

    PyTorch's gloo backend frees each finished collective on its own worker
    thread, shortly *after* ``wait()`` has returned, and freeing a tensor that
    Python also knows about takes the GIL. If the main thread is already tearing
    the interpreter down, that thread is stopped inside a destructor and the
    process dies with "terminate called without an active exception" (SIGABRT),
    after the script has finished its work. ``destroy_process_group()`` does not
    join those threads, and a script cannot close the window itself.

    So the rank runs what Python runs at exit (the threading module's exit calls, which tell
    ``concurrent.futures`` pools to stop: ``torch.compile`` leaves one running; the script's
    non-daemon threads; the atexit handlers: DataLoader workers, logging, temporary files,
    labkit's metrics), flushes its metrics and output, and leaves with ``os._exit``, which
    stops gloo's threads where they stand.
    """
    proc.leave(code, flush=sigterm.flush_output)


if __name__ == "__main__":
    _exit(main(sys.argv[1:]))
