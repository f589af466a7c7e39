"""labkit.launch: run a script on N ranks with torchrun, watch it, clean up after it.

``launch`` reads as its steps: check everything at the door (``plan``), make the run folder
and say the command (``_Launch``), start the agents, watch them in the poll loop
(``_Launch.watch``), stop whatever still runs, and report (``_conclude``). The pieces live
next door: the command (``command``), the agents (``agents``, ``elastic``), rank output
(``streams``), stopping (``supervise``), what failed (``failures``), events (``events``).
"""

from __future__ import annotations

import shlex
import sys
import time
import uuid

from labkit import _hardware, _rundir
from labkit._errors import LaunchError, LaunchTimeout
from labkit._launch import agents, elastic, procs, supervise
from labkit._launch.command import (node_env, rank_env, run_info, safe_name, terminal_command,
                                    torchrun_argv)
from labkit._launch.events import Context, Driver, Progress, check_events
from labkit._launch.failures import collect_failures, failure_hint, timeout_hint
from labkit._launch.live import LiveView
from labkit._launch.keywords import refuse_keywords, renamed
from labkit._launch.plan import Plan, check_env, plan
from labkit._launch.streams import Streams
from labkit._launch.tracebacks import hide_labkit_frames
from labkit._results.run import Run

_POLL_S = 0.05
#: How often the launcher starts again when another program took the rendezvous port.
_PORT_RETRIES = 3


@refuse_keywords(nprocs="launch() takes nproc=<int> (one launch); for several world sizes use "
                        "labkit.sweep(script, nproc=[1, 2, ...]).",
                 **renamed("launch", timeout="timeout_s", hang_timeout="hang_timeout_s"))
def launch(script, *, nproc=None, nnodes=1, args=(), timeout_s=600, max_restarts=0, device="auto",
           name=None, threads_per_rank=None, env=None, runs_dir="runs", quiet=False,
           min_nodes=None, hang_timeout_s=None, events=()) -> Run:
    """Run ``script`` on ``nproc`` ranks with torchrun; stream every rank's output here.

    Args:
        script: path to the script, relative to the notebook's folder.
        nproc: ranks per node (default: every visible GPU, else 2 CPU ranks; 2 at most in smoke
            mode; shared between the nodes when ``nnodes`` > 1).
        nnodes: torchrun agents, each playing one node of a cluster with ``nproc`` ranks, all on
            this machine and meeting at one c10d rendezvous on loopback (lesson 09). On GPUs each
            node gets GPUs of its own.
        args: the script's command-line arguments, a list of strings.
        timeout_s: seconds before the run is stopped (None: no limit; NaN and infinity are refused).
        max_restarts: how many times torchrun restarts the workers after a failure.
        device: "auto" (GPUs when present, else CPU) or "cpu" (hide the GPUs).
        name: the run's label in charts and in its folder name.
        threads_per_rank: OMP_NUM_THREADS of each rank (default: CPU cores // ranks).
        env: extra environment variables for the ranks, e.g. {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}.
            Values are strings (a number is written as one); None is refused, not taken as "unset".
        runs_dir: where run folders go.
        quiet: do not print rank output or draw the live chart (sweeps use it).
        min_nodes: the fewest nodes an elastic job runs on (torchrun's ``--nnodes=MIN:MAX``
            with MAX = ``nnodes``): nodes may then leave and join while it trains (lesson 10).
        hang_timeout_s: seconds in which no rank printed a line or logged metrics, once one had,
            after which the run is taken as hung and stopped like a timeout (None: never).
            Unlike ``timeout_s`` it does not count start-up, so it can be short.
        events: things to do while the run runs, each when it reaches a given point:
            ``labkit.kill_node``, ``labkit.add_node``, ``labkit.py_spy_dump`` (lesson 10).

    Returns:
        the finished Run.

    Raises:
        FileNotFoundError, ScriptError, ValueError, TypeError, PermissionError:
            bad input, before anything is launched: a missing script, one that is not a .py
            file or does not compile, a bad nproc or nnodes (more than 4 CPU ranks per core,
            too), ...
        LaunchError: a rank failed (root cause first, with its traceback).
        LaunchTimeout: the run passed ``timeout_s`` or ``hang_timeout_s``; says where each rank was.
        KeyboardInterrupt: you interrupted it; every rank has been stopped, and one line said
            how many and where the run folder is.

    Example (lesson 02; lesson 09 adds ``nnodes=2``, lesson 10 ``min_nodes`` and ``events``)::

        run = labkit.launch("scripts/02_ddp.py", nproc=2, args=["--epochs", "2"])
    """
    p = plan(script, nproc=nproc, args=args, timeout_s=timeout_s, max_restarts=max_restarts,
             device=device, threads_per_rank=threads_per_rank, nnodes=nnodes,
             min_nodes=min_nodes, hang_timeout_s=hang_timeout_s)
    session = _Launch(p, check_events(events, p), check_env(env), name, runs_dir, quiet)
    session.start()
    status = "running"
    try:
        status = session.watch()
    except KeyboardInterrupt as interrupt:
        # The learner pressed stop: say so first, in one line, before the traceback; what the
        # ranks print while they shut down stays in their logs.
        __tracebackhide__ = True  # IPython leaves this frame out of the traceback it shows
        status = "interrupted"
        session.interrupted()
        hide_labkit_frames(interrupt)
        raise
    finally:
        session.finish(status)
    return _conclude(session.run, session.streams, session.stacks, session.emit)


class _Launch:
    """One launch while it runs: its plan, run folder, agents, and what watches them.

    In order: ``__init__`` (run folder, run.json, the command said), ``start`` (the agents),
    ``watch`` (the poll loop), ``interrupted`` when the learner stops it, ``finish`` always.
    """

    def __init__(self, p: Plan, events: tuple, env: dict, name, runs_dir, quiet: bool):
        self.p, self.events, self.quiet = p, events, quiet
        name = safe_name(name, p.script, p.world_size)
        self.run_dir = _rundir.create(runs_dir, name)
        self.run_id = uuid.uuid4().hex[:12]
        self.env = rank_env(p, self.run_dir, env)
        self.port = agents.free_port() if p.nnodes > 1 else None
        self.run = Run(self.run_dir, run_info(p, name, self.run_id, self.env, env, self.commands()))
        self._echo()
        self.live = LiveView(self.run_dir, name, p.world_size, enabled=not quiet)
        self.streams = Streams(self.run_dir, self.emit, nnodes=p.nnodes)
        self.progress = Progress(self.run_dir)
        self.stacks: dict[int, str] = {}
        self.port_retries = 0

    def emit(self, line: str) -> None:
        if not self.quiet:
            print(line)

    def commands(self) -> list[list[str]]:
        """Each agent's torchrun command, on the current rendezvous port."""
        return [torchrun_argv(self.p, self.run_dir, self.run_id, node=k, port=self.port)
                for k in range(self.p.nnodes)]

    # -- the steps ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the agents, and the driver of the launch's events."""
        self.start_s = time.monotonic()
        self.run.info["start_time"] = time.time()
        self._start_agents(self.commands())
        context = Context(self.run_dir, self.emit, self.agents, self.streams, self.add_agent,
                          {"script": self.p.script})
        self.driver = Driver(self.events, context, self.progress, self.run.info)

    def watch(self) -> str:
        """The poll loop: rank output, the live chart and events, until every agent has ended
        ("running": the outcome is theirs) or a timeout or a hang stops the run ("timeout")."""
        deadline = None if self.p.timeout_s is None else self.start_s + self.p.timeout_s
        while True:
            if self._port_taken():  # asked first: agent 0's failure may already end the wait
                self._start_on_a_new_port()
                continue
            if not self.agents.running():
                break
            self.streams.poll()
            self.live.update()
            self.driver.poll()
            hung = self._hung()
            if hung or (deadline is not None and time.monotonic() > deadline):
                self.run.info["hung"] = hung
                self.stacks = self._where_ranks_are()
                return "timeout"
            time.sleep(_POLL_S)
        return "running"

    def interrupted(self) -> None:
        """Stop every rank, and say in one line how many and where the run folder is."""
        running = len(procs.live_ranks(self.run_dir))
        supervise.stop(self.agents, self.run_dir)
        print(f"interrupted: {running} rank{'' if running == 1 else 's'} stopped, "
              f"run folder {self.run_dir}")

    def finish(self, status: str) -> None:
        """Whatever happened: stop what still runs, drain the output, record the outcome."""
        supervise.stop(self.agents, self.run_dir)
        self.streams.finish(show=status != "interrupted")
        sys.stdout.flush()
        returncode = self.agents.returncode
        if status == "running":
            status = "ok" if returncode == 0 else "failed"
        self.run.info.update(status=status, returncode=returncode, end_time=time.time(),
                             wall_s=round(time.monotonic() - self.start_s, 3))
        if self.p.nnodes > 1:
            self.run.info["returncodes"] = [proc.returncode for proc in self.agents.procs]
            self.run.info["layout"] = self.streams.layout_summary()
        if status != "interrupted":
            self.driver.finish()
        self.run.save_info()
        self.live.finish(status)

    # -- what the steps do -------------------------------------------------------------------
    def _start_agents(self, argvs: list[list[str]]) -> None:
        elastic_run = elastic.is_elastic(self.p) or self.events
        agent_class = elastic.ElasticAgents if elastic_run else agents.Agents
        self.agents = agent_class(argvs, [node_env(self.env, self.p, k) for k in range(self.p.nnodes)],
                                  [_rundir.agent_log(self.run_dir, k, self.p.nnodes)
                                   for k in range(self.p.nnodes)])
        self.agents.start()
        self.run.info.update(torchrun_pid=self.agents.pids[0], agent_pids=self.agents.pids)
        self.run.save_info()

    def _port_taken(self) -> bool:
        """Agent 0 failed because another program took the rendezvous port between
        ``free_port()`` and its start (before any rank started; a few times at most)."""
        return (self.port_retries < _PORT_RETRIES and self.agents.addr_in_use()
                and not procs.recorded_ranks(self.run_dir))

    def _start_on_a_new_port(self) -> None:
        self.port_retries += 1
        self.agents.stop()
        self.port = agents.free_port()
        self.emit(f"note: the rendezvous port was taken meanwhile; starting again on port {self.port}")
        argvs = self.commands()
        self.run.info.update(command=shlex.join(argvs[0]), argv=argvs[0],
                             commands=[shlex.join(argv) for argv in argvs])
        self._start_agents(argvs)
        self.driver.ctx.agents = self.agents

    def _hung(self) -> bool:
        """No rank has printed or logged anything for ``hang_timeout_s`` (once one had)."""
        limit = self.p.hang_timeout_s
        return limit is not None and (self.progress.update().quiet_s or 0) > limit

    def _where_ranks_are(self) -> dict[int, str]:
        """Ask every rank for its stacks; the cell shows a few lines of each dump."""
        self.streams.hold(self.p.script)
        marks = supervise.request_stacks(self.run_dir, self.streams)
        return supervise.wait_for_stacks(marks, self.p.script, poll=self.streams.poll)

    def add_agent(self) -> int:
        """An elastic run's node that joins: one more agent at the same rendezvous (an event
        calls it); returns its node number."""
        node = len(self.agents.procs)
        argv = torchrun_argv(self.p, self.run_dir, self.run_id, node=node, port=self.port)
        env = elastic.joiner_env(node_env(self.env, self.p, node), self.p, self.agents)
        self.agents.add(argv, env, _rundir.agent_log(self.run_dir, node, self.p.nnodes))
        self.streams.follow_agent(node)
        self.run.info["commands"].append(shlex.join(argv))
        self.run.info["agent_pids"] = self.agents.pids
        self.run.save_info()
        return node

    def _echo(self) -> None:
        """Print the exact command(s), and what one would type in a terminal instead."""
        if self.p.nnodes == 1:
            self.emit(f"$ {self.run.command}")
            self.emit(f"  (from a terminal: {terminal_command(self.p)})")
        else:
            for node, command in enumerate(self.run.info["commands"]):
                self.emit(f"$ [node{node}] {command}")
            self.emit(f"  (on a cluster, the same line on every node: {terminal_command(self.p)})")
        if self.p.device == "cpu" and self.p.world_size * self.p.threads_per_rank > _hardware.cpu_count():
            self.emit(f"note: {self.p.world_size} ranks × {self.p.threads_per_rank} thread(s) on "
                      f"{_hardware.cpu_count()} cores: ranks share cores, so timings understate speedup.")


def _conclude(run: Run, streams, stacks: dict, emit) -> Run:
    """Report the outcome: a summary line, or the error that explains the failure."""
    if run.status == "timeout":
        last_steps = {rank: None for rank in range(run.world_size)}
        try:
            df = run.metrics()
            last_steps.update(df.groupby("rank")["step"].max().to_dict())
        except Exception:  # noqa: BLE001 - no metrics is a fine answer here
            pass
        if run.info.get("hung"):
            summary = (f"run '{run.name}': no rank printed or logged anything for "
                       f"{run.info['hang_timeout_s']:g} s (hang_timeout_s), so it was stopped as hung.")
        else:
            summary = f"run '{run.name}' passed its timeout of {run.info['timeout_s']} s and was stopped."
        raise LaunchTimeout(
            summary,
            last_steps=last_steps, stacks=stacks, run=run, hint=timeout_hint(stacks),
        )
    failures, restarts = collect_failures(run.run_dir, streams, run.info.get("script"))
    if run.status == "ok":
        if restarts:
            emit(f"note: torchrun restarted the workers {restarts} time(s); the run then finished.")
        nodes = "" if run.nnodes == 1 else f" on {run.nnodes} nodes"
        emit(f"✓ {run.name}: {run.world_size} rank(s){nodes}, {run.wall_s:.1f} s, exit code 0 — {run.run_dir}")
        return run
    if failures:
        hint = failure_hint(failures)
    else:
        count = len(run.info.get("agent_pids") or [None] * run.nnodes)  # with nodes that joined
        logs = " and ".join(str(_rundir.agent_log(run.run_dir, k, run.nnodes)) for k in range(count))
        hint = f"no rank recorded an error; torchrun's own log is {logs}."
    restarted = f" after {restarts} restart(s)" if restarts else ""
    raise LaunchError(
        f"run '{run.name}' failed{restarted}: torchrun exited with code {run.returncode}.",
        failures=failures, run=run, returncode=run.returncode, hint=hint,
    )
