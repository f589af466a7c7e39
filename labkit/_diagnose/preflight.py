"""labkit.preflight: before a launch on several nodes, what will break, each with its fix (lesson 09).

A probe (``labkit/_rank/probe.py``, standard library only) runs on every node: on this
machine's loopback "nodes" (one process each, with that node's environment), or on every node
of a Slurm allocation (one ``srun`` task per node, through ``labkit.sbatch``). Node 0 holds the
rendezvous port and writes a token into the checkpoint folder; the others resolve the host,
reach the port and read the token. ``findings`` turns what they report into rows.
Kernel side, standard library.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from labkit._diagnose import findings
from labkit._diagnose.doctor import Check, Checks
from labkit._rank.probe import MARK

#: The batch script of a Slurm preflight: the probe on every node of the allocation.
BATCH = """#!/bin/bash
# labkit.preflight under Slurm: the probe once on every node of the allocation (lesson 09).
#SBATCH --ntasks-per-node=1
#SBATCH --time=00:05:00
set -euo pipefail
# The rendezvous host: the one asked for, else the first node's address, as lesson 09's job.
host=${LABKIT_PREFLIGHT_HOST:-}
if [ -z "$host" ]; then
  head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
  host=$(scontrol show node "$head_node" | grep -oP 'NodeAddr=\\K\\S+')
fi
srun --ntasks-per-node=1 "${PYTHON:-python3}" -m labkit._rank.probe --host "$host" "$@"
"""


@dataclass(repr=False)
class Preflight(Checks):
    """What ``labkit.preflight`` found: one row per check, a table in Jupyter, text elsewhere.

    Attributes:
        checks: the rows (``status`` "ok", "info" or "warn"; ``advice`` holds the fix).
        nodes: each node's facts, as its probe reported them (hostname, versions, interfaces).
        host, port: the rendezvous endpoint that was checked.
        ok: True when no row warns.

    Example (lesson 09)::

        report = labkit.preflight(nnodes=2, port=29500, checkpoint_dir="runs/09")
        report                      # the table
        assert report.ok, report
    """

    nodes: list = field(default_factory=list)
    host: str = ""
    port: int = 0

    def table(self):
        """The rows as a DataFrame: ``status``, ``check``, ``found``, ``fix``."""
        import pandas as pd
        return pd.DataFrame([(c.status, c.what, c.value, c.advice) for c in self.checks],
                            columns=["status", "check", "found", "fix"])


def _check_args(nnodes, nproc, host, port, checkpoint_dir, node_env, slurm, wait_s) -> None:
    for name, value, low in (("nnodes", nnodes, 1), ("nproc", nproc, 1), ("port", port, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}. HINT: e.g. "
                             f"preflight(nnodes=2, nproc=1, port=29500).")
    if port > 65535:
        raise ValueError(f"port must be at most 65535, got {port}. HINT: torchrun's default is 29500.")
    if host is not None and (not isinstance(host, str) or not host.strip() or " " in host.strip()):
        raise ValueError(f"host must be a host name or address, got {host!r}. HINT: the rendezvous "
                         f"host every node meets at, e.g. host='127.0.0.1' or the first node's name.")
    if checkpoint_dir is not None and not isinstance(checkpoint_dir, (str, os.PathLike)):
        raise TypeError(f"checkpoint_dir must be a folder's path, got {checkpoint_dir!r}. "
                        f"HINT: the folder the job saves to, e.g. checkpoint_dir='runs/09'.")
    if not isinstance(wait_s, (int, float)) or isinstance(wait_s, bool) or not 0 < wait_s < math.inf:
        raise ValueError(f"wait_s must be a positive number of seconds, got {wait_s!r}. HINT: e.g. 10.")
    if node_env is None:
        return
    if slurm:
        raise ValueError("node_env plays a node's own environment on this machine; under Slurm "
                         "every node has its own already. HINT: leave node_env out with slurm=True.")
    if not isinstance(node_env, dict) or not set(node_env) <= set(range(nnodes)):
        raise ValueError(f"node_env must map nodes 0..{nnodes - 1} to their environment, got "
                         f"{node_env!r}. HINT: e.g. node_env={{1: {{'GLOO_SOCKET_IFNAME': 'eth0'}}}}.")


def _probe_args(nnodes, port, token, checkpoint_dir, wait_s) -> list[str]:
    args = ["--nnodes", str(nnodes), "--port", str(port), "--token", token, "--wait-s", str(wait_s)]
    return args + (["--checkpoint-dir", os.fspath(checkpoint_dir)] if checkpoint_dir is not None else [])


def _reports(text: str) -> list[dict]:
    return [json.loads(line.split(MARK, 1)[1]) for line in text.splitlines() if MARK in line]


def _on_this_machine(nnodes, host, args, env, node_env, timeout_s) -> dict[int, dict | str]:
    """One probe process per loopback node, each with its node's environment; every one is
    stopped by the end, whatever happens. {node: its facts, or why it reported none}."""
    from labkit._launch.command import labkit_first_on_path
    from labkit._launch.plan import check_env

    procs = {}
    try:
        for node in range(nnodes):
            node_vars = dict(os.environ, **env, **check_env((node_env or {}).get(node)))
            node_vars["PYTHONPATH"] = labkit_first_on_path(node_vars)
            procs[node] = subprocess.Popen(
                [sys.executable, "-m", "labkit._rank.probe", "--node", str(node), "--host", host, *args],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=node_vars)
        deadline, said = time.monotonic() + timeout_s, {}
        for node, proc in procs.items():
            try:
                out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                said[node] = f"no report within {timeout_s:g} s"
                continue
            found = _reports(out)
            said[node] = found[0] if found else (
                f"exit code {proc.returncode}: {(err.strip().splitlines() or ['no output'])[-1]}")
        return said
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _on_slurm(nnodes, host, args, env, timeout_s, runs_dir) -> dict[int, dict | str]:
    """The probe on every node of a Slurm job (``labkit.sbatch``); {node: facts or why not}."""
    from labkit._launch.sbatch import sbatch

    with tempfile.TemporaryDirectory(prefix="labkit-preflight-") as folder:
        script = Path(folder, "preflight.sbatch")
        script.write_text(BATCH)
        job_env = dict(env, **({"LABKIT_PREFLIGHT_HOST": host} if host else {}))
        run = sbatch(script, nodes=nnodes, args=args, env=job_env, timeout_s=timeout_s,
                     name="preflight", runs_dir=runs_dir, quiet=True)
    found = {facts["node"]: facts for facts in _reports(run.output())}
    return {node: found.get(node, f"no report in the job's output ({run.info['slurm']['output']})")
            for node in range(nnodes)}


def _report(said: dict, host: str, port: int, nproc: int) -> Preflight:
    facts = [f for f in said.values() if isinstance(f, dict)]
    report = Preflight(nodes=facts, host=host, port=port)
    report.checks.append(Check("nodes", ", ".join(
        f"node {n}: {f['hostname']} (pid {f['pid']})" if isinstance(f, dict) else f"node {n}: ?"
        for n, f in said.items()), "info"))
    report.checks += [Check(f"probe (node {n})", f"reported nothing: {why}", "warn",
                            f"run python -m labkit._rank.probe --help on node {n} to see why")
                      for n, why in said.items() if isinstance(why, str)]
    if not facts:
        return report
    rows = (findings.resolving(facts, host) + findings.port(facts, host, port)
            + findings.interfaces(facts) + findings.versions(facts)
            + findings.checkpoint(facts) + findings.gpus(facts, nproc))
    silent = [str(n) for n, f in said.items() if isinstance(f, str)]
    for row in rows if silent else ():  # "every node" then means every node that reported
        if "every node" in row.value:
            row.value += f" (node {', '.join(silent)} did not report)"
    report.checks += rows
    return report


def preflight(nnodes: int = 2, *, nproc: int = 1, host: str | None = None, port: int = 29500,
              checkpoint_dir=None, env=None, node_env=None, slurm: bool = False,
              wait_s: float = 10.0, timeout_s: float = 120.0, runs_dir="runs") -> Preflight:
    """Before a launch on several nodes: what will break, each finding with its fix.

    Checks, on every node: that the rendezvous host resolves; that node 0 can hold the port
    (free, one of its addresses) and every other node reaches it there; that
    ``NCCL_SOCKET_IFNAME`` / ``GLOO_SOCKET_IFNAME`` name interfaces the node has; that Python,
    PyTorch, NCCL and labkit are the same versions everywhere; that ``checkpoint_dir`` is one
    filesystem (node 0 writes a token, every node reads it); that each node has GPUs for
    ``nproc`` ranks (or none anywhere: CPU ranks). It takes about a second when all is well,
    up to ``wait_s`` when a node waits for one that never comes.

    Args:
        nnodes: the nodes: loopback "nodes" on this machine, or the Slurm job's (``slurm``).
        nproc: ranks per node, as the launch will use.
        host, port: the rendezvous endpoint (default host: 127.0.0.1 here; under Slurm the
            first node's address, as lesson 09's job uses).
        checkpoint_dir: the folder the job saves to; ``$VARS`` expand on each node.
        env: environment variables for every node's probe; node_env: {node: variables} for
            one loopback node (how a node with another interface or torch is played here).
        slurm: probe the nodes of a Slurm job (``sbatch --nodes=nnodes``) instead.
        wait_s: how long a node waits for the others; timeout_s: for the whole check.

    Returns:
        a Preflight report: ``.ok``, the rows, ``.table()``, ``.nodes``.

    Raises:
        ValueError, TypeError: bad input, before any probe starts.
        RuntimeError, LaunchError: under Slurm, no cluster answers or the job failed.

    Example (lesson 09)::

        report = labkit.preflight(nnodes=2, port=29500, checkpoint_dir="runs/09")
        report
    """
    from labkit._launch.plan import check_env, check_timeout

    _check_args(nnodes, nproc, host, port, checkpoint_dir, node_env, slurm, wait_s)
    env, timeout_s = check_env(env), check_timeout(timeout_s) or 120.0
    args = _probe_args(nnodes, port, uuid.uuid4().hex[:12], checkpoint_dir, wait_s)
    if slurm:
        said = _on_slurm(nnodes, host, args, env, timeout_s, runs_dir)
    else:
        host = host or "127.0.0.1"
        said = _on_this_machine(nnodes, host, args, env, node_env, timeout_s)
    facts = [f for f in said.values() if isinstance(f, dict)]
    return _report(said, host or (facts[0]["host"] if facts else "the first node"), port, nproc)


def main(argv=None) -> int:
    """``make doctor NODES=2``: the report, and exit code 1 when a row warns."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m labkit._diagnose.preflight",
                                     description="before a launch on several nodes: what will break")
    parser.add_argument("--nnodes", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--host", default=None)
    parser.add_argument("--port", type=int, default=29500)
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--slurm", action="store_true", help="on the nodes of a Slurm job")
    args = parser.parse_args(argv)
    report = preflight(args.nnodes, nproc=args.nproc, host=args.host, port=args.port,
                       checkpoint_dir=args.checkpoint_dir, slurm=args.slurm)
    print(report)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
