"""Lesson 09's project under the signal a scheduler sends: SIGTERM, an agreed stop, a resume.

Real 2-rank launches of ``notebooks/scripts/09_project/train.py`` (the committed copy, run in a
work folder):

- SIGTERM to every rank from outside, as Slurm sends it before it ends a job (a requeue, the
  time limit, ``scancel``): every rank stops after the same step, rank 0 saves that step, and
  the run ends cleanly (exit code 0), wherever the signal lands.
- A stop in the middle of an epoch (one rank signals itself, so the step is known), then a
  resume: it skips the batches of the epoch already trained and trains exactly like a run
  that was never stopped. The same resume without the skip trains on other batches, and the
  comparison says so: the check can fail.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time

import pandas as pd
import pytest

import labkit
from labkit import checkpoint
from conftest import ROOT

ARGS = ["--synthetic", "--train-size", "1024", "--batch-size", "16", "--width", "8", "--workers", "0",
        "--accum-steps", "2", "--log-every", "1", "--ckpt-every", "1000"]
PER_EPOCH = 1024 // (2 * 16 * 2)   # optimizer steps an epoch on 2 ranks: 16


@pytest.fixture
def project(workdir):
    """A copy of lesson 09's project in the work folder."""
    shutil.copytree(ROOT / "notebooks" / "scripts" / "09_project", workdir / "09_project")
    return workdir / "09_project" / "train.py"


def _losses(*runs) -> pd.Series:
    """Rank 0's logged loss by step over ``runs`` (a stopped run and its resume, in order)."""
    df = pd.concat([run.metrics() for run in runs], ignore_index=True).dropna(subset=["loss"])
    return df[df["rank"] == 0].set_index("step")["loss"]


def _stopped_at(run) -> int:
    """The step every rank stopped after (asserting that they agree)."""
    last = run.metrics().dropna(subset=["loss"]).groupby("rank")["step"].max()
    assert last.nunique() == 1, f"the ranks stopped after different steps: {last.to_dict()}"
    return int(last.iloc[0])


def _pids_past_step(workdir, step: int) -> dict:
    """{rank: pid} of the ranks that have logged ``step``, read from the metrics files as they
    are written (a line may be half written, a file still empty: those count as not yet)."""
    pids = {}
    for path in workdir.glob("runs/*/metrics/rank*.jsonl"):
        records = []
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
        pid = next((r["pid"] for r in records if r.get("step") == 0 and "pid" in r), None)
        if pid is not None and max(r.get("step", -1) for r in records) >= step:
            pids[records[0]["rank"]] = int(pid)
    return pids


@pytest.mark.launch
def test_sigterm_to_every_rank_stops_all_after_one_step_and_saves_it(project, workdir):
    result = {}
    worker = threading.Thread(target=lambda: result.update(run=labkit.launch(
        str(project), nproc=2, device="cpu", quiet=True, timeout_s=300,
        args=ARGS + ["--epochs", "40", "--out-dir", "out"])))
    worker.start()
    pids, deadline = {}, time.monotonic() + 200
    while len(pids) < 2 and time.monotonic() < deadline and worker.is_alive():
        pids = _pids_past_step(workdir, 3)
        time.sleep(0.1)
    assert len(pids) == 2, "the ranks never got to step 3"
    for pid in pids.values():  # what Slurm does: every process of the job, at once
        os.kill(pid, signal.SIGTERM)
    worker.join(300)
    run = result["run"]
    stop = _stopped_at(run)
    assert run.status == "ok" and run.returncode == 0, run.output(0)[-2000:]
    assert stop < 40 * PER_EPOCH, "the signal did not stop the run"
    assert f"stopped at step {stop} as asked; checkpoint saved" in run.output(0)
    assert checkpoint.latest(workdir / "out" / "checkpoints") == checkpoint.step_path(
        workdir / "out" / "checkpoints", stop)


@pytest.mark.launch
def test_a_stop_mid_epoch_resumes_exactly_and_a_resume_without_the_skip_does_not(project, workdir):
    stop_at = PER_EPOCH + 5  # in the second epoch; with --log-every 1 the ranks stop right there
    drill = project.with_name("drill.py")
    labkit.write_variant(project, drill, {
        "import os\n": "import os\nimport signal\n",
        "            step += 1\n": "            step += 1\n"
        f"            if step == {stop_at} and rt.rank == 1:\n"
        "                os.kill(os.getpid(), signal.SIGTERM)\n"})
    no_skip = project.with_name("no_skip.py")
    labkit.write_variant(project, no_skip, {"            next(batches)  # resumed mid-epoch": "            pass  # "})
    epochs = ["--epochs", "3"]
    whole = labkit.launch(str(project), nproc=2, device="cpu", quiet=True, args=ARGS + epochs + ["--out-dir", "whole"])
    stopped = labkit.launch(str(drill), nproc=2, device="cpu", quiet=True, args=ARGS + epochs + ["--out-dir", "a"])
    assert _stopped_at(stopped) == stop_at and stopped.returncode == 0
    shutil.copytree(workdir / "a", workdir / "b")
    resumed = labkit.launch(str(project), nproc=2, device="cpu", quiet=True, args=ARGS + epochs + ["--out-dir", "a"])
    assert f"resumed from step {stop_at} (epoch 1)" in resumed.output(0)
    assert stop_at % PER_EPOCH, "the stop must fall inside an epoch"
    pd.testing.assert_series_equal(_losses(stopped, resumed), _losses(whole))  # to the last bit
    unskipped = labkit.launch(str(no_skip), nproc=2, device="cpu", quiet=True, args=ARGS + epochs + ["--out-dir", "b"])
    broken = _losses(stopped, unskipped)
    assert broken.index.equals(_losses(whole).index)  # the same steps, other batches ...
    assert (broken - _losses(whole)).abs().max() > 1e-3  # ... so other losses: the check can fail


@pytest.mark.launch
def test_a_script_that_handles_sigterm_itself_is_not_ended_by_labkit(workdir, write_script):
    """labkit's rank entry ends a rank on SIGTERM (after flushing its metrics) unless the script
    set a handler of its own: then the script decides, as the project's StopRequest does."""
    write_script("own_handler.py", """
        import os, signal, time
        from labkit import metrics
        noted = []
        signal.signal(signal.SIGTERM, lambda signum, frame: noted.append(signum))
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)  # the watcher thread would end the rank here
        metrics.log(1, noted=len(noted))
    """)
    run = labkit.launch("own_handler.py", nproc=2, device="cpu", quiet=True, timeout_s=120)
    assert run.returncode == 0 and list(run.metrics()["noted"]) == [1, 1]
