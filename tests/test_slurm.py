"""labkit.sbatch and lesson 09's batch script on a real Slurm cluster.

``make test-slurm`` starts a one-host cluster (two slurmd as nodes n1 and n2) and runs these;
elsewhere they are skipped with the reason. Every job is checked to leave nothing running.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

import labkit
from labkit import LaunchError, LaunchTimeout
from labkit._launch import sbatch as _slurm
from _lab import processes_under
from conftest import ROOT, execute, python

pytestmark = pytest.mark.slurm

TINY = ["--synthetic", "--train-size", "256", "--batch-size", "16", "--width", "8",
        "--log-every", "2", "--workers", "0"]
REQUEUE_EPOCHS = 30   # 8 steps each at 2 ranks


def nothing_left(folder: Path, timeout: float = 20.0) -> list[tuple[int, str]]:
    """What still runs in ``folder`` (a job's steps and tasks run where it was submitted)
    after up to ``timeout`` seconds: [] when nothing does."""
    deadline = time.monotonic() + timeout
    while (left := processes_under(folder)) and time.monotonic() < deadline:
        time.sleep(0.25)
    return left


@pytest.fixture
def lesson(workdir):
    """A copy of lesson 09's scripts in the work folder (the job runs there)."""
    shutil.copytree(ROOT / "notebooks" / "scripts" / "09_project", workdir / "scripts" / "09_project")
    shutil.copy(ROOT / "notebooks" / "scripts" / "09_job.sbatch", workdir / "scripts")
    return workdir


def test_the_cluster_has_two_nodes(slurm_cluster):
    assert len(slurm_cluster.nodes) >= 2, slurm_cluster


def test_the_lessons_job_runs_one_torchrun_per_node(slurm_cluster, lesson):
    run = labkit.sbatch("scripts/09_job.sbatch", nodes=2, args=TINY + ["--epochs", "1"],
                        timeout_s=300)
    out = run.output()
    assert run.status == "ok" and run.info["slurm"]["state"] == "COMPLETED"
    # srun started one task per node, and \$SLURM_PROCID was each task's own.
    tasks = sorted(line for line in out.splitlines() if line.startswith("task "))
    assert len(tasks) == 2 and tasks[0].startswith("task 0 on node ") and tasks[1].startswith("task 1 ")
    assert tasks[0].split()[-1] != tasks[1].split()[-1], tasks  # two different nodes
    df = run.metrics()
    assert run.info["world_size"] == 2 and sorted(df["rank"].unique()) == [0, 1]
    where = df[df["step"] == 0].dropna(subset=["group_rank"]).set_index("rank")
    assert sorted(where["group_rank"]) == [0, 1]  # each rank on its own node
    assert (where["local_rank"] == 0).all() and (where["local_world_size"] == 1).all()
    losses = df.dropna(subset=["loss"]).pivot(index="step", columns="rank", values="loss")
    assert len(losses) == 4 and (losses[0] == losses[1]).all()  # all-reduced: the same everywhere
    assert not nothing_left(lesson)


def test_usr1_requeues_the_job_and_it_resumes_from_its_checkpoint(slurm_cluster, lesson):
    """What --signal=B:USR1@120 does near the time limit, sent at once with scancel: the trap
    requeues the job, Slurm ends it with SIGTERM, every rank stops after one step and saves it
    (the only checkpoint: --ckpt-every is far away), and the requeued job resumes from it."""
    # Enough epochs that the job cannot end before the signal lands (3 epochs, 24 steps, once
    # took under a second here, and the job had finished when USR1 came).
    args = TINY + ["--epochs", str(REQUEUE_EPOCHS), "--ckpt-every", "1000", "--out-dir", "out/requeue"]
    result = {}
    worker = threading.Thread(target=lambda: result.update(run=labkit.sbatch(
        "scripts/09_job.sbatch", nodes=2, args=args, timeout_s=400, quiet=True)))
    worker.start()
    deadline = time.monotonic() + 300
    job = None
    while time.monotonic() < deadline and job is None:
        for meta in lesson.glob("runs/*/metrics/rank0.jsonl"):
            if '"step":8,' in meta.read_text():
                job = labkit.Run.load(meta.parent.parent).info["slurm"]["job_id"]
        time.sleep(0.2)
    assert job is not None, "the job never reached step 8"
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True)
    # A requeued job waits for its BeginTime (about two minutes here): let it start at once.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and _slurm.job_state(job)[0] != "PENDING":
        time.sleep(0.2)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True)
    worker.join(400)
    run = result["run"]
    out = run.output()
    assert run.status == "ok", out
    assert f"time limit near: requeue job {job}" in out
    stopped = [int(line.split("stopped at step ")[1].split()[0]) for line in out.splitlines()
               if "as asked; checkpoint saved" in line]
    assert len(stopped) == 1 and stopped[0] >= 8, out  # SIGTERM: every rank stopped after one step
    assert f"resumed from step {stopped[0]} (epoch" in out  # ... and the requeued job went on from it
    steps = run.metrics().dropna(subset=["loss"])
    steps = steps[steps["rank"] == 0]["step"].tolist()
    # Every step up to the checkpoint once, then on to the end; nothing done twice: the
    # checkpoint was the very step the ranks stopped after.
    assert steps == list(range(2, REQUEUE_EPOCHS * (256 // (16 * 2)) + 1, 2)), steps
    assert not nothing_left(lesson)


SIGNALLED = """
    #!/bin/bash
    #SBATCH --time=00:01:00
    #SBATCH --signal={signal}USR1@58
    trap 'echo "the batch shell got USR1"; exit 0' USR1
    srun bash -c 'trap "echo a step got USR1; exit 0" USR1; for i in $(seq 1200); do sleep 0.05; done' &
    wait
    echo "the batch shell saw its step end"
"""


def test_b_sends_the_signal_to_the_batch_shell_and_without_it_only_steps_get_it(slurm_cluster, write_script):
    """Lesson 09's claim about ``--signal=B:USR1@...``: with ``B:`` the batch shell's trap runs
    (and the steps get nothing); without it the steps are signalled and the trap never runs."""
    write_script("with_b.sbatch", SIGNALLED.format(signal="B:"))
    write_script("without_b.sbatch", SIGNALLED.format(signal=""))
    result = {}
    jobs = [threading.Thread(target=lambda name=name: result.update({name: labkit.sbatch(
        f"{name}.sbatch", nodes=1, timeout_s=150, quiet=True)})) for name in ("with_b", "without_b")]
    for job in jobs:
        job.start()
    for job in jobs:
        job.join(200)
    with_b, without_b = result["with_b"].output(), result["without_b"].output()
    assert "the batch shell got USR1" in with_b and "a step got USR1" not in with_b, with_b
    assert "a step got USR1" in without_b and "the batch shell got USR1" not in without_b, without_b
    assert "the batch shell saw its step end" in without_b


def test_a_failing_job_is_a_launch_error(slurm_cluster, write_script):
    write_script("fail.sbatch", """
        #!/bin/bash
        echo "about to fail"
        exit 3
    """)
    with pytest.raises(LaunchError, match=r"Slurm job \d+ ended FAILED \(exit code 3:0\)"):
        labkit.sbatch("fail.sbatch", nodes=1, timeout_s=120, quiet=True)


def test_a_timeout_cancels_the_job_and_leaves_nothing(slurm_cluster, write_script, workdir):
    write_script("sleep.sbatch", """
        #!/bin/bash
        srun sleep 300
    """)
    with pytest.raises(LaunchTimeout, match=r"passed its timeout of 5 s and was cancelled \(CANCELLED"):
        labkit.sbatch("sleep.sbatch", nodes=2, timeout_s=5, quiet=True)
    assert not nothing_left(workdir)


def test_an_interrupt_cancels_the_job(slurm_cluster, write_script, workdir):
    write_script("sleep.sbatch", """
        #!/bin/bash
        srun sleep 300
    """)
    submitter = python("""
        import signal
        signal.signal(signal.SIGINT, signal.default_int_handler)
        import labkit
        labkit.sbatch("sleep.sbatch", nodes=2, timeout_s=300)
    """, cwd=workdir, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        sleeping = lambda: [args for _, args in processes_under(workdir) if "sleep 300" in args]  # noqa: E731
        while time.monotonic() < deadline and not sleeping():
            time.sleep(0.2)
        assert sleeping(), "the job never started"
        submitter.send_signal(signal.SIGINT)
        out = submitter.communicate(timeout=60)[0]
        assert submitter.returncode != 0 and "submitted job" in out
    finally:
        submitter.kill()
        submitter.wait()
    assert not nothing_left(workdir)


@pytest.mark.notebook
def test_lesson_09_submits_its_job(slurm_cluster, tmp_path):
    """With a cluster up, the lesson's Slurm cells run instead of saying why they skip."""
    from conftest import copy_folder

    copy = copy_folder("notebooks", tmp_path)
    cells = execute(copy / "09_multinode.ipynb", timeout=600)
    text = "".join("".join(o.get("text", "")) for c in cells if c["cell_type"] == "code"
                   for o in c.get("outputs", []) if o.get("output_type") == "stream")
    assert "submitted job" in text and "skipped: Slurm" not in text
    assert not nothing_left(copy)
