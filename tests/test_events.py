"""launch(events=[...], hang_timeout_s=...): what labkit does to a run while it runs (lesson 10).

At the door: events are checked before anything starts. Progress: how far a run has got,
read from its folder. Real launches: a hang is stopped after seconds of silence with every
rank's stack, py-spy reads the hung ranks from outside, and nothing is left running.
"""

from __future__ import annotations

import json
import time

import pytest

import labkit
from labkit import LaunchTimeout, _rundir
from labkit._launch import events as _events
from test_nodes import nothing_left

HANG = """
    import datetime, os, torch, torch.distributed as dist
    from labkit import metrics
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(os.environ.get("PG_S", "600"))))
    rank = dist.get_rank()
    try:
        for step in range(3):
            if rank == 1 and step == 1:
                continue  # rank 1 skips one all_reduce
            t = torch.ones(2)
            dist.all_reduce(t)
            metrics.log(step, reduced=t[0].item())
            print(f"step {step}", flush=True)
        dist.barrier()
    except RuntimeError:
        if int(os.environ.get("TORCH_FR_BUFFER_SIZE", "0")) > 0:
            import time
            from torch._C._distributed_c10d import _dump_fr_trace
            prefix = os.environ["TORCH_FR_DUMP_TEMP_FILE"]
            with open(f"{prefix}{rank}.tmp", "wb") as f:  # whole, or not there at all
                f.write(_dump_fr_trace())
            os.replace(f"{prefix}{rank}.tmp", f"{prefix}{rank}")
            # torchrun stops every rank once one has failed: wait for the others' dumps first
            deadline = time.monotonic() + 20
            dumps = [f"{prefix}{r}" for r in range(dist.get_world_size())]
            while not all(map(os.path.exists, dumps)) and time.monotonic() < deadline:
                time.sleep(0.005)  # both raise within a few ms: each rank's error is recorded
        raise
"""


# -- at the door ------------------------------------------------------------------------------
def test_events_are_checked_before_anything_runs(workdir, write_script):
    write_script("ok.py", "print('hi')\n")
    cases = [
        ("not a list", TypeError, "events must be a list of labkit events"),
        ([object()], TypeError, "events must hold labkit events"),
        ([labkit.py_spy_dump(after_quiet_s=5)], ValueError,
         r"py_spy_dump\(after_quiet_s=5\) would come after the run is stopped \(hang_timeout_s/timeout_s "
         r"4 s\). HINT: a smaller after_quiet_s"),
    ]
    for events, error, match in cases:
        with pytest.raises(error, match=match):
            labkit.launch("ok.py", nproc=1, events=events, hang_timeout_s=4)
    spy = labkit.py_spy_dump(after_quiet_s=1)
    with pytest.raises(ValueError, match="the same event object is listed twice"):
        labkit.launch("ok.py", nproc=1, events=[spy, spy], hang_timeout_s=4)
    assert not (workdir / "runs").exists()


@pytest.mark.parametrize("hang_timeout, match", [
    (0, "hang_timeout_s must be a positive number of seconds or None, got 0"),
    (float("inf"), "HINT: hang_timeout_s=None means no limit"),
    ("5", "hang_timeout_s must be a positive number"),
])
def test_a_bad_hang_timeout_is_refused(workdir, write_script, hang_timeout, match):
    write_script("ok.py", "print('hi')\n")
    with pytest.raises(ValueError, match=match):
        labkit.launch("ok.py", nproc=1, hang_timeout_s=hang_timeout)


def test_an_event_that_fired_cannot_be_used_again(workdir, write_script):
    write_script("ok.py", "print('hi')\n")
    spy = labkit.py_spy_dump(after_quiet_s=1)
    spy.fired = True
    with pytest.raises(ValueError, match="has already fired in an earlier launch. HINT: make a new one"):
        labkit.launch("ok.py", nproc=1, events=[spy])


@pytest.mark.parametrize("after", [0, -1, "2", True])
def test_py_spy_dump_wants_a_positive_number_of_seconds(after):
    with pytest.raises(ValueError, match="after_quiet_s must be a positive number of seconds"):
        labkit.py_spy_dump(after_quiet_s=after)


# -- progress ---------------------------------------------------------------------------------
def _line(path, **record):
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def test_progress_reads_steps_world_size_and_silence(tmp_path, monkeypatch):
    run_dir = _rundir.create(tmp_path, "p")
    progress = _events.Progress(run_dir)
    assert progress.update(force=True).step is None and progress.quiet_s is None  # not started
    m0, m1 = _rundir.metrics_file(run_dir, 0), _rundir.metrics_file(run_dir, 1)
    for step in (1, 2, 3):
        _line(m0, rank=0, step=step, world_size=2, time=100.0 + step)
    _line(m1, rank=1, step=7, world_size=2, time=103.5)
    _line(m1, rank=1, step=9, world_size=2)  # a torn line would be skipped; this one has no time
    progress.update(force=True)
    assert progress.step == 9 and progress.world_size == 2 and progress.world_steps == 3
    _line(m0, rank=0, step=3, world_size=1, time=110.0, resumed_from=3)  # a smaller world
    _line(m0, rank=0, step=4, world_size=1, time=111.0)
    progress.update(force=True)
    assert progress.world_size == 1 and progress.world_steps == 2  # counted since the change
    assert progress.quiet_s < 1.0
    monkeypatch.setattr(_events.time, "monotonic", lambda real=time.monotonic: real() + 30)
    assert progress.quiet_s > 29  # nothing new since: 30 s of silence


def test_rank_output_counts_as_speaking(tmp_path):
    run_dir = _rundir.create(tmp_path, "p")
    log = _rundir.torchrun_dir(run_dir) / "abc" / "attempt_0" / "0" / "stdout.log"
    log.parent.mkdir(parents=True)
    progress = _events.Progress(run_dir)
    log.write_text("hello\n")
    assert progress.update(force=True).quiet_s is not None and progress.step is None


# -- real launches ----------------------------------------------------------------------------
@pytest.mark.launch
def test_a_hang_is_stopped_after_seconds_of_silence_with_every_ranks_stack(workdir, write_script, ranks):
    """The collective timeout is 10 minutes; hang_timeout_s stops the run after 3 s of silence,
    however long the start-up took, names where each rank waits, and leaves nothing behind.
    py-spy, an event of the same launch, reads the same lines from outside. Rank 1 skips an
    all_reduce; every other rank does what rank 0 does."""
    write_script("hang.py", HANG)
    spy = labkit.py_spy_dump(after_quiet_s=1.5)
    start = time.monotonic()
    with pytest.raises(LaunchTimeout) as caught:
        labkit.launch("hang.py", nproc=ranks, device="cpu", hang_timeout_s=3, timeout_s=300, events=[spy])
    err = caught.value
    assert time.monotonic() - start < 120
    assert "no rank printed or logged anything for 3 s (hang_timeout_s), so it was stopped as hung" in str(err)
    assert "inside barrier" in err.stacks[1]
    assert all("inside all_reduce" in err.stacks[rank] for rank in range(ranks) if rank != 1)
    # rank 0 (and every rank but 1) waits in step 2, rank 1 ran ahead
    assert err.last_steps == {rank: 2 if rank == 1 else 1 for rank in range(ranks)}
    assert "the ranks wait in different places" in err.hint
    assert err.run.info["hung"] is True
    fired = err.run.info["events"]
    assert [e["event"] for e in fired] == ["PySpyDump"] and fired[0]["step"] == 2
    if spy.skipped:
        pytest.skip(f"py-spy could not read the ranks here (the hang itself was found): {spy.skipped}")
    assert spy.stacks == err.stacks, (spy.stacks, err.stacks)
    assert set(spy.dumps) == set(range(ranks)) and all("MainThread" in d for d in spy.dumps.values())
    assert all(seconds < 20 for seconds in spy.seconds.values())
    assert nothing_left(err.run.run_dir)


@pytest.mark.launch
def test_a_flight_record_is_dumped_into_the_run_folder_and_read_back(workdir, write_script):
    write_script("hang.py", HANG)
    with pytest.raises(labkit.LaunchError) as caught:
        labkit.launch("hang.py", nproc=2, device="cpu", timeout_s=300,
                      env={"PG_S": "3", "TORCH_FR_BUFFER_SIZE": "16"})
    err = caught.value
    assert sorted(_rundir.flight_files(err.run.run_dir)) == [0, 1]
    fr = labkit.flight_records(err.run)
    calls = fr.pivot(index="seq", columns="rank", values="op")
    assert list(calls[0]) == ["all_reduce"] * 3 and list(calls[1]) == ["all_reduce", "all_reduce", "barrier"]
    assert fr[(fr["rank"] == 1) & (fr["seq"] == 3)]["where"].iloc[0].startswith("hang.py:")
    assert "the ranks waited in different places" in err.hint
    assert nothing_left(err.run.run_dir)
