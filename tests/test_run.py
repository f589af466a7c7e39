"""labkit.Run: reading a run folder (metrics, throughput, output)."""

from __future__ import annotations

import json

import pytest

from labkit import LabkitError, NoMetricsError, Run


def make_run(tmp_path, lines_by_rank, **info):
    run_dir = tmp_path / "runs" / "r"
    (run_dir / "metrics").mkdir(parents=True)
    for rank, lines in lines_by_rank.items():
        text = "".join(line if isinstance(line, str) else json.dumps(line) + "\n" for line in lines)
        (run_dir / "metrics" / f"rank{rank}.jsonl").write_text(text)
    meta = {"name": "r", "command": "torchrun ...", "nproc": len(lines_by_rank), **info}
    (run_dir / "run.json").write_text(json.dumps(meta))
    return Run.load(run_dir)


def rec(rank, step, time, **values):
    return {"rank": rank, "step": step, "time": time, "restart": 0, "world_size": 2, **values}


def test_load_refuses_a_folder_that_is_not_a_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a run folder: it has no run.json"):
        Run.load(tmp_path)


def test_metrics_has_one_row_per_line_of_every_rank(tmp_path):
    run = make_run(tmp_path, {0: [rec(0, 1, 10.0, loss=2.0)], 1: [rec(1, 1, 10.1, loss=2.2)]})
    df = run.metrics()
    assert sorted(df["rank"]) == [0, 1]
    assert set(["rank", "step", "time", "restart", "world_size", "loss"]) <= set(df.columns)


def test_a_torn_last_line_is_skipped_not_fatal(tmp_path):
    lines = [rec(0, 1, 10.0, loss=2.0), rec(0, 2, 11.0, loss=1.9), '{"rank": 0, "step": 3, "ti']
    run = make_run(tmp_path, {0: lines})
    df = run.metrics()
    assert list(df["step"]) == [1, 2]
    assert df.attrs["skipped_lines"] == 1


def test_a_garbled_middle_line_is_skipped(tmp_path):
    lines = [rec(0, 1, 10.0, loss=2.0), "not json\n", rec(0, 2, 11.0, loss=1.9)]
    df = make_run(tmp_path, {0: lines}).metrics()
    assert list(df["step"]) == [1, 2] and df.attrs["skipped_lines"] == 1


def test_a_run_without_metrics_says_so(tmp_path):
    run = make_run(tmp_path, {})
    with pytest.raises(NoMetricsError, match=r"logged no metrics.*HINT: call `metrics.log"):
        run.metrics()


def test_throughput_drops_warmup_and_sums_rank_medians(tmp_path):
    # rank 0: three slow windows (20 samples/s) while it warms up, then two at 100/s.
    times, t = [0.0], 0.0
    for dt in (5, 5, 5, 1, 1):
        t += dt
        times.append(t)
    r0 = [rec(0, i, time, samples=100) for i, time in enumerate(times)]
    # rank 1: steady at 50 samples/s.
    r1 = [rec(1, i, 2.0 * i, samples=100) for i in range(6)]
    run = make_run(tmp_path, {0: r0, 1: r1})
    assert run.throughput(warmup_windows=0) == pytest.approx(20 + 50)   # median of 20,20,20,100,100
    assert run.throughput(warmup_windows=1) == pytest.approx(60 + 50)   # median of 20,20,100,100
    assert run.throughput(warmup_windows=3) == pytest.approx(100 + 50)  # steady state only


def test_throughput_ignores_lines_without_samples(tmp_path):
    lines = [rec(0, 0, 0.0, samples=10), rec(0, 1, 1.0, samples=10), rec(0, 2, 2.0, samples=10),
             rec(0, 2, 2.5, test_acc=0.5), rec(0, 3, 3.5, samples=10), rec(0, 4, 4.5, samples=10)]
    assert make_run(tmp_path, {0: lines}).throughput() == pytest.approx(10.0)


def test_throughput_needs_samples_and_enough_windows(tmp_path):
    run = make_run(tmp_path, {0: [rec(0, 0, 0.0, loss=1.0)]})
    with pytest.raises(NoMetricsError, match="logged no 'samples'"):
        run.throughput()
    run = make_run(tmp_path / "b", {0: [rec(0, 0, 0.0, samples=1), rec(0, 1, 1.0, samples=1)]})
    with pytest.raises(LabkitError, match="no steady-state window left"):
        run.throughput()


def test_windows_mark_warmup_per_rank(tmp_path):
    r0 = [rec(0, i, float(i), samples=10) for i in range(4)]
    r1 = [rec(1, i, 2.0 * i, samples=10) for i in range(4)]
    w = make_run(tmp_path, {0: r0, 1: r1}).windows(warmup_windows=1)
    assert w.groupby("rank")["warmup"].sum().tolist() == [1, 1]
    assert w[w["rank"] == 1]["samples_per_s"].tolist() == [5.0, 5.0, 5.0]
    with pytest.raises(ValueError, match="warmup_windows must be an int >= 0"):
        make_run(tmp_path / "b", {0: r0}).windows(warmup_windows=-1)


def test_output_joins_every_attempt_of_a_rank(tmp_path):
    run = make_run(tmp_path, {0: [rec(0, 1, 1.0)]})
    for attempt, text in ((0, "first try\n"), (1, "second try\n")):
        folder = run.run_dir / "torchrun" / "id_abc" / f"attempt_{attempt}" / "0"
        folder.mkdir(parents=True)
        (folder / "stdout.log").write_text(text)
    assert run.output(0) == "first try\nsecond try\n"
    assert run.output(1) == ""


@pytest.mark.parametrize("value, smoke", [("1", True), ("yes", True), ("0", False), ("", False)])
def test_is_smoke_reads_the_environment(monkeypatch, value, smoke):
    import labkit
    monkeypatch.setenv("LABKIT_SMOKE", value)
    assert labkit.is_smoke() is smoke


def test_export_copies_what_charts_need_and_never_overwrites(tmp_path):
    run = make_run(tmp_path, {0: [rec(0, 1, 1.0, loss=2.0, samples=4), rec(0, 2, 2.0, loss=1.5, samples=4)],
                              1: [rec(1, 1, 1.0, loss=2.2, samples=4), rec(1, 2, 2.0, loss=1.4, samples=4)]})
    (run.run_dir / "torchrun").mkdir()
    (run.run_dir / "torchrun" / "big.log").write_text("x" * 10_000)
    (run.run_dir / "data.json").write_text('{"source": "CIFAR-10", "description": "data: CIFAR-10"}')
    shipped = run.export(tmp_path / "reference" / "02-ddp")
    assert shipped.metrics().equals(run.metrics())
    assert Run.load(tmp_path / "reference" / "02-ddp").name == run.name
    assert shipped.data == "CIFAR-10", "a reference run keeps saying what it trained on"
    assert sorted(p.name for p in shipped.run_dir.rglob("*") if p.is_file()) == [
        "data.json", "rank0.jsonl", "rank1.jsonl", "run.json"]
    with pytest.raises(FileExistsError, match="not empty.*nothing was overwritten"):
        run.export(tmp_path / "reference" / "02-ddp")
