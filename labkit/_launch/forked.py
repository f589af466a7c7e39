"""torchrun agents started warm, from ``labkit._rank.agent_server`` (Linux; elsewhere plain ones).

``start(argv, env, log)`` gives a ``subprocess.Popen`` where the server cannot serve, and
otherwise a ``ForkedAgent``, which answers the same questions (``pid``, ``poll``, ``wait``,
``terminate``, ``kill``, ``returncode``): ``labkit._launch.agents.Agents`` treats both alike.
The server started by fork is the same agent, torchrun run in-process, that dies with its
launcher; it skips the second or two of ``import torch`` an agent pays before torchrun
starts. The agent then forks its ranks warm too (``labkit._rank.zygote``).

One server per launching thread of a process: Linux kills the server when the thread that
started it ends (the parent-death signal follows the thread), so a thread never uses
another's, nor a forked process its parent's. A server that died is replaced at the next
launch.

What Python and torch read from the environment as they load (``PYTHONPATH``,
``TORCH_CPP_LOG_LEVEL``, torchrun's ``LOGLEVEL``, ...) the server read once, when it started.
So it starts with the Python and environment of the agent it is first asked for, and an agent
whose Python or variables of that kind differ gets a server of its own (or, while the thread's server still
has agents running, a plain process). The ranks get what torchrun gives them, as ever
(``labkit._rank.zygote`` says how a forked rank is the same).

Imported by the launcher only.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

from labkit._rank import forkserver

#: What the launcher handles: a started agent answers as ``subprocess.Popen`` does.
ForkedAgent = forkserver.Child

_servers: dict[tuple[int, int], "_Server"] = {}
_lock = threading.Lock()


def _key() -> tuple[int, int]:
    """This thread's server's key: a process forked from this one (the pid tells) must not
    write to its parent's server, whose replies its parent reads."""
    return os.getpid(), threading.get_ident()


class _Server(forkserver.Server):
    """One ``python -m labkit._rank.agent_server``, on its stdin and stdout."""

    def __init__(self, python: str, env: dict):
        self.loaded_with = _loaded_with(python, env)
        self.proc = subprocess.Popen([python, "-m", "labkit._rank.agent_server"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                     start_new_session=True)
        super().__init__(self.proc.stdin.fileno(), self.proc.stdout.fileno())

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        """Kill the server, and with it (the parent-death signal) every agent it started."""
        self.proc.kill()
        self.proc.wait()


def _loaded_with(python: str, env: dict) -> tuple[str, dict]:
    """The Python an agent runs, and the variables it reads as it loads."""
    return python, forkserver.read_at_load(env, agent=True)


def start(argv: list[str], env: dict | None, log) -> "ForkedAgent | None":
    """Start the torchrun agent ``argv`` (``python -m labkit._rank.agent ARGS``) with ``env``
    (None: this process's) from this thread's server; None where there is none (not Linux, or
    it would not start) or it would not be the same agent (see above).

    Example::

        agent = forked.start([sys.executable, "-m", "labkit._rank.agent", "--standalone",
                              "--nproc-per-node=2", "train.py"], None, "agent.log")
        agent.wait()
    """
    if not sys.platform.startswith("linux") or argv[1:3] != ["-m", "labkit._rank.agent"]:
        return None
    env = dict(os.environ if env is None else env)
    key, loaded_with = _key(), _loaded_with(argv[0], env)
    with _lock:
        server = _servers.get(key)
        if server is not None and server.alive() and server.loaded_with != loaded_with:
            if server.running:
                return None
            server.close()   # idle, and loaded with another Python or other variables: replace it
        if server is None or not server.alive() or server.loaded_with != loaded_with:
            try:
                server = _servers[key] = _Server(argv[0], env)
            except OSError:
                return None
    log = os.path.abspath(log)
    return server.start({"argv": argv[3:], "env": env, "cwd": os.getcwd(), "stdout": log, "stderr": log})
