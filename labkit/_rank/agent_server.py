"""Warm torchrun agents: ``python -m labkit._rank.agent_server``, one per launching kernel.

Every torchrun agent imports torch before it does anything, and on 2 CPU cores that is about
2 s and 2 s of CPU per launch, in series before any rank starts (the ranks then import it
again, each in its own fresh process). This server imports torchrun's modules once and
starts each agent the launcher asks for by ``fork``: the agent is the same
``python -m labkit._rank.agent ARGS`` (torchrun run in-process, dying with its launcher), it
just starts with torch already loaded. Forking a process that has imported torch is what
every DataLoader worker does on Linux. The ranks are unchanged: torchrun starts each one as a
new ``python`` process, as it always does.

The protocol, one line each way (the launcher's side is ``labkit._launch.forked``):

- on stdin, one JSON object per agent: ``{"argv": [torchrun args], "env": {...}, "cwd": ...,
  "log": path}``;
- on stdout, ``started PID`` for each request, in order, and ``exited PID CODE`` when an
  agent ends (CODE as ``subprocess.Popen.returncode`` gives it: negative for a signal).

The child of each fork leads a session of its own (as ``start_new_session`` would make it),
appends its output to ``log``, runs in ``cwd`` with exactly ``env``, and asks Linux to kill it
when this server dies; this server asks the same of its launcher. Linux only.

Standard library only until ``serve`` imports torchrun.
"""

from __future__ import annotations

import json
import os
import select
import sys

from labkit._rank import agent

#: How often the server looks for agents that have ended, while no request comes.
_REAP_S = 0.02


def serve() -> None:
    """Answer the requests on stdin until it closes."""
    agent.die_with_parent()
    requests, replies = os.dup(0), os.dup(1)  # the protocol's own descriptors: a stray print
    null = os.open(os.devnull, os.O_RDONLY)   # (a warning at import) goes to stderr instead
    os.dup2(null, 0)
    os.dup2(2, 1)
    os.close(null)
    import torch.distributed.run  # noqa: F401 - the import every agent would pay again

    del sys.modules["torch.distributed.run"]  # each agent runs it afresh as __main__ (runpy)

    running: set[int] = set()
    buffered = b""
    while True:
        # Looks for ended agents while some run; idle, it sleeps until a request comes.
        ready, _, _ = select.select([requests], [], [], _REAP_S if running else None)
        _reap(running, replies)
        if not ready:
            continue
        chunk = os.read(requests, 1 << 16)
        if not chunk:  # the launcher is done (or gone: then we die by its signal)
            os._exit(0)
        buffered += chunk
        while b"\n" in buffered:
            line, buffered = buffered.split(b"\n", 1)
            pid = _fork(json.loads(line), (requests, replies))
            running.add(pid)
            os.write(replies, f"started {pid}\n".encode())


def _reap(running: set[int], replies: int) -> None:
    """Report each agent that has ended, and let the kernel forget it."""
    for pid in list(running):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            running.discard(pid)
            os.write(replies, f"exited {pid} {os.waitstatus_to_exitcode(status)}\n".encode())


def _fork(request: dict, private: tuple[int, ...]) -> int:
    """Start one agent; return its pid. The child never returns here."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.setsid()
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        for fd in (log, null, *private):
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        agent.main(request["argv"])  # ends the process itself, as an agent does
    except BaseException:  # noqa: BLE001 - whatever happened, never back into the server's loop
        sys.excepthook(*sys.exc_info())
    finally:
        os._exit(code)


if __name__ == "__main__":
    serve()
