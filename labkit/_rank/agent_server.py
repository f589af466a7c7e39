"""Warm torchrun agents: ``python -m labkit._rank.agent_server``, one per launching kernel.

Every torchrun agent imports torch before it does anything, and on 2 CPU cores that is about
2 s and 2 s of CPU per launch, in series before any rank starts (the ranks then import it
again, each in its own fresh process). This server imports torchrun's modules once and
starts each agent the launcher asks for by ``fork``: the agent is the same
``python -m labkit._rank.agent ARGS`` (torchrun run in-process, dying with its launcher), it
just starts with torch already loaded. Forking a process that has imported torch is what
every DataLoader worker does on Linux. Each agent, in turn, forks its ranks warm
(``labkit._rank.zygote``).

The protocol is ``labkit._rank.forkserver``'s (the launcher's side is ``labkit._launch.forked``):
a request holds the agent's torchrun arguments (``argv``) beside its ``env``, ``cwd`` and the
log its output goes to (``stdout``, ``stderr``). Each agent asks Linux to kill it when this
server dies; this server asks the same of its launcher. Linux only.

Standard library only until ``serve`` imports torchrun.
"""

from __future__ import annotations

import os
import sys

from labkit._rank import agent, forkserver


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
    forkserver.serve(requests, replies, lambda request: agent.main(request["argv"]))


if __name__ == "__main__":
    serve()
