"""A torchrun agent that dies with the kernel that launched it: ``python -m labkit._rank.agent ARGS``.

On Linux it asks the kernel to send it SIGKILL when its parent (the launching kernel) dies
(``prctl(PR_SET_PDEATHSIG)``), then runs torchrun in this same process, exactly as
``python -m torch.distributed.run ARGS`` would (the command labkit echoes): ``runpy`` runs
that module as ``__main__`` with these arguments. Its ranks already end when their launcher
is gone (``labkit._rank.entry``); this covers the agent itself while it has no rank yet, e.g.
waiting in a rendezvous for a peer agent that died at start-up, which torchrun would wait for
up to 600 s.

When torchrun is done the agent ends as a rank does (``proc.leave``): Python's exit calls,
then ``os._exit``, without the interpreter's teardown of everything torch loaded. On 2 CPU
cores a bare 2-rank launch took 3.9 s instead of 4.65, and 5.1 s of CPU instead of 5.8
(medians of 8 runs each way). On Linux the launcher forks each agent warm, torch already
loaded, from ``labkit._rank.agent_server``, which calls ``main`` here: 2.05 s instead of
3.97 (medians of 5 launches each way). Before torchrun runs, ``main`` forks the agent's
zygote (``labkit._rank.zygote``), from which torchrun's ranks are then forked warm as well.
(It runs torchrun in-process rather than ``os.execv`` into it because that teardown can only
be skipped from inside.)

Standard library only.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys

from labkit._rank import proc

_PR_SET_PDEATHSIG = 1


def command(torchrun_argv: list[str]) -> list[str]:
    """What to start for ``torchrun_argv`` (``[python, "-m", "torch.distributed.run", ...]``):
    this module in front of it on Linux, the command itself elsewhere."""
    if not sys.platform.startswith("linux") or torchrun_argv[1:3] != ["-m", "torch.distributed.run"]:
        return torchrun_argv
    return [torchrun_argv[0], "-m", "labkit._rank.agent", *torchrun_argv[3:]]


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (nothing elsewhere)."""
    prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))


def prctl(option: int, value) -> None:
    """Linux's ``prctl(option, value)`` for this process; nothing where there is none."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def main(argv: list[str]) -> None:
    """Run torchrun with ``argv``, dying with the launcher; never returns."""
    die_with_parent()
    launcher = os.environ.get(proc.LAUNCHER_PID_ENV)
    if launcher and not proc.is_same_process(int(launcher), os.environ.get(proc.LAUNCHER_TOKEN_ENV) or None):
        os._exit(1)  # the launcher died before the request above was made
    from labkit._rank import zygote

    zygote.install()
    proc.leave(_torchrun(argv))


def _torchrun(argv: list[str]) -> int:
    """Run ``python -m torch.distributed.run ARGV`` in this process (see ``run_as_main``)."""
    sys.argv = [sys.argv[0], *argv]  # run_module puts the module's path in front, as -m does
    return run_as_main("torch.distributed.run")


def run_as_main(module: str) -> int:
    """Run ``module`` as ``python -m MODULE`` would, with ``sys.argv[1:]``, in this process;
    return its exit status as Python would give it (an uncaught exception, e.g. torchrun's
    ChildFailedError, is printed with its traceback and gives 1)."""
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        return proc.exit_code(exc.code)
    except BaseException:  # noqa: BLE001 - what Python does with any uncaught exception
        sys.excepthook(*sys.exc_info())
        return 1
    return 0


if __name__ == "__main__":
    main(sys.argv[1:])
