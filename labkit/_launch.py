"""labkit.launch: run a script on N ranks with torchrun, watch it, clean up after it."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
import time
import uuid
from importlib import metadata
from pathlib import Path

from labkit import _elastic, _events, _hardware, _nodes, _proc, _rundir, _supervise
from labkit._errors import LaunchError, LaunchTimeout, failure_hint, hide_labkit_frames, timeout_hint
from labkit._live import LiveView
from labkit._plan import Plan, check_env, plan, refuse_keywords
from labkit._run import Run

_POLL_S = 0.05
_PACKAGE_PARENT = str(Path(__file__).resolve().parent.parent)


def safe_name(name: str | None, script: str, nproc: int) -> str:
    if name is None:
        name = f"{Path(script).stem}-{nproc}"
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name.strip())


# -- the command ------------------------------------------------------------------------
def torchrun_argv(p: Plan, run_dir: Path, run_id: str, *, node: int = 0,
                  port: int | None = None) -> list[str]:
    """The command of agent ``node``. One node: a rendezvous on a free port that torchrun picks
    itself (``:0``). Several: all meet at ``port``, and node 0 hosts the store there."""
    if p.nnodes == 1:
        rendezvous = ["--rdzv-endpoint=127.0.0.1:0"]
        log_dir = _rundir.torchrun_dir(run_dir)
    else:
        rendezvous = [f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-conf={_elastic.rdzv_conf(p, node)}"]
        log_dir = _rundir.node_dir(run_dir, node)
    return [
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={_elastic.nnodes_spec(p)}", f"--nproc-per-node={p.nproc}",
        "--rdzv-backend=c10d", *rendezvous, f"--rdzv-id={run_id}",
        "--local-addr=127.0.0.1",  # the address ranks are told to meet at: loopback too
        f"--max-restarts={p.max_restarts}",
        f"--log-dir={log_dir}", "--redirects=3",
        "-m", "labkit._entry", p.script, *p.args,
    ]


def node_env(env: dict, p: Plan, node: int) -> dict:
    """Agent ``node``'s environment: which node it is and, on GPUs, its own devices."""
    if p.nnodes == 1:
        return env
    env = dict(env, **{_nodes.NODE_ENV: str(node)})
    if p.device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = _nodes.gpu_slice(node, p.nproc, env.get("CUDA_VISIBLE_DEVICES"))
    return env


def labkit_first_on_path(env: dict) -> str:
    """PYTHONPATH for a process that must import this very labkit (a rank, a Slurm job)."""
    return os.pathsep.join(
        [_PACKAGE_PARENT] + [x for x in env.get("PYTHONPATH", "").split(os.pathsep) if x])


def rank_env(p: Plan, run_dir: Path, extra: dict | None) -> dict:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(p.threads_per_rank)
    env[_rundir.RUN_DIR_ENV] = str(run_dir.resolve())
    env[_proc.LAUNCHER_PID_ENV] = str(os.getpid())
    env[_proc.LAUNCHER_TOKEN_ENV] = _proc.process_token(os.getpid()) or ""
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = labkit_first_on_path(env)
    loopback = _hardware.loopback_interface()
    if loopback and "GLOO_SOCKET_IFNAME" not in env:
        env["GLOO_SOCKET_IFNAME"] = loopback  # single machine: gloo talks over loopback only
    if p.max_restarts > 0 or _elastic.is_elastic(p):
        # torchrun keeps one TCPStore for every rendezvous round, and nothing in it is
        # prefixed by attempt: a restarted rank then reads the gloo addresses of the
        # attempt that failed and hangs or is refused, and a node that joins waits 60 s for
        # keys that never come. A fresh store per attempt (hosted by the new rank 0) avoids it.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    # A flight-recorder dump (NCCL's on a timeout, or one a script writes) lands in the run folder.
    env.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(_rundir.flight_prefix(run_dir.resolve())))
    if p.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    if env.get("MPLBACKEND", "").startswith("module://"):
        del env["MPLBACKEND"]  # the kernel's inline backend means nothing to a rank
    env.update(extra or {})  # checked at the door: str to str
    return env


def _torch_version() -> str | None:
    """torch's version with its build suffix ("2.14.1+cu130", "2.14.1+cpu"): which CUDA a
    reference run was built for matters, and the package metadata drops the suffix. Read from
    torch/version.py so that a launch never pays for importing torch."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(getattr(torch, "__version__", None), str):
        return str(torch.__version__)
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        spec = None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        try:
            text = (Path(folder) / "version.py").read_text()
        except OSError:
            continue
        found = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
        if found:
            return found.group(1)
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def _versions() -> dict:
    found = {"python": sys.version.split()[0], "torch": _torch_version()}
    try:
        found["labkit"] = metadata.version("labkit")
    except metadata.PackageNotFoundError:
        found["labkit"] = None
    return found


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


# -- launch ------------------------------------------------------------------------------
@refuse_keywords(nprocs="launch() takes nproc=<int> (one launch); for several world sizes use "
                        "labkit.sweep(script, nprocs=[1, 2, ...]).")
def launch(script, *, nproc=None, nnodes=1, args=(), timeout=600, max_restarts=0, device="auto",
           name=None, threads_per_rank=None, env=None, runs_dir="runs", quiet=False,
           min_nodes=None, hang_timeout=None, events=()) -> Run:
    """Run ``script`` on ``nproc`` ranks with torchrun; stream every rank's output here.

    Args:
        script: path to the script, relative to the notebook's folder.
        nproc: ranks per node (default: every visible GPU, else 2 CPU ranks; 2 at most in smoke
            mode; shared between the nodes when ``nnodes`` > 1).
        nnodes: torchrun agents, each playing one node of a cluster with ``nproc`` ranks, all on
            this machine and meeting at one c10d rendezvous on loopback (lesson 09). On GPUs each
            node gets GPUs of its own.
        args: the script's command-line arguments, a list of strings.
        timeout: seconds before the run is stopped (None: no limit; NaN and infinity are refused).
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
        hang_timeout: seconds in which no rank printed a line or logged metrics, once one had,
            after which the run is taken as hung and stopped like a timeout (None: never).
            Unlike ``timeout`` it does not count start-up, so it can be short.
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
        LaunchTimeout: the run passed ``timeout`` or ``hang_timeout``; says where each rank was.
        KeyboardInterrupt: you interrupted it; every rank has been stopped, and one line said
            how many and where the run folder is.

    Example (lesson 02; lesson 09 adds ``nnodes=2``, lesson 10 ``min_nodes`` and ``events``)::

        run = labkit.launch("scripts/02_ddp.py", nproc=2, args=["--epochs", "2"])
    """
    p = plan(script, nproc=nproc, args=args, timeout=timeout, max_restarts=max_restarts,
             device=device, threads_per_rank=threads_per_rank, nnodes=nnodes,
             min_nodes=min_nodes, hang_timeout=hang_timeout)
    events = _events.check_events(events, p)
    env = check_env(env)
    name = safe_name(name, p.script, p.world_size)
    run_dir = _rundir.create(runs_dir, name)
    run_id = uuid.uuid4().hex[:12]
    rank_environment = rank_env(p, run_dir, env)
    port = _nodes.free_port() if p.nnodes > 1 else None
    argvs = [torchrun_argv(p, run_dir, run_id, node=k, port=port) for k in range(p.nnodes)]

    def emit(line: str) -> None:
        if not quiet:
            print(line)

    run = Run(run_dir, {
        "name": name, "script": p.script, "args": list(p.args), "nproc": p.nproc,
        "nnodes": p.nnodes, "world_size": p.world_size,
        "device": p.device, "backend": "nccl" if p.device == "cuda" else "gloo",
        "threads_per_rank": p.threads_per_rank, "max_restarts": p.max_restarts,
        "timeout": p.timeout, "hang_timeout": p.hang_timeout, "min_nodes": p.min_nodes,
        "run_id": run_id, "command": shlex.join(argvs[0]), "argv": argvs[0],
        "cwd": os.getcwd(), "smoke": _hardware.is_smoke(),
        "env": {k: rank_environment[k] for k in sorted(rank_environment)
                if k in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "GLOO_SOCKET_IFNAME",
                         "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "LABKIT_SMOKE", *(env or {}))},
        "versions": _versions(), "git_commit": _git_commit(),
        "hardware": _hardware.describe(),
        "status": "running",
    })
    if p.nnodes > 1:
        run.info["commands"] = [shlex.join(argv) for argv in argvs]
    _echo(run, p, emit)

    live = LiveView(run_dir, name, p.world_size, enabled=not quiet)
    streams = _supervise.Streams(run_dir, emit, nnodes=p.nnodes)
    logs = [_rundir.agent_log(run_dir, k, p.nnodes) for k in range(p.nnodes)]
    start = time.monotonic()
    run.info["start_time"] = time.time()
    agent_class = _elastic.ElasticAgents if _elastic.is_elastic(p) or events else _nodes.Agents
    agents = _start_agents(argvs, [node_env(rank_environment, p, k) for k in range(p.nnodes)], logs,
                           agent_class)
    run.info["torchrun_pid"] = agents.pids[0]
    run.info["agent_pids"] = agents.pids
    run.save_info()

    def start_agent() -> int:
        """An elastic run's node that joins: one more agent at the same rendezvous."""
        node = len(agents.procs)
        argv = torchrun_argv(p, run_dir, run_id, node=node, port=port)
        agent_env = _elastic.joiner_env(node_env(rank_environment, p, node), p, agents)
        agents.add(argv, agent_env, _rundir.agent_log(run_dir, node, p.nnodes))
        streams.follow_agent(node)
        run.info["commands"].append(shlex.join(argv))
        run.info["agent_pids"] = agents.pids
        run.save_info()
        return node

    progress = _events.Progress(run_dir)
    context = _events.Context(run_dir, emit, agents, streams, start_agent, {"script": p.script})
    driver = _events.Driver(events, context, progress, run.info)
    status, stacks, retries = "running", {}, 0
    try:
        deadline = None if p.timeout is None else start + p.timeout
        while agents.running():
            if agents.addr_in_use() and retries < 3 and not _supervise.recorded_ranks(run_dir):
                # Another program took the rendezvous port between free_port() and agent 0.
                retries += 1
                agents.stop()
                port = _nodes.free_port()
                emit(f"note: the rendezvous port was taken meanwhile; starting again on port {port}")
                argvs = [torchrun_argv(p, run_dir, run_id, node=k, port=port) for k in range(p.nnodes)]
                run.info.update(command=shlex.join(argvs[0]), argv=argvs[0],
                                commands=[shlex.join(argv) for argv in argvs])
                agents = context.agents = _start_agents(argvs, agents.envs, logs, agent_class)
                run.info["torchrun_pid"], run.info["agent_pids"] = agents.pids[0], agents.pids
                run.save_info()
                continue
            streams.poll()
            live.update()
            driver.poll()
            hung = p.hang_timeout is not None and (progress.update().quiet_s or 0) > p.hang_timeout
            if hung or (deadline is not None and time.monotonic() > deadline):
                status = "timeout"
                run.info["hung"] = hung
                streams.hold(p.script)  # the cell shows a few lines of each rank's stack dump
                marks = _supervise.request_stacks(run_dir, streams)
                time.sleep(1.0)  # let faulthandler write the stacks
                streams.poll()
                stacks = _supervise.read_stacks(marks, p.script)
                break
            time.sleep(_POLL_S)
    except KeyboardInterrupt as interrupt:
        # The learner pressed stop: say so first, in one line, before the traceback; what the
        # ranks print while they shut down stays in their logs.
        __tracebackhide__ = True  # IPython leaves this poll loop out of the traceback it shows
        status = "interrupted"
        running = len(_supervise.live_ranks(run_dir))
        _supervise.stop(agents, run_dir)
        print(f"interrupted: {running} rank{'' if running == 1 else 's'} stopped, run folder {run_dir}")
        hide_labkit_frames(interrupt)
        raise
    finally:
        _supervise.stop(agents, run_dir)
        streams.finish(show=status != "interrupted")
        sys.stdout.flush()
        returncode = agents.returncode
        if status == "running":
            status = "ok" if returncode == 0 else "failed"
        run.info.update(status=status, returncode=returncode, end_time=time.time(),
                        wall_s=round(time.monotonic() - start, 3))
        if p.nnodes > 1:
            run.info["returncodes"] = [proc.returncode for proc in agents.procs]
            run.info["layout"] = streams.layout_summary()
        if status != "interrupted":
            driver.finish()
        run.save_info()
        live.finish(status)
    return _conclude(run, streams, stacks, emit)


def _start_agents(argvs, envs, logs, agent_class=_nodes.Agents) -> _nodes.Agents:
    agents = agent_class(argvs, envs, logs)
    agents.start()
    return agents


def _echo(run: Run, p: Plan, emit) -> None:
    """Print the exact command(s), and what one would type in a terminal instead."""
    script_and_args = shlex.join([p.script, *p.args])
    if p.nnodes == 1:
        emit(f"$ {run.command}")
        emit(f"  (from a terminal: torchrun --standalone --nproc-per-node={p.nproc} {script_and_args})")
    else:
        for node, command in enumerate(run.info["commands"]):
            emit(f"$ [node{node}] {command}")
        emit(f"  (on a cluster, the same line on every node: torchrun --nnodes={p.nnodes} "
             f"--nproc-per-node={p.nproc} --rdzv-backend=c10d --rdzv-endpoint=<first node>:29500 "
             f"--rdzv-id=<job id> {script_and_args})")
    if p.device == "cpu" and p.world_size * p.threads_per_rank > _hardware.cpu_count():
        emit(f"note: {p.world_size} ranks × {p.threads_per_rank} thread(s) on "
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
                       f"{run.info['hang_timeout']:g} s (hang_timeout), so it was stopped as hung.")
        else:
            summary = f"run '{run.name}' passed its timeout of {run.info['timeout']} s and was stopped."
        raise LaunchTimeout(
            summary,
            last_steps=last_steps, stacks=stacks, run=run, hint=timeout_hint(stacks),
        )
    failures, restarts = _supervise.collect_failures(run.run_dir, streams)
    if run.status == "ok":
        if restarts:
            emit(f"note: torchrun restarted the workers {restarts} time(s); the run then finished.")
        nodes = "" if run.nnodes == 1 else f" on {run.nnodes} nodes"
        emit(f"✓ {run.name}: {run.world_size} rank(s){nodes}, {run.wall_s:.1f} s, exit code 0 — {run.run_dir}")
        return run
    if failures:
        hint = failure_hint(failures)
    else:
        agents = len(run.info.get("agent_pids") or [None] * run.nnodes)  # with nodes that joined
        logs = " and ".join(str(_rundir.agent_log(run.run_dir, k, run.nnodes)) for k in range(agents))
        hint = f"no rank recorded an error; torchrun's own log is {logs}."
    restarted = f" after {restarts} restart(s)" if restarts else ""
    raise LaunchError(
        f"run '{run.name}' failed{restarted}: torchrun exited with code {run.returncode}.",
        failures=failures, run=run, returncode=run.returncode, hint=hint,
    )
