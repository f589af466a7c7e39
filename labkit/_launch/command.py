"""What a launch runs: the torchrun command of each agent, and the ranks' environment.

Also what ``run.json`` records about where it ran (versions, git commit). Kernel side,
standard library; the launcher (``labkit._launch.launch``) and ``sbatch`` use it.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from labkit import _hardware, _rundir
from labkit._launch import agents, elastic
from labkit._launch.plan import Plan
from labkit._rank import layout, proc
from labkit._rank.probe import torch_version as _torch_version

_PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])


def safe_name(name: str | None, script: str, nproc: int) -> str:
    if name is None:
        name = f"{Path(script).stem}-{nproc}"
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name.strip())


def torchrun_argv(p: Plan, run_dir: Path, run_id: str, *, node: int = 0,
                  port: int | None = None) -> list[str]:
    """The command of agent ``node``. One node: a rendezvous on a free port that torchrun picks
    itself (``:0``). Several: all meet at ``port``, and node 0 hosts the store there."""
    if p.nnodes == 1:
        rendezvous = ["--rdzv-endpoint=127.0.0.1:0"]
        log_dir = _rundir.torchrun_dir(run_dir)
    else:
        rendezvous = [f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-conf={elastic.rdzv_conf(p, node)}"]
        log_dir = _rundir.node_dir(run_dir, node)
    return [
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={elastic.nnodes_spec(p)}", f"--nproc-per-node={p.nproc}",
        "--rdzv-backend=c10d", *rendezvous, f"--rdzv-id={run_id}",
        "--local-addr=127.0.0.1",  # the address ranks are told to meet at: loopback too
        f"--max-restarts={p.max_restarts}",
        f"--log-dir={log_dir}", "--redirects=3",
        "-m", "labkit._rank.entry", p.script, *p.args,
    ]


def terminal_command(p: Plan) -> str:
    """What a learner would type for the same launch: on one machine ``torchrun --standalone``;
    on several nodes the line every node runs, with the cluster's address and a job id to fill
    in. Elastic launches keep their ``MIN:MAX`` nodes, and restarts their ``--max-restarts``."""
    restarts = [f"--max-restarts={p.max_restarts}"] if p.max_restarts else []
    if p.nnodes == 1:
        argv = ["torchrun", "--standalone", f"--nproc-per-node={p.nproc}", *restarts]
    else:
        argv = ["torchrun", f"--nnodes={elastic.nnodes_spec(p)}", f"--nproc-per-node={p.nproc}",
                *restarts, "--rdzv-backend=c10d", "--rdzv-endpoint=<first node>:29500",
                "--rdzv-id=<job id>"]
    return " ".join(argv) + " " + shlex.join([p.script, *p.args])


def node_env(env: dict, p: Plan, node: int) -> dict:
    """Agent ``node``'s environment: which node it is and, on GPUs, its own devices."""
    if p.nnodes == 1:
        return env
    env = dict(env, **{layout.NODE_ENV: str(node)})
    if p.device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = agents.gpu_slice(node, p.nproc, env.get("CUDA_VISIBLE_DEVICES"))
    return env


def labkit_first_on_path(env: dict) -> str:
    """PYTHONPATH for a process that must import this very labkit (a rank, a Slurm job)."""
    return os.pathsep.join(
        [_PACKAGE_PARENT] + [x for x in env.get("PYTHONPATH", "").split(os.pathsep) if x])


def rank_env(p: Plan, run_dir: Path, extra: dict | None) -> dict:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(p.threads_per_rank)
    env[_rundir.RUN_DIR_ENV] = str(run_dir.resolve())
    env[proc.LAUNCHER_PID_ENV] = str(os.getpid())
    env[proc.LAUNCHER_TOKEN_ENV] = proc.process_token(os.getpid()) or ""
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = labkit_first_on_path(env)
    loopback = _hardware.loopback_interface()
    if loopback and "GLOO_SOCKET_IFNAME" not in env:
        env["GLOO_SOCKET_IFNAME"] = loopback  # single machine: gloo talks over loopback only
    if p.max_restarts > 0 or elastic.is_elastic(p):
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


#: The rank environment variables run.json keeps (with those the caller set).
_RECORDED_ENV = ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "GLOO_SOCKET_IFNAME",
                 "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "LABKIT_SMOKE")


def run_info(p: Plan, name: str, run_id: str, env: dict, extra_env: dict, argvs: list) -> dict:
    """What ``run.json`` says about a launch before it starts (``env``: the ranks' environment,
    ``extra_env``: the part the caller asked for; ``argvs``: each agent's command)."""
    info = {
        "name": name, "script": p.script, "args": list(p.args), "nproc": p.nproc,
        "nnodes": p.nnodes, "world_size": p.world_size,
        "device": p.device, "backend": "nccl" if p.device == "cuda" else "gloo",
        "threads_per_rank": p.threads_per_rank, "max_restarts": p.max_restarts,
        "timeout_s": p.timeout_s, "hang_timeout_s": p.hang_timeout_s, "min_nodes": p.min_nodes,
        "run_id": run_id, "command": shlex.join(argvs[0]), "argv": argvs[0],
        "cwd": os.getcwd(), "smoke": _hardware.is_smoke(),
        "env": {k: env[k] for k in sorted(env) if k in (*_RECORDED_ENV, *extra_env)},
        "versions": _versions(), "git_commit": _git_commit(),
        "hardware": _hardware.describe(),
        "status": "running",
    }
    if p.nnodes > 1:
        info["commands"] = [shlex.join(argv) for argv in argvs]
    return info
