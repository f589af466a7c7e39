"""A torchrun agent that dies with the kernel that launched it: ``python -m labkit._rank.agent ARGS``.

On Linux it asks the kernel to send it SIGKILL when its parent (the launching kernel) dies
(``prctl(PR_SET_PDEATHSIG)``), then *becomes* ``python -m torch.distributed.run ARGS``
(``os.execv`` keeps that request): the process that runs is exactly the torchrun command
labkit echoes. Its ranks already end when their launcher is gone (``labkit._rank.entry``); this
covers the agent itself while it has no rank yet, e.g. waiting in a rendezvous for a peer
agent that died at start-up, which torchrun would wait for up to 600 s.

Standard library only.
"""

from __future__ import annotations

import os
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


def main(argv: list[str]) -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        pass
    launcher = os.environ.get(proc.LAUNCHER_PID_ENV)
    if launcher and not proc.is_same_process(int(launcher), os.environ.get(proc.LAUNCHER_TOKEN_ENV) or None):
        os._exit(1)  # the launcher died before the request above was made
    os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", *argv])


if __name__ == "__main__":
    main(sys.argv[1:])
