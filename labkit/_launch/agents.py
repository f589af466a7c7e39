"""Several torchrun agents on this machine, one per "node" (lesson 09's two nodes on one laptop).

A multi-node job is one torchrun agent per node, all meeting at one rendezvous. Here every
agent runs on this machine and they meet on loopback, so a learner sees exactly what a
cluster does: ``RANK``, ``LOCAL_RANK``, ``GROUP_RANK``, one store, one rendezvous.

What torch 2.14 does, measured on one machine (the lesson shows it):
- c10d: the agent that binds the ``--rdzv-endpoint`` port hosts the rendezvous store
  (``--rdzv-conf=is_host=1`` makes it this one); group ranks go to the agents in the order of
  their node descriptors (local address, then pid), never by ``--node-rank``, which torchrun
  ignores with a warning. Killing the store's host ends every other agent within seconds
  (``RendezvousConnectionError``).
- A SIGKILLed agent leaves its workers running (labkit's entry point ends them when their
  agent goes), and an agent whose peer failed waits 300 s in torchrun's exit barrier:
  the launcher stops the survivors once one agent has failed.

Imported by the launcher (``launch``) only; the ranks learn their node from ``LABKIT_NODE``
(``labkit._rank.layout``).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

from labkit._launch import forked, procs
from labkit._rank import agent
#: Seconds the other agents get, after one failed, to stop on their own (an agent whose ranks
#: have all ended gets none: it can only wait, see ``Agents.running``).
FAILURE_GRACE_S = 5.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now.

    Several agents must be told the same rendezvous port before any of them starts, so
    the port cannot be 0 as for one agent. Another program could take it meanwhile: the
    launcher retries with a new port when the store's host says EADDRINUSE.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpu_slice(node: int, nproc: int, visible: str | None = None) -> str:
    """CUDA_VISIBLE_DEVICES of node ``node``: its own ``nproc`` of the visible GPUs (all of
    them, or those ``visible`` lists), as each node of a cluster has its own."""
    ids = [x.strip() for x in visible.split(",")] if visible else None
    chosen = range(node * nproc, (node + 1) * nproc)
    return ",".join(ids[i] if ids else str(i) for i in chosen)


class Agents:
    """The torchrun agents of one launch: started together, watched together, stopped together.

    ``argvs[k]``/``envs[k]`` start agent k; its output goes to ``logs[k]``. Agent 0 hosts the
    rendezvous store, so it starts first.
    """

    #: After a failure, stop waiting for agents that have no rank left (their job is over). An
    #: elastic run's agents without ranks may be meeting for the next round: they keep the grace.
    END_WHEN_RANKLESS = True

    def __init__(self, argvs: list[list[str]], envs: list[dict], logs: list[Path]):
        self.argvs, self.envs, self.logs = argvs, envs, logs
        self.procs: list[subprocess.Popen | forked.ForkedAgent] = []
        self.failed_at: float | None = None
        self.killed: set[int] = set()  # nodes killed on purpose (lesson 10's drill): no failure

    def _kept(self) -> list[subprocess.Popen]:
        return [p for node, p in enumerate(self.procs) if node not in self.killed]

    def start(self) -> None:
        for argv, env, log_path in zip(self.argvs, self.envs, self.logs):
            self.procs.append(self._spawn(argv, env, log_path))

    @staticmethod
    def _spawn(argv: list[str], env: dict, log_path: Path) -> subprocess.Popen | forked.ForkedAgent:
        """One agent, in a session of its own, its output appended to ``log_path``: forked warm
        (``labkit._launch.forked``) where it can be, else a new process."""
        command = agent.command(argv)  # each agent dies with the kernel (labkit._rank.agent)
        warm = forked.start(command, env, log_path)
        if warm is not None:
            return warm
        with open(log_path, "ab") as log:
            return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def running(self) -> bool:
        """False once every agent has exited, or one failed and the others had their grace (none
        for an agent whose ranks have all ended)."""
        codes = [p.poll() for p in self._kept()]
        if all(code is not None for code in codes):
            return False
        if any(code not in (None, 0) for code in codes):
            # torchrun's exit barrier waits 300 s for an agent that failed: do not wait for it.
            self.failed_at = self.failed_at or time.monotonic()
            if self.END_WHEN_RANKLESS and self._rankless():
                return False
            return time.monotonic() - self.failed_at < FAILURE_GRACE_S
        return True

    def _rankless(self) -> bool:
        """Every agent still running has no process of its own left (its ranks ended): it can
        only wait, in torchrun's exit barrier or for a node that failed, so nothing is gained
        by giving it the grace."""
        return all(not procs.children(p.pid) for p in self._kept() if p.poll() is None)

    @property
    def returncode(self) -> int | None:
        """The first non-zero exit code in node order, 0 if every agent succeeded, None while
        some agent still runs and none failed. An agent stopped by the launcher counts; one killed
        on purpose does not."""
        codes = [p.poll() for p in self._kept()]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            return failed[0]
        return None if None in codes else 0

    def stop(self, grace_s: float = 3.0) -> None:
        """SIGTERM every agent still running, wait ``grace_s``, then SIGKILL the rest."""
        live = [p for p in self.procs if p.poll() is None]
        for proc in live:
            try:
                proc.terminate()
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        for proc in live:
            try:
                proc.wait(max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                procs.kill_tree(proc.pid)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:  # pragma: no cover - a process in D state
                    print(f"labkit: could not stop torchrun agent {proc.pid}", file=sys.stderr)

    def addr_in_use(self) -> bool:
        """True if agent 0 (the store's host) failed because its port was taken meanwhile."""
        if not self.procs or self.procs[0].poll() in (None, 0):
            return False
        try:
            text = self.logs[0].read_text(errors="replace")
        except OSError:
            return False
        return "EADDRINUSE" in text or "address already in use" in text.lower()
