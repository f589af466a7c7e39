"""labkit.sweep and its table and chart, on a tiny real script."""

from __future__ import annotations

import matplotlib
import pytest

import labkit
from labkit import _hardware

matplotlib.use("Agg")  # tests draw off-screen; notebooks keep their inline backend

TINY = """
    import time, torch.distributed as dist
    from labkit import metrics
    dist.init_process_group("gloo")
    for step in range(8):
        time.sleep(0.02)
        metrics.log(step, loss=1.0 / (step + 1), samples=16)
    dist.destroy_process_group()
"""


@pytest.mark.launch
def test_sweep_table_speedup_and_reload(workdir, write_script, ranks):
    write_script("tiny.py", TINY)
    sweep = labkit.sweep("tiny.py", nproc=[ranks, 1], repeats=1, timeout_s=120)
    table = sweep.table()
    assert list(table["nproc"]) == [1, ranks]
    assert table["speedup"].iloc[0] == 1.0 and table["efficiency"].iloc[0] == 1.0
    # Each rank sleeps 20 ms a step: N ranks do N times the samples/s of 1 (sleeping needs no core).
    assert table["speedup"].iloc[1] == pytest.approx(ranks, rel=0.35)
    threads = max(1, _hardware.cpu_count() // ranks)
    assert sweep.threads_per_rank == threads  # cores // ranks of the largest run, held for nproc=1 too
    assert all(run.info["threads_per_rank"] == threads for run in sweep.runs)
    assert "held fixed" in sweep.caption
    again = labkit.Sweep.load(sweep.sweep_dir)
    assert again.table().equals(table)
    shipped = sweep.export(workdir / "reference" / "tiny-sweep")
    assert labkit.Sweep.load(shipped.sweep_dir).table().equals(table)
    files = [p for p in shipped.sweep_dir.rglob("*") if p.is_file()]
    assert {p.suffix for p in files} == {".json", ".jsonl"}, "a shipped sweep is small text"
    ax = labkit.plot_speedup(sweep)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "ideal (linear)" in labels and "efficiency" in labels


@pytest.mark.launch
def test_a_sweep_too_short_to_time_still_returns_its_runs(workdir, write_script, capsys):
    write_script("short.py", TINY.replace("range(8)", "range(1)"))
    sweep = labkit.sweep("short.py", nproc=[1], repeats=1, timeout_s=120)
    assert len(sweep.runs) == 1 and "no throughput" in capsys.readouterr().out
    with pytest.raises(labkit.LabkitError, match="steady"):
        sweep.table()


@pytest.mark.launch
def test_a_failed_run_hands_back_the_runs_before_it(workdir, write_script, ranks):
    write_script("flaky.py", TINY.replace('dist.init_process_group("gloo")',
                                          'dist.init_process_group("gloo")\n'
                                          '    if dist.get_world_size() > 1: raise RuntimeError("boom")'))
    with pytest.raises(labkit.LaunchError) as caught:
        labkit.sweep("flaky.py", nproc=[1, ranks], repeats=1, timeout_s=120)
    assert [run.nproc for run in caught.value.sweep.runs] == [1]


def test_load_refuses_a_folder_that_is_not_a_sweep(tmp_path):
    (tmp_path / "run.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"is not a sweep folder: it has no sweep.json. HINT: "
                                                r"pass the folder that labkit.sweep printed.*labkit.Run.load"):
        labkit.Sweep.load(tmp_path)
