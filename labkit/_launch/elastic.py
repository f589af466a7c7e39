"""Elastic runs: nodes that leave and join while the job trains (lesson 10).

``launch(script, nproc=1, nnodes=2, min_nodes=1, max_restarts=3, events=[...])`` starts two
torchrun agents with ``--nnodes=1:2``: the job runs on two nodes, and carries on with one.

- ``labkit.kill_node(1, at_step=12)``: once a rank has logged step 12, SIGKILL node 1's
  torchrun agent **and** its ranks, the way a node dies (power, kernel panic, a pulled cable):
  nothing runs on it any more, nothing says goodbye.
- ``labkit.add_node(at_step=24)``: once a rank has logged step 24, start one more agent (a new
  node) with the same rendezvous: it waits for the next round, the running agents see a node
  waiting, stop their workers and meet it; the world grows back.

What torch 2.14 does (measured on one machine, two CPU ranks; lesson 10 shows each):

- The survivors' ranks fail in their next collective (the peer is gone); their agent then
  meets the rendezvous again. The dead node is dropped once its heartbeats have been missing
  ``keep_alive_interval × keep_alive_max_attempt`` seconds (5 × 3 = 15 s by default; here 1 × 3),
  and a round with fewer than the most nodes closes ``last_call_timeout`` seconds after the
  fewest have joined (30 s by default; here 2). Defaults: a node leaves, training resumes
  ~20 s later; with these settings, a few seconds.
- A joining node needs ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: with the store shared between
  the rendezvous and the workers (the default), the grown world's workers wait 60 s for keys
  that never come (``DistStoreError: wait timeout after 60000ms``) and the job fails.
- The rendezvous store lives in the agent that hosts it (node 0 here, ``is_host=1``): kill
  that node and every other agent fails within seconds (``RendezvousConnectionError``), however
  many survive. The store's host must be a node that stays: on a cluster, the rendezvous
  endpoint goes on a node that does not fail with the job (or an etcd service).
- Shorter heartbeats are not free: under load, a live node that misses 3 one-second beats is
  declared dead, and the two halves each carry on alone.

Imported by the launcher; an elastic run is read back round by round by
``labkit._results.elastic``.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
from pathlib import Path

from labkit._launch import procs
from labkit._launch.agents import Agents, gpu_slice
from labkit._launch.events import Event

#: torchrun --rdzv-conf of an elastic launch (see the module docstring for why each).
RDZV_CONF = {"last_call_timeout": 2, "keep_alive_interval": 1, "keep_alive_max_attempt": 3}


def is_elastic(plan) -> bool:
    return plan.min_nodes is not None and plan.min_nodes < plan.nnodes


def nnodes_spec(plan) -> str:
    """torchrun's ``--nnodes``: ``"2"``, or ``"1:2"`` for an elastic launch."""
    return f"{plan.min_nodes}:{plan.nnodes}" if is_elastic(plan) else str(plan.nnodes)


def rdzv_conf(plan, node: int) -> str:
    """torchrun's ``--rdzv-conf`` for agent ``node``: node 0 hosts the store."""
    conf = {"is_host": int(node == 0)}
    if is_elastic(plan):
        conf.update(RDZV_CONF)
    return ",".join(f"{k}={v}" for k, v in conf.items())


# -- the agents of an elastic run --------------------------------------------------------
class ElasticAgents(Agents):
    """The agents of an elastic launch: nodes may be killed on purpose and added later.

    A node killed on purpose does not count as a failure (``Agents.killed``); the run goes on
    while any agent that was not killed runs. ``procs[k]`` is node k's agent, including nodes
    added later.
    """

    END_WHEN_RANKLESS = False   # between rounds an agent has no ranks, and is not done

    def __init__(self, argvs, envs, logs):
        super().__init__(argvs, envs, logs)
        self.replaced: dict[int, int] = {}   # joining node -> the killed node whose place it takes

    def free_place(self) -> int | None:
        """The first killed node that no joiner has replaced yet (its GPUs are free)."""
        free = sorted(self.killed - set(self.replaced.values()))
        return free[0] if free else None

    def add(self, argv: list[str], env: dict, log: Path) -> int:
        """Start one more agent (a node that joins); returns its node number."""
        self.argvs.append(argv)
        self.envs.append(env)
        self.logs.append(log)
        self.procs.append(self._spawn(argv, env, log))
        return len(self.procs) - 1

    def kill(self, node: int) -> dict:
        """SIGKILL node ``node`` whole: its agent and every rank it started, at once."""
        proc = self.procs[node]
        ranks = procs.children(proc.pid)
        self.killed.add(node)
        for pid in [proc.pid, *ranks]:
            procs.kill_tree(pid, signal.SIGKILL)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:  # pragma: no cover - a process in D state
            pass
        return {"agent_pid": proc.pid, "rank_pids": ranks}


def joiner_env(env: dict, plan, agents: ElasticAgents) -> dict:
    """A joining node's environment: on GPUs, the devices of the node whose place it takes."""
    place = agents.free_place()
    if place is not None:
        agents.replaced[len(agents.procs)] = place
        if plan.device == "cuda":
            env = dict(env, CUDA_VISIBLE_DEVICES=gpu_slice(
                place, plan.nproc, os.environ.get("CUDA_VISIBLE_DEVICES")))
    return env


# -- events ------------------------------------------------------------------------------------
#: ``world_size=W`` in an event means: rank 0 has logged this many steps in a world of W.
STEADY_STEPS = 5


class _WhenReached(Event):
    """Due once the run has reached ``at_step`` and/or has trained STEADY_STEPS steps at
    ``world_size`` (both, when both are given)."""

    def __init__(self, at_step, world_size):
        super().__init__()
        if at_step is None and world_size is None:
            raise TypeError("say when: at_step=N (a step a rank has logged), world_size=W (once "
                            f"the world has had W ranks for {STEADY_STEPS} steps), or both")
        for name, value, least in (("at_step", at_step, 0), ("world_size", world_size, 1)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < least):
                raise ValueError(f"{name} must be an int >= {least} or None, got {value!r}")
        self.at_step, self.world_size = at_step, world_size

    def _when(self) -> str:
        parts = [f"at step {self.at_step}"] if self.at_step is not None else []
        if self.world_size is not None:
            parts.append(f"after {STEADY_STEPS} steps on {self.world_size} rank(s)")
        return " and ".join(parts)

    def due(self, progress) -> bool:
        if self.at_step is not None and (progress.step is None or progress.step < self.at_step):
            return False
        if self.world_size is not None and not (progress.world_size == self.world_size
                                                and progress.world_steps >= STEADY_STEPS):
            return False
        return True


class KillNode(_WhenReached):
    """Kill node ``node`` (its agent and its ranks, SIGKILL) when the run gets there."""

    def __init__(self, node: int, at_step=None, world_size=None):
        super().__init__(at_step, world_size)
        if isinstance(node, bool) or not isinstance(node, int) or node < 0:
            raise ValueError(f"node must be an int >= 0, got {node!r}")
        self.node = node
        self.what = f"kill node {node} {self._when()}"

    def check(self, plan) -> None:
        if self.node >= plan.nnodes:
            raise ValueError(f"kill_node({self.node}) but the launch has nodes 0 to "
                             f"{plan.nnodes - 1}. HINT: nnodes=2 has nodes 0 and 1.")

    def fire(self, ctx, progress) -> dict:
        found = ctx.agents.kill(self.node)
        store = " (it hosts the rendezvous store)" if self.node == 0 else ""
        ctx.emit(f"── step {progress.step}: node {self.node} killed{store}: SIGKILL to its torchrun "
                 f"agent (pid {found['agent_pid']}) and its ranks (pids "
                 f"{', '.join(map(str, found['rank_pids'])) or 'none left'}) ──")
        return {"node": self.node, **found}


class AddNode(_WhenReached):
    """Start one more agent (a new node) when the run gets there."""

    def __init__(self, at_step=None, world_size=None):
        super().__init__(at_step, world_size)
        self.what = f"a node joins {self._when()}"

    def check(self, plan) -> None:
        if not is_elastic(plan):
            raise ValueError(
                "add_node needs an elastic launch: a node can join only while the job has fewer "
                "than its most nodes. HINT: launch(..., nnodes=2, min_nodes=1, max_restarts=3).")

    def check_order(self, earlier) -> None:
        kills = sum(isinstance(e, KillNode) for e in earlier)
        joins = sum(isinstance(e, AddNode) for e in earlier)
        if joins >= kills:
            raise ValueError(
                "add_node comes before any node has left: the job already has its most nodes, so "
                "the new one would only wait. HINT: list labkit.kill_node(...) before it.")

    def fire(self, ctx, progress) -> dict:
        node = ctx.start_agent()
        ctx.emit(f"── step {progress.step}: node {node} starts and joins the rendezvous ──")
        ctx.emit(f"$ [node{node}] {shlex.join(ctx.agents.argvs[node])}")
        return {"node": node, "agent_pid": ctx.agents.procs[node].pid}


def kill_node(node: int, *, at_step: int | None = None, world_size: int | None = None) -> KillNode:
    """An event for ``launch(events=[...])``: a whole node dies when the run gets there.

    SIGKILL to the node's torchrun agent and to every rank it started, at once: nothing on
    the node gets to say goodbye, as when a machine loses power.

    Args:
        node: which node (0 hosts the rendezvous store: killing it ends the job).
        at_step: once a rank has logged this step.
        world_size: once rank 0 has logged 5 steps in a world of this many ranks.
            With both, both must hold. Events fire in the order listed, each once.

    Example (lesson 10)::

        labkit.launch(script, nproc=1, nnodes=2, min_nodes=1, max_restarts=3,
                      events=[labkit.kill_node(1, at_step=12), labkit.add_node(world_size=1)])
    """
    return KillNode(node, at_step, world_size)


def add_node(*, at_step: int | None = None, world_size: int | None = None) -> AddNode:
    """An event for ``launch(events=[...])``: a new node joins when the run gets there.

    One more torchrun agent starts with the same rendezvous; the running agents see a node
    waiting, stop their workers and meet it, so the world grows (an elastic launch only, after
    a node has left).

    Args:
        at_step: once a rank has logged this step.
        world_size: once rank 0 has logged 5 steps in a world of this many ranks (e.g. 1: the
            survivor has resumed and trained alone for a while).

    Example (lesson 10)::

        labkit.launch(script, nproc=1, nnodes=2, min_nodes=1, max_restarts=3,
                      events=[labkit.kill_node(1, at_step=12), labkit.add_node(world_size=1)])
    """
    return AddNode(at_step, world_size)
