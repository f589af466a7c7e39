"""torchrun agents started warm, from ``labkit._rank.agent_server`` (Linux; elsewhere plain ones).

``start(argv, env, log)`` gives a ``subprocess.Popen`` where the server cannot serve, and
otherwise a ``ForkedAgent``, which answers the same questions (``pid``, ``poll``, ``wait``,
``terminate``, ``kill``, ``returncode``): ``labkit._launch.agents.Agents`` treats both alike.
The server started by fork is the same agent, torchrun run in-process, that dies with its
launcher; it skips the second or two of ``import torch`` an agent pays before torchrun
starts. The ranks are started by torchrun as ever, each a new ``python`` process.

One server per launching thread of a process: Linux kills the server when the thread that
started it ends (the parent-death signal follows the thread), so a thread never uses
another's, nor a forked process its parent's. A server that died is replaced at the next
launch.

What Python and torch read from the environment as they load (``PYTHONPATH``,
``TORCH_CPP_LOG_LEVEL``, torchrun's ``LOGLEVEL``, ...) the server read once, when it started.
So it starts with the Python and environment of the agent it is first asked for, and an agent
whose Python or variables of that kind differ gets a server of its own (or, while the thread's server still
has agents running, a plain process). The ranks read everything afresh, as ever.

Imported by the launcher only.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time

from labkit._rank import proc

#: The variables that may be read as Python and torch load (by prefix), less those known to be
#: read only later, by the ranks or by torchrun as it runs (labkit sets some for every launch).
_READ_AT_LOAD = ("PYTHON", "TORCH", "LOGLEVEL", "LD_", "GLIBC_", "MALLOC_")
_READ_LATER = ("TORCH_FR_", "TORCH_NCCL_", "TORCHELASTIC_", "TORCH_DISTRIBUTED_DEBUG",
               "TORCH_DIST_INIT_BARRIER", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")

#: Seconds to wait for the server to say it started an agent: it forks at once, once it has
#: imported torch (seconds; on a cold disk, the first time, tens of seconds).
_ANSWER_S = 300.0

_servers: dict[tuple[int, int], "_Server"] = {}
_lock = threading.Lock()


def _key() -> tuple[int, int]:
    """This thread's server's key: a process forked from this one (the pid tells) must not
    write to its parent's server, whose replies its parent reads."""
    return os.getpid(), threading.get_ident()


class _Server:
    """One ``python -m labkit._rank.agent_server`` and what it has said."""

    def __init__(self, python: str, env: dict):
        self.loaded_with = _loaded_with(python, env)
        self.proc = subprocess.Popen([python, "-m", "labkit._rank.agent_server"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                     start_new_session=True)
        self.running: set[int] = set()   # agents it started that have not been seen to end
        self.exits: dict[int, int] = {}
        self._started: list[int] = []
        self._buffer = b""
        self._reading = threading.Lock()   # the live view's thread may poll as the launch does

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        """Kill the server, and with it (the parent-death signal) every agent it started."""
        self.proc.kill()
        self.proc.wait()

    def read(self, timeout_s: float = 0.0) -> None:
        """Take in what the server has said, waiting up to ``timeout_s`` for its first word."""
        with self._reading:
            self._read(timeout_s)

    def _read(self, timeout_s: float) -> None:
        fd = self.proc.stdout.fileno()
        while select.select([fd], [], [], timeout_s)[0]:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return
            self._buffer += chunk
            timeout_s = 0.0
            while b"\n" in self._buffer:
                line, self._buffer = self._buffer.split(b"\n", 1)
                word, *numbers = line.decode().split()
                if word == "started":
                    self._started.append(int(numbers[0]))
                elif word == "exited":
                    self.exits[int(numbers[0])] = int(numbers[1])

    def start(self, argv: list[str], env: dict, log) -> int | None:
        """Ask for one agent; its pid, or None if the server did not answer."""
        request = {"argv": argv, "env": env, "cwd": os.getcwd(), "log": os.path.abspath(log)}
        try:
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return None
        deadline = time.monotonic() + _ANSWER_S
        try:
            while not self._started and self.alive() and time.monotonic() < deadline:
                self.read(timeout_s=0.1)
        except BaseException:  # interrupted: an agent forked later would run unwatched
            self.close()
            raise
        if not self._started:  # never to fork it later: a second agent beside the plain one
            self.close()
            return None
        pid = self._started.pop(0)
        self.running.add(pid)
        return pid


class ForkedAgent:
    """An agent the server started: what ``subprocess.Popen`` says of a child, for one that is
    the server's child (so only the server can collect its exit status)."""

    def __init__(self, server: _Server, pid: int):
        self.server, self.pid = server, pid
        self.token = proc.process_token(pid)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.server.read()
            if self.pid in self.server.exits:
                self.returncode = self.server.exits.pop(self.pid)
            elif not self.server.alive() and not proc.is_same_process(self.pid, self.token):
                self.returncode = -signal.SIGKILL  # died with its server, by the parent-death signal
            if self.returncode is not None:
                self.server.running.discard(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"agent {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None and proc.is_same_process(self.pid, self.token):
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _loaded_with(python: str, env: dict) -> tuple[str, dict]:
    """The Python an agent runs, and the variables it reads as it loads."""
    return python, {k: v for k, v in env.items() if k.startswith(_READ_AT_LOAD) and not k.startswith(_READ_LATER)}


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
    pid = server.start(argv[3:], env, log)
    return ForkedAgent(server, pid) if pid is not None else None
