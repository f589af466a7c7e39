"""Slurm from a notebook (lesson 09): is a cluster answering, and submit a batch script to it.

``labkit.sbatch`` is ``sbatch`` plus what a notebook needs: the job's output streams into the
cell, a timeout or the interrupt button cancels the job (``scancel``), and the ranks log their
metrics into a run folder, so the charts and checks of ``labkit.launch`` work on a Slurm job
too. Kernel side, standard library: a second launcher beside ``launch``, sharing its checks
at the door (``plan``), its run folder and its errors.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from labkit import _rundir
from labkit._errors import LaunchError, LaunchTimeout
from labkit._launch.command import labkit_first_on_path, safe_name
from labkit._launch.keywords import refuse_keywords, renamed
from labkit._launch.plan import _check_int, check_args, check_env, check_timeout
from labkit._launch.tail import LineTail
from labkit._results.run import Run

#: States after which a job will not run again (a requeued job goes back to PENDING instead).
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                "PREEMPTED", "BOOT_FAIL", "DEADLINE", "SPECIAL_EXIT"}
_POLL_S = 0.25
_FORGOTTEN_S = 30.0
#: Where no Slurm answers, what does give one (said once, in every such reason).
_GET_ONE = "`make test-slurm` runs them on a one-host cluster"


@dataclass(frozen=True)
class SlurmStatus:
    """Whether a Slurm cluster answers here. ``reason`` says why not, or what answered.

    Example (lesson 09)::

        status = labkit.slurm_status()
        print(status.reason if not status else status.nodes)
    """

    ok: bool
    reason: str
    nodes: dict = field(default_factory=dict)  # {node: state}, as sinfo reports them

    def __bool__(self) -> bool:
        return self.ok


@refuse_keywords(**renamed("slurm_status", timeout="timeout_s"))
def slurm_status(*, timeout_s: float = 10.0) -> SlurmStatus:
    """Is ``sbatch`` on PATH and does a controller answer with at least one usable node?

    Args:
        timeout_s: how long ``sinfo`` may take to answer.

    Returns:
        a SlurmStatus: true when a cluster answers; ``reason`` says why not, or what answered.

    Example (lesson 09)::

        slurm = labkit.slurm_status()
        if not slurm:
            print(f"skipped: {slurm.reason}")
    """
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        return SlurmStatus(False, f"Slurm is not installed here (no sbatch on PATH); {_GET_ONE}")
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True,
                             text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return SlurmStatus(False, f"sinfo found no Slurm controller within {timeout_s:g} s; {_GET_ONE}")
    if out.returncode != 0:
        said = (out.stderr.strip().splitlines() or ["no message"])[-1]
        return SlurmStatus(False, f"sbatch is installed but no Slurm controller answers ({said}); "
                                  f"{_GET_ONE}")
    nodes = dict(line.split()[:2] for line in out.stdout.splitlines() if len(line.split()) >= 2)
    usable = sorted(n for n, state in nodes.items() if state.rstrip("*~#") in ("idle", "mixed", "allocated"))
    if not usable:
        return SlurmStatus(False, f"the Slurm cluster has no usable node ({nodes or 'none'})", nodes)
    return SlurmStatus(True, f"{len(usable)} node(s) up: {', '.join(usable)}", nodes)


def job_state(job_id: str) -> tuple[str, str | None]:
    """(JobState, ExitCode) of a job as ``scontrol show job`` says; ("UNKNOWN", None) if gone."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True,
                         text=True, timeout=30)
    state = re.search(r"\bJobState=(\S+)", out.stdout)
    code = re.search(r"\bExitCode=(\S+)", out.stdout)
    return (state.group(1) if state else "UNKNOWN"), (code.group(1) if code else None)


def cancel(job_id: str, *, wait_s: float = 20.0) -> str:
    """``scancel`` the job and wait until it has stopped; its last state."""
    subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
    deadline = time.monotonic() + wait_s
    state = job_state(job_id)[0]
    while state not in FINAL_STATES | {"UNKNOWN"} and time.monotonic() < deadline:
        time.sleep(_POLL_S)
        state = job_state(job_id)[0]
    return state


@refuse_keywords(**renamed("sbatch", timeout="timeout_s"))
def sbatch(script, *, nodes: int = 2, args=(), timeout_s=600, name=None, env=None,
           runs_dir="runs", quiet=False) -> Run:
    """Submit a batch script with ``sbatch --nodes=N``, stream its output, wait for the end.

    The job gets this kernel's environment (Slurm's default), plus ``LABKIT_RUN_DIR`` (the
    ranks' ``metrics.log`` lines land in the run folder), ``PYTHON`` (this interpreter, for
    the script to start torchrun with) and ``env``.

    Args:
        script: the batch script, relative to the notebook's folder (the job runs there too).
        nodes: ``--nodes``.
        args: the batch script's own arguments.
        timeout_s: seconds before the job is cancelled (None: no limit).
        name: the job's name and the run's label (default: the script's name).
        env: extra environment variables for the job.

    Returns:
        a Run: ``run.metrics()`` as for a launch, ``run.output()`` the job's output file,
        ``run.info["slurm"]`` its id, state and exit code.

    Raises:
        FileNotFoundError, ValueError, TypeError: bad input, before anything is submitted.
        RuntimeError: no Slurm cluster answers (``slurm_status()`` says why).
        LaunchError: the job failed; LaunchTimeout: it passed ``timeout_s`` and was cancelled.
        KeyboardInterrupt: you interrupted it; the job has been cancelled.

    Example (lesson 09)::

        run = labkit.sbatch("scripts/09_job.sbatch", nodes=2, timeout_s=600)
    """
    path = Path(os.fspath(script))
    if not path.is_file():
        raise FileNotFoundError(f"batch script {os.fspath(script)!r} does not exist (looked in "
                                f"{Path.cwd()}). HINT: run the %%writefile cell first.")
    _check_int("nodes", nodes, 1)
    args, timeout_s, env = check_args(args), check_timeout(timeout_s), check_env(env)
    status = slurm_status()
    if not status:
        raise RuntimeError(f"cannot submit {path}: {status.reason}.")
    emit = (lambda line: None) if quiet else print
    run = _submit(path, nodes, args, env, name, runs_dir, timeout_s, emit)
    start, state, code = time.monotonic(), "PENDING", None
    tail = LineTail(run.info["slurm"]["output"])
    try:
        state, code = _follow(run, tail, timeout_s, emit)
    except KeyboardInterrupt:
        state = cancel(run.info["slurm"]["job_id"])
        run.info["status"] = "interrupted"
        raise
    finally:
        time.sleep(0.2)  # the output file's last lines
        lines = tail.new_lines()
        rest = tail.rest()  # an unfinished last line
        for line in lines + ([rest] if rest else []):
            emit(f"[job {run.info['slurm']['job_id']}] {line}")
        _finish(run, state, code, start)
    return _conclude(run, emit)


def _submit(path: Path, nodes: int, args: tuple, env: dict, name, runs_dir, timeout_s, emit) -> Run:
    """``sbatch`` the script; a Run whose ``info["slurm"]`` holds the job's id and output file."""
    name = safe_name(name if name is not None else path.stem, os.fspath(path), nodes)
    run_dir = _rundir.create(runs_dir, name)
    output = run_dir / _rundir.SLURM_OUTPUT
    argv = ["sbatch", "--parsable", f"--nodes={nodes}", f"--job-name={name}",
            f"--output={output.resolve()}", os.fspath(path), *args]
    job_env = dict(os.environ, **{_rundir.RUN_DIR_ENV: str(run_dir.resolve())},
                   PYTHON=sys.executable, PYTHONUNBUFFERED="1", **env)
    job_env["PYTHONPATH"] = labkit_first_on_path(job_env)
    emit(f"$ {shlex.join(argv)}")
    run = Run(run_dir, {"name": name, "script": os.fspath(path), "args": list(args), "nproc": None,
                        "nnodes": nodes, "command": shlex.join(argv), "argv": argv,
                        "cwd": os.getcwd(), "timeout_s": timeout_s, "status": "running",
                        "start_time": time.time()})
    done = subprocess.run(argv, env=job_env, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"sbatch refused {path}: {done.stderr.strip() or done.stdout.strip()}")
    job_id = done.stdout.strip().split(";")[0]
    run.info["slurm"] = {"job_id": job_id, "output": str(output)}
    run.save_info()
    emit(f"submitted job {job_id}; its output: {output}")
    return run


def _follow(run: Run, tail: LineTail, timeout_s, emit) -> tuple[str, str | None]:
    """Print the job's output until it ends (or passes ``timeout_s`` and is cancelled);
    returns its last (JobState, ExitCode)."""
    job_id = run.info["slurm"]["job_id"]
    start = known = time.monotonic()  # when scontrol last knew the job (it forgets a job MinJobAge after its end)
    while True:
        for line in tail.new_lines():
            emit(f"[job {job_id}] {line}")
        state, code = job_state(job_id)
        if state in FINAL_STATES:
            return state, code
        if state != "UNKNOWN":
            known = time.monotonic()
        elif time.monotonic() - known > _FORGOTTEN_S:
            return state, code  # ended long ago, or never known: reported as failed, with what it printed
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            run.info["status"] = "timeout"
            return cancel(job_id), code
        time.sleep(_POLL_S)


def _finish(run: Run, state: str, code: str | None, start: float) -> None:
    returncode = int(code.split(":")[0]) if code and code.split(":")[0].isdigit() else None
    run.info["slurm"].update(state=state, exit_code=code)
    if run.info["status"] == "running":
        run.info["status"] = "ok" if state == "COMPLETED" else "failed"
    run.info.update(returncode=returncode, end_time=time.time(),
                    wall_s=round(time.monotonic() - start, 3))
    try:  # the world size, as the ranks stamped it on their metrics
        sizes = run.metrics()["world_size"]
        run.info["world_size"] = int(sizes.max())
        run.info["nproc"] = run.info["world_size"] // run.info["nnodes"]
    except Exception:  # noqa: BLE001 - a job that logged nothing has no world size to read
        pass
    run.save_info()


def _conclude(run: Run, emit) -> Run:
    slurm = run.info["slurm"]
    if run.status == "timeout":
        raise LaunchTimeout(f"Slurm job {slurm['job_id']} passed its timeout of "
                            f"{run.info.get('timeout_s', '?')} s and was cancelled ({slurm['state']}).",
                            run=run, hint="its output (above) shows how far it got.")
    if run.status != "ok":
        raise LaunchError(f"Slurm job {slurm['job_id']} ended {slurm['state']} (exit code "
                          f"{slurm['exit_code']}).", run=run, returncode=run.returncode,
                          hint=f"its output (above, and in {slurm['output']}) says why.")
    emit(f"✓ job {slurm['job_id']}: {slurm['state']} on {run.info['nnodes']} node(s), "
         f"{run.wall_s:.1f} s — {run.run_dir}")
    return run
