"""Warm ranks: torchrun's agent starts each rank by ``fork`` from a copy of itself (Linux).

A rank is ``python -u -m labkit._rank.entry SCRIPT ARGS``, and a new Python process pays about
2 s of CPU to import torch before the script's first line; on 2 CPU cores every rank of a
launch pays it at once. The agent has imported torch already (torchrun is torch). So
``install``, called in the agent before torchrun runs, forks one more process, the zygote:
a copy of the agent as it is then (torch loaded, nothing run, no thread started), serving
``labkit._rank.forkserver``'s protocol. torchrun's ``SubprocessHandler`` then asks it for each
rank instead of starting a new process, and hears from it when the rank ends.

The rank is the same one a new process would be. The zygote's child:

- leads a session of its own, in the agent's folder, with exactly the environment torchrun
  gave it, its output in the files torchrun opened for it (stdout and stderr unbuffered, as
  ``-u`` makes them);
- takes OpenMP's thread count from ``OMP_NUM_THREADS`` (labkit sets it for every launch,
  torchrun where it is unset) with ``torch.set_num_threads``, since OpenMP read it when the
  agent (or its server) loaded;
- draws a fresh seed for torch's default generator and for numpy's global one, as a new
  process does at start (``random`` does that itself after a fork), so that ranks drawing
  before any ``manual_seed`` draw different numbers, as they would;
- runs ``labkit._rank.entry`` as ``__main__`` with sys.argv and sys.path[0] as ``python -m``
  sets them.

What differs, and why it does not matter here: the rank's parent is the zygote, not torchrun
(the zygote dies with its agent, and the rank's watcher ends the rank when its parent goes, as
before); ``/proc/PID/cmdline`` still reads as the agent's, so the process is named for what it
is, ``labkit-rank`` (``ps -e``, psutil's ``name()``; the zygote is ``labkit-zygote``, which
``labkit._launch.procs.children`` looks through); and every rank of one agent hashes strings
with the same seed (``PYTHONHASHSEED`` is drawn once per process). A rank whose command
is not that one, or whose environment differs in what Python and torch read as they load,
gets a new process from torchrun as before.

Standard library only (torch is loaded by the agent; ``install`` patches it when it is).
"""

from __future__ import annotations

import io
import os
import signal
import sys

from labkit._rank import agent, forkserver

ENTRY = "labkit._rank.entry"
#: The names in ``/proc/PID/comm`` (what ``ps -e`` and psutil's ``name()`` show) of the zygote
#: and of each rank it forks (their command lines are the agent's).
NAME, RANK_NAME = "labkit-zygote", "labkit-rank"
_PR_SET_NAME = 15


class _Zygote(forkserver.Server):
    """The agent's side of its zygote."""

    def __init__(self):
        loaded = forkserver.loaded_env or os.environ   # the agent server's, for a warm agent
        self.loaded_with = forkserver.read_at_load(loaded)
        self.threads = loaded.get("OMP_NUM_THREADS")
        to_zygote, requests = os.pipe()
        replies, from_zygote = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            try:
                os.close(requests)
                os.close(replies)
                agent.die_with_parent()
                _set_name(NAME)
                forkserver.serve(to_zygote, from_zygote, _rank)
            finally:
                os._exit(1)
        os.close(to_zygote)
        os.close(from_zygote)
        os.set_inheritable(requests, False)
        os.set_inheritable(replies, False)
        self.ended = False
        super().__init__(requests, replies)

    def alive(self) -> bool:
        if not self.ended:
            self.ended = os.waitpid(self.pid, os.WNOHANG)[0] != 0
        return not self.ended

    def close(self) -> None:
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            self.ended = True

    def rank(self, args, env: dict, stdout, stderr) -> "forkserver.Child | None":
        """Fork the rank ``args`` (``[python, "-u", "-m", ENTRY, ...]``) with ``env``; None
        when it would not be the same rank as a new process (see the module's docstring)."""
        args = [str(a) for a in args]
        if args[:4] != [sys.executable, "-u", "-m", ENTRY] or forkserver.read_at_load(env) != self.loaded_with:
            return None
        threads = env.get("OMP_NUM_THREADS")
        if threads != self.threads and not ((threads or "").isdigit() and int(threads) > 0):
            return None   # unset or not a count: a new process, so that OpenMP reads it as it would
        return self.start({"args": args[4:], "env": env, "cwd": os.getcwd(),
                           "stdout": getattr(stdout, "name", None), "stderr": getattr(stderr, "name", None),
                           "threads": int(threads) if threads != self.threads else None})


def _set_name(name: str) -> None:
    agent.prctl(_PR_SET_NAME, name.encode()[:15])


def _rank(request: dict) -> int:
    """In the zygote's child: become the rank, as ``python -u -m labkit._rank.entry ARGS``."""
    _set_name(RANK_NAME)
    for name, fd in (("stdout", 1), ("stderr", 2)):   # -u: unbuffered, on the new descriptors
        old = getattr(sys, name)
        new = io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=old.encoding,
                               errors=old.errors, write_through=True)
        setattr(sys, name, new)
        setattr(sys, f"__{name}__", new)
    import torch  # loaded already: the zygote is a copy of a torchrun agent

    if request["threads"] is not None:
        torch.set_num_threads(request["threads"])
    torch.default_generator.seed()   # a new process draws its own seed
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()
    if not sys.flags.safe_path:
        sys.path[0] = os.getcwd()
    sys.argv = [sys.argv[0], *request["args"]]
    return agent.run_as_main(ENTRY)


def install() -> None:
    """In a torchrun agent, before torchrun runs: fork the zygote, and have torchrun's
    ``SubprocessHandler`` start ranks from it (a new process where it cannot). Linux only;
    elsewhere, or where this torch's handler is not the one known here, nothing changes.

    Example (``labkit._rank.agent.main``)::

        zygote.install()
        proc.leave(_torchrun(argv))
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler
    except ImportError:
        return
    handler = subprocess_handler.SubprocessHandler
    plain = getattr(handler, "_popen", None)
    if plain is None or getattr(plain, "labkit_zygote", False):
        return
    zygote = _Zygote()

    def _popen(self, args, env):
        started = zygote.rank(args, env, getattr(self, "_stdout", None), getattr(self, "_stderr", None))
        return started if started is not None else plain(self, args, env)

    _popen.labkit_zygote = True
    handler._popen = _popen
