"""labkit._results.speed: waits for data, step 1, a steady step, and the scaling report, on tables shaped
like what lesson 08's scripts log."""

from __future__ import annotations

from types import SimpleNamespace

import pandas as pd
import pytest

import labkit


def _run(rows, samples_per_s=1000.0):
    df = pd.DataFrame(rows)
    return SimpleNamespace(metrics=lambda: df, throughput=lambda: samples_per_s, name="run")


def test_waits_and_step_one_are_read_from_what_the_script_logged():
    run = _run([{"rank": r, "step": s, "data_wait_s": w, "samples": 64.0}
                for r in (0, 1) for s, w in ((1, 9.0), (2, 0.2), (4, 0.4), (6, 0.6))]
               + [{"rank": 0, "step": 1, "first_step_s": 1.5}, {"rank": 1, "step": 1, "first_step_s": 2.5}])
    assert labkit.data_wait_per_step(run, batch_size=32) == pytest.approx(0.2)   # step 1 left out
    assert labkit.first_step_s(run) == 2.5                                         # the slowest rank
    assert labkit.steady_step_s(run, 64) == pytest.approx(0.064)
    with pytest.raises(ValueError, match=r"logged no data_wait_s.*HINT"):
        labkit.data_wait_per_step(_run([{"rank": 0, "step": 1, "loss": 2.0, "samples": 8.0}]), 8)


def _bench():
    rows = []
    for repeat, (t0, t1) in enumerate([(0.10, 0.12), (0.11, 0.10)], start=1):
        rows += [{"rank": 0, "step": repeat, "setting": "DDP", "step_time_s": t0, "batch_size": 32.0},
                 {"rank": 1, "step": repeat, "setting": "DDP", "step_time_s": t1, "batch_size": 32.0}]
        for setting, size, time_s in (("1 thread(s), per-rank batch", 32, 0.08), ("1 thread(s), global batch", 64, 0.16),
                                      ("2 thread(s), per-rank batch", 32, 0.05), ("2 thread(s), global batch", 64, 0.10)):
            rows.append({"rank": 0, "step": repeat, "setting": setting, "step_time_s": time_s * repeat,
                         "batch_size": float(size)})
    return pd.DataFrame(rows)


def test_the_scaling_report_pairs_ddp_with_each_baseline():
    df = _bench()
    ddp = labkit.ddp_rate(df, nproc=2, batch_size=32)
    assert list(ddp) == pytest.approx([64 / 0.12, 64 / 0.11])    # the slowest rank sets the pace
    rates = labkit.one_process_rates(df)
    assert list(rates) == sorted(rates) and rates["2 thread(s), global batch"].tolist() == pytest.approx([640, 320])
    report = labkit.scaling_report(df, nproc=2, batch_size=32)
    assert list(report["scaling"]) == ["strong", "strong", "weak", "weak"]
    assert list(report["baseline"]) == ["1 process × 1 thread(s), batch 64", "1 process × 2 thread(s), batch 64",
                                        "1 process × 1 thread(s), batch 32", "1 process × 2 thread(s), batch 32"]
    row = report.iloc[1]
    assert row["speedup"] == pytest.approx(ddp.median() / 480)
    assert row["low"] == pytest.approx(ddp.min() / 640) and row["high"] == pytest.approx(ddp.max() / 320)
    # the ideal is the hardware's ratio: DDP's 2 ranks × 1 thread over 2 threads is 1×, over 1 thread 2×
    assert list(report["ideal"]) == [2, 1, 2, 1]
    assert row["efficiency"] == pytest.approx(row["speedup"] / 1)
    assert report.iloc[0]["efficiency"] == pytest.approx(report.iloc[0]["speedup"] / 2)
    # 4 ranks of 1 thread on 2 cores: at most every core, so 2× over one thread, not 4×
    four = pd.concat([df, df[df["setting"] == "DDP"].assign(rank=lambda d: d["rank"] + 2)])
    assert list(labkit.scaling_report(four, nproc=4, batch_size=32)["ideal"]) == [2, 1, 2, 1]
    # GPUs: the baselines name no threads, and the ideal is nproc GPUs over one
    gpu = df.replace({"setting": {"1 thread(s), per-rank batch": "per-rank batch",
                                  "1 thread(s), global batch": "global batch"}})
    gpu = gpu[~gpu["setting"].str.startswith("2 thread", na=False)]
    assert list(labkit.scaling_report(gpu, nproc=2, batch_size=32)["ideal"]) == [2, 2]
    assert labkit.baseline_name("global batch", nproc=4, batch_size=8) == "1 GPU, batch 32"


def test_a_bench_without_ddp_or_baselines_is_a_clear_error():
    df = _bench()
    with pytest.raises(ValueError, match=r"no step time for 'DDP-8'; its settings: \['1 thread"):
        labkit.ddp_rate(df, nproc=2, batch_size=32, setting="DDP-8")
    with pytest.raises(ValueError, match="logged no one-process setting"):
        labkit.scaling_report(df[df["setting"] == "DDP"], nproc=2, batch_size=32)
