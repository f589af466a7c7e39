"""Processes started warm: forked from a server that has imported torch already (Linux).

A new Python process pays about 2 s of CPU to import torch before it does anything. Two
servers skip that by ``fork``, each holding torch loaded and nothing else running:

- ``labkit._rank.agent_server``, one per launching kernel, forks each torchrun agent;
- ``labkit._rank.zygote``, one per agent, forks each rank that torchrun starts.

Forking a process that has imported torch (and not yet used it) is what every DataLoader
worker does on Linux. This module is both sides of their one protocol:

- the server's side, ``serve``: on its request pipe, one JSON object per child
  (``{"env": {...}, "cwd": ..., "stdout": path, "stderr": path, ...}``); on its reply pipe,
  ``started PID`` for each, in order, and ``exited PID CODE`` when one ends (CODE as
  ``subprocess.Popen.returncode`` gives it: negative for a signal). Each child leads a
  session of its own (as ``start_new_session`` makes it), reads nothing on stdin, appends its
  output to the files named (or keeps the server's), and runs in ``cwd`` with exactly ``env``;
- the asking side, ``Server`` and ``Child``: a child answers what ``subprocess.Popen`` does
  (``pid``, ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``, ``returncode``),
  for a process that is the server's child, so that only the server can collect its status.

What Python and torch read from the environment as they load, the server read once: a child
whose variables of that kind differ (``read_at_load``) must get a plain process instead.

Standard library only.
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
from typing import Callable

from labkit._rank import proc

#: The variables that may be read as Python, torch and its OpenMP load (by prefix), less those
#: known to be read only later, by the ranks or by torchrun as it runs (labkit sets some), and
#: OMP_NUM_THREADS, which labkit sets per launch and a forked rank applies itself
#: (``labkit._rank.zygote``). An agent reads TORCH_DISTRIBUTED_DEBUG later too; a rank's
#: torch.distributed reads it as it loads.
_READ_AT_LOAD = ("PYTHON", "TORCH", "LOGLEVEL", "LD_", "GLIBC_", "MALLOC_", "LANG", "LC_",
                 "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_")
_READ_LATER = ("TORCH_FR_", "TORCH_NCCL_", "TORCHELASTIC_", "TORCH_DIST_INIT_BARRIER",
               "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "OMP_NUM_THREADS")
_READ_LATER_BY_AGENTS = _READ_LATER + ("TORCH_DISTRIBUTED_DEBUG",)

#: How often a server looks for children that have ended, while no request comes.
_REAP_S = 0.02


def read_at_load(env: dict, agent: bool = False) -> dict:
    """The variables of ``env`` that Python or torch may have read as they loaded, in a rank
    (in an agent, with ``agent=True``).

    Example::

        if read_at_load(rank_env) != read_at_load(loaded_env):
            ...  # a plain process: this server loaded with other values
    """
    later = _READ_LATER_BY_AGENTS if agent else _READ_LATER
    return {k: v for k, v in env.items() if k.startswith(_READ_AT_LOAD) and not k.startswith(later)}


#: The environment this process's server started with (what torch loaded with, since a child
#: starts with exactly its request's): None where this process is no server's child.
loaded_env: dict | None = None


def serve(requests: int, replies: int, run: Callable[[dict], int]) -> None:
    """Fork a child for each request on ``requests`` until it closes, then exit; the child
    runs ``run(request)`` and exits with what it returns (it may end the process itself)."""
    global loaded_env
    loaded_env = loaded_env or dict(os.environ)
    running: set[int] = set()
    buffered = b""
    while True:
        # Looks for ended children while some run; idle, it sleeps until a request comes.
        ready, _, _ = select.select([requests], [], [], _REAP_S if running else None)
        _reap(running, replies)
        if not ready:
            continue
        chunk = os.read(requests, 1 << 16)
        if not chunk:  # the asker is done (or gone: then we die by its signal)
            os._exit(0)
        buffered += chunk
        while b"\n" in buffered:
            line, buffered = buffered.split(b"\n", 1)
            pid = _fork(json.loads(line), (requests, replies), run)
            running.add(pid)
            os.write(replies, f"started {pid}\n".encode())


def _reap(running: set[int], replies: int) -> None:
    """Report each child that has ended, and let the kernel forget it."""
    for pid in list(running):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            running.discard(pid)
            os.write(replies, f"exited {pid} {os.waitstatus_to_exitcode(status)}\n".encode())


def _fork(request: dict, private: tuple[int, ...], run: Callable[[dict], int]) -> int:
    """Start one child; return its pid. The child never returns here."""
    sys.stdout.flush()
    sys.stderr.flush()
    led, leads = os.pipe()
    pid = os.fork()
    if pid:  # answer once the child leads its session, as Popen(start_new_session=True) returns:
        os.close(leads)  # a killpg(pid) from the asker at once must find the group
        os.read(led, 1)
        os.close(led)
        return pid
    code = 1
    try:
        os.setsid()
        os.close(leads)
        os.close(led)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, request.get("stdout")), (2, request.get("stderr"))):
            if path:
                out = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                os.dup2(out, fd)
                os.close(out)
        for fd in (null, *private):
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        code = run(request)
    except BaseException:  # noqa: BLE001 - whatever happened, never back into the server's loop
        sys.excepthook(*sys.exc_info())
    finally:
        proc.flush_streams()
        os._exit(code)


class Server:
    """The asking side of one server: write requests to ``requests``, read its replies from
    ``replies``. A subclass says whether the server is ``alive`` and how to ``close`` it (kill
    it, and with it, by the parent-death signal, every child it started)."""

    #: Seconds to wait for the server to say it started a child: it forks at once, once it
    #: has imported torch (seconds; on a cold disk, the first time, tens of seconds).
    ANSWER_S = 300.0

    def __init__(self, requests: int, replies: int):
        self.requests, self.replies = requests, replies
        self.running: set[int] = set()   # children it started that have not been seen to end
        self.exits: dict[int, int] = {}
        self._started: list[int] = []
        self._buffer = b""
        self._reading = threading.Lock()   # the live view's thread may poll as the launch does

    def alive(self) -> bool:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def read(self, timeout_s: float = 0.0) -> None:
        """Take in what the server has said, waiting up to ``timeout_s`` for its first word."""
        with self._reading:
            while select.select([self.replies], [], [], timeout_s)[0]:
                chunk = os.read(self.replies, 1 << 16)
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

    def start(self, request: dict) -> "Child | None":
        """Ask for one child; None if the server did not answer (it is then closed)."""
        try:
            data = json.dumps(request).encode() + b"\n"
            while data:
                data = data[os.write(self.requests, data):]
        except OSError:
            return None
        deadline = time.monotonic() + self.ANSWER_S
        try:
            while not self._started and self.alive() and time.monotonic() < deadline:
                self.read(timeout_s=0.1)
        except BaseException:  # interrupted: a child forked later would run unwatched
            self.close()
            raise
        if not self._started:  # never to fork it later: a second child beside the plain one
            self.close()
            return None
        pid = self._started.pop(0)
        self.running.add(pid)
        return Child(self, pid)


class Child:
    """A process a server started: what ``subprocess.Popen`` says of a child, for one that is
    the server's child (so only the server can collect its exit status)."""

    def __init__(self, server: Server, pid: int):
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
                raise subprocess.TimeoutExpired(f"process {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None and proc.is_same_process(self.pid, self.token):
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
