"""A torchrun agent that dies with the kernel that launched it: ``python -m labkit._rank.agent ARGS``.

On Linux it asks the kernel to send it SIGKILL when its parent (the launching kernel) dies
(``prctl(PR_SET_PDEATHSIG)``), then runs torchrun in this same process, exactly as
``python -m torch.distributed.run ARGS`` would (the command labkit echoes): ``runpy`` runs
that module as ``__main__`` with these arguments. Its ranks already end when their launcher
is gone (``labkit._rank.entry``); this covers the agent itself while it has no rank yet, e.g.
waiting in a rendezvous for a peer agent that died at start-up, which torchrun would wait for
up to 600 s.

Its ranks are forked from it. torchrun starts a command (``python -u -m labkit._rank.entry
SCRIPT ARGS``) as a fresh process per rank, and each loads torch again: about 2 s of CPU on a
laptop core, plus 1.3 s more where the script builds a DDP model (its constructor imports
``torch._dynamo``). Given a function instead (``--start-method=fork``), torchrun forks each
rank from the agent, which has loaded torch already, and ``entry.forked`` runs what the command
would. The script, its environment, logs, restarts and failures are the same. On 2 CPU cores a
2-rank launch of a DDP script took 3.6 s instead of 4.7, and 4.4 s of CPU instead of 7.1; of a
script that only joins the group, 2.1 s instead of 3.5, and 1.75 s of CPU instead of 4.5
(medians of 6 runs each way). The echoed command is torchrun's own, which a learner can run
from a terminal as it is: there each rank loads torch itself.

When torchrun is done the agent ends as a rank does (``proc.leave``): Python's exit calls,
then ``os._exit``, without the interpreter's teardown of everything torch loaded. On 2 CPU
cores a bare 2-rank launch took 3.9 s instead of 4.65, and 5.1 s of CPU instead of 5.8
(medians of 8 runs each way).
(It runs torchrun in-process rather than ``os.execv`` into it because that teardown can only
be skipped from inside, and only a process that has loaded torch can fork ranks that have.)

Standard library only until torchrun is imported.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys

from labkit._rank import proc

_ENTRY = ("-m", "labkit._rank.entry")


def command(torchrun_argv: list[str]) -> list[str]:
    """What to start for ``torchrun_argv`` (``[python, "-m", "torch.distributed.run", ...]``):
    this module in front of it on Linux, the command itself elsewhere."""
    if not sys.platform.startswith("linux") or torchrun_argv[1:3] != ["-m", "torch.distributed.run"]:
        return torchrun_argv
    return [torchrun_argv[0], "-m", "labkit._rank.agent", *torchrun_argv[3:]]


def main(argv: list[str]) -> None:
    proc.parent_death_signal(signal.SIGKILL)
    launcher = os.environ.get(proc.LAUNCHER_PID_ENV)
    if launcher and not proc.is_same_process(int(launcher), os.environ.get(proc.LAUNCHER_TOKEN_ENV) or None):
        os._exit(1)  # the launcher died before the request above was made
    proc.leave(_torchrun(argv))


def _torchrun(argv: list[str]) -> int:
    """Run ``python -m torch.distributed.run ARGV`` in this process; return its exit status as
    Python would give it (an uncaught exception, e.g. torchrun's ChildFailedError, is printed
    with its traceback and gives 1). Ranks started by ``labkit._rank.entry`` are forked
    (``_run_forking``)."""
    sys.argv = [sys.argv[0], *argv]  # run_module puts the module's path in front, as -m does
    try:
        if _ENTRY in _pairs(argv):
            _run_forking(argv)
        else:
            runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        return proc.exit_code(exc.code)
    except BaseException:  # noqa: BLE001 - what Python does with any uncaught exception
        sys.excepthook(*sys.exc_info())
        return 1
    return 0


def _pairs(argv: list[str]) -> list[tuple[str, str]]:
    return list(zip(argv, argv[1:]))


def _run_forking(argv: list[str]) -> None:
    """torchrun with ARGV, its ranks forked from this process rather than started as commands.

    torchrun starts ``python -u -m labkit._rank.entry SCRIPT ARGS`` as a fresh process per rank,
    and each loads torch again (about 2 s of CPU on a laptop core). Given a function instead of a
    command (``--start-method=fork``), it forks the ranks from this process, which has loaded
    torch already; ``entry.forked`` then runs what the command would. The environment is the
    same (torchrun sets each rank's variables, and the launcher set the rest before this process
    started, ``OMP_NUM_THREADS`` included), and so are the logs, restarts and failures.
    """
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.launcher.api import elastic_launch

    from labkit._rank import entry

    args = torchrun.parse_args(argv)
    args.start_method = "fork"
    if args.master_port is None:  # as torchrun's run() does; unused by the c10d rendezvous
        args.master_port = 29500
    config, _, _ = torchrun.config_from_args(args)
    record(elastic_launch(config=config, entrypoint=entry.forked))(*args.training_script_args)


if __name__ == "__main__":
    main(sys.argv[1:])
