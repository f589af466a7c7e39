"""labkit.bandwidth: collectives' algorithm and bus bandwidth over sizes, and the alpha-beta
model that predicts an all-reduce at another world size (lesson 07)."""

from __future__ import annotations

import math

import pandas as pd
import numpy as np
import pytest

import labkit
from labkit._diagnose.bandwidth import (Bandwidth, _tick_labels, bus_factor, default_sizes, fit_alpha_beta,
                                        format_bytes)


def test_bus_bandwidth_follows_nccl_tests():
    assert bus_factor("all_reduce", 2) == 1.0 and bus_factor("all_reduce", 4) == 1.5
    assert bus_factor("all_gather", 4) == 0.75 and bus_factor("reduce_scatter", 8) == 7 / 8
    assert bus_factor("all_reduce", 1) == 0.0  # one rank sends nothing


def test_sizes_are_said_in_binary_units():
    assert [format_bytes(n) for n in (512, 1024, 3 * 2**19, 2**30)] == ["512 B", "1 KiB", "1.5 MiB", "1 GiB"]
    assert default_sizes("cpu", smoke=True) == [2**10, 2**12, 2**14, 2**16, 2**18, 2**20]
    assert default_sizes("cuda", smoke=False)[-1] == 2**30 and default_sizes("cpu", smoke=False)[-1] == 2**26


def _ring_times(sizes, world, latency_s, busbw_GBps, op="all_reduce"):
    return [bus_factor(op, world) * (world * latency_s + s / (busbw_GBps * 1e9)) for s in sizes]


def test_the_fit_recovers_a_rings_latency_and_bus_bandwidth():
    sizes = [2**k for k in range(10, 27, 2)]
    model = fit_alpha_beta("all_reduce", 2, sizes, _ring_times(sizes, 2, 20e-6, 5.0))
    assert model.latency_s == pytest.approx(20e-6, rel=1e-6) and model.busbw_GBps == pytest.approx(5.0, rel=1e-6)
    assert model.max_error < 1e-9
    # what 4 ranks on the same links would take: twice the steps, 1.5x the bytes per link
    assert model.time_s(2**24, world_size=4) == pytest.approx(_ring_times([2**24], 4, 20e-6, 5.0)[0])
    assert model.time_s(2**24, world_size=1) == 0.0
    gather = fit_alpha_beta("all_gather", 4, sizes, _ring_times(sizes, 4, 5e-6, 2.0, "all_gather"))
    assert gather.busbw_GBps == pytest.approx(2.0) and gather.latency_s == pytest.approx(5e-6)
    assert "busbw 5 GB/s" in str(model)


def test_a_fit_never_goes_below_zero_latency():
    sizes = [2**10, 2**20]
    model = fit_alpha_beta("all_reduce", 2, sizes, [1e-9, 1e-3])  # a line would cross below 0
    assert model.latency_s == 0.0 and model.busbw_GBps > 0


def test_times_that_do_not_grow_cannot_be_fitted():
    with pytest.raises(ValueError, match=r"do not grow with the size .*HINT: measure on 2 ranks or more"):
        fit_alpha_beta("all_reduce", 2, [1024, 4096], [1e-3, 1e-4])
    with pytest.raises(ValueError, match="HINT"):
        fit_alpha_beta("all_reduce", 1, [1024, 4096], [1e-3, 2e-3])


class _Measured:
    """A stand-in for a Run: the rows rank 0 of collectives.py logs."""

    run_dir = "runs/x"

    def __init__(self, rows):
        self.rows = rows

    def metrics(self):
        return pd.DataFrame(self.rows)


def _measured(world=2):
    rows, sizes = [], [2**10, 2**14, 2**18]
    for op in ("all_reduce", "all_gather"):
        for size, seconds in zip(sizes, _ring_times(sizes, world, 30e-6, 1.0, op)):
            rows.append({"rank": 0, "step": len(rows), "op": op, "size_bytes": size, "time_s": seconds,
                         "time_min_s": seconds, "time_max_s": seconds, "iters": 5})
    rows.append({"rank": 1, "step": 0})  # other ranks log nothing of their own
    return Bandwidth(_Measured(rows), world_size=world, device="cpu", backend="gloo")


def test_the_table_has_both_bandwidths_and_the_prediction_uses_the_all_reduce():
    bw = _measured(world=4)
    table = bw.table()
    assert list(table.columns) == ["op", "size_bytes", "size", "time_us", "algbw_GBps", "busbw_GBps",
                                   "time_min_us", "time_max_us", "iters"]
    assert len(table) == 6 and list(table["size"][:3]) == ["1 KiB", "16 KiB", "256 KiB"]
    row = table.iloc[2]
    assert row["algbw_GBps"] == pytest.approx(row["size_bytes"] / (row["time_us"] * 1e-6) / 1e9)
    assert row["busbw_GBps"] == pytest.approx(1.5 * row["algbw_GBps"])
    gather = table[table["op"] == "all_gather"].iloc[0]
    assert gather["busbw_GBps"] == pytest.approx(0.75 * gather["algbw_GBps"])
    assert bw.fit().busbw_GBps == pytest.approx(1.0)
    assert bw.predict_s(2**20, world_size=8) == pytest.approx(_ring_times([2**20], 8, 30e-6, 1.0)[0])
    with pytest.raises(ValueError, match=r"unknown collective 'reduce_scatter'. HINT: .*all_gather, all_reduce"):
        bw.fit("reduce_scatter")  # not measured here
    with pytest.raises(ValueError, match=r"world_size must be an int >= 1, got 0. HINT"):
        bw.predict_s(2**20, world_size=0)
    with pytest.raises(ValueError, match=r"nbytes must be a number of bytes >= 0, got -1. HINT"):
        bw.predict_s(-1)


def test_a_fit_can_leave_sizes_out_and_use_the_fastest_call():
    rows, sizes = [], [2**10, 2**14, 2**18, 2**20]
    for size, seconds in zip(sizes, _ring_times(sizes, 3, 30e-6, 1.0)):
        measured = size // 4 // 3 * 3 * 4  # rounded down to whole float32 elements per rank
        slow = 10 * seconds if size == 2**18 else seconds  # a paused rank: only the median sees it
        rows.append({"rank": 0, "step": len(rows), "op": "all_reduce", "size_bytes": measured,
                     "time_s": slow, "time_min_s": seconds, "time_max_s": slow, "iters": 20})
    bw = Bandwidth(_Measured(rows), world_size=3, device="cpu", backend="gloo")
    assert list(bw.rows_of([2**18])["size_bytes"]) == [2**18 // 12 * 12]
    fastest = bw.fit(stat="min")
    assert fastest.busbw_GBps == pytest.approx(1.0, rel=1e-3) and fastest.max_error < 1e-3
    assert bw.fit().max_error > 0.1  # the median holds the paused rank's tick
    clean = bw.fit(leave_out=[2**18])  # the fit never sees the size that went wrong
    assert clean.busbw_GBps == pytest.approx(1.0, rel=1e-3) and clean.max_error < 1e-3
    assert clean.time_s(2**18 // 12 * 12) == pytest.approx(rows[2]["time_min_s"], rel=1e-3)
    with pytest.raises(ValueError, match=r"2.93 KiB \(3,000 bytes\) was not measured for all_reduce; measured: "
                                         r"1020 B, .* HINT: pass it in labkit.bandwidth"):
        bw.fit(leave_out=[3000])
    with pytest.raises(ValueError, match=r"stat must be 'median' or 'min', got 'mean'. HINT"):
        bw.fit(stat="mean")
    assert bw.fit().time_s(np.int64(2**20)) > 0  # numpy's integers are numbers of bytes too


def test_the_chart_has_one_line_per_collective_on_log_sizes():
    ax = _measured().plot()
    assert ax.get_xscale() == "log" and len(ax.get_lines()) == 2
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1 KiB", "16 KiB", "256 KiB"]
    assert "bus bandwidth" in ax.get_ylabel()
    with pytest.raises(ValueError, match="y must be 'busbw_GBps' or 'algbw_GBps'"):
        _measured().plot(y="time_us")


def test_a_size_asked_for_by_name_keeps_its_label_over_a_power_of_two_beside_it():
    grads = 79_820  # 77.95 KiB: a model's gradients, between 64 KiB and 128 KiB
    sizes = [2**10, 2**16, grads, 2**17, 2**18 // 12 * 12]  # the last rounded to 3 ranks' elements
    assert _tick_labels(sizes) == ["1 KiB", "", "77.95 KiB", "128 KiB", "256 KiB"]
    assert _tick_labels([2**10, 2**11, 2**12]) == ["1 KiB", "2 KiB", "4 KiB"]  # an octave apart: all


@pytest.mark.parametrize("kwargs, error, match", [
    ({"sizes": []}, ValueError, r"sizes must hold whole numbers of bytes >= 1, got \[\]. HINT"),
    ({"sizes": [1024, 0]}, ValueError, r"got \[1024, 0\]. HINT"),
    ({"sizes": "1MiB"}, TypeError, r"sizes must be a list of byte counts, got '1MiB'. HINT"),
    ({"ops": ["allreduce"]}, ValueError, r"unknown collective 'allreduce'. HINT: did you mean 'all_reduce'\?"),
    ({"ops": []}, ValueError, r"ops is empty. HINT"),
    ({"iters": 0}, ValueError, r"iters must be an int >= 1, got 0. HINT"),
    ({"warmup": -1}, ValueError, r"warmup must be an int >= 0, got -1. HINT"),
    ({"nproc": 0}, ValueError, r"nproc must be >= 1"),
    ({"device": "gpu"}, ValueError, r"device must be one of .*HINT"),
])
def test_bad_input_is_refused_before_anything_runs(workdir, kwargs, error, match):
    with pytest.raises(error, match=match):
        labkit.bandwidth(**kwargs)
    assert not (workdir / "runs").exists()


@pytest.mark.launch
def test_a_measurement_on_two_cpu_ranks(workdir, capsys):
    """A real launch: rank 0 prints nccl-tests' table, every size and op comes back, sizes are
    the whole tensor's, and the model predicts more time for a bigger world. The fit takes each
    size's fastest call and sizes up to 4 MiB, as lesson 07 does on CPU ranks: with 3 calls of
    at most 1 MiB, a median that held one paused rank once made 4 KiB slower than 1 MiB."""
    sizes = [2**12, 2**16, 2**22]
    bw = labkit.bandwidth(nproc=2, device="cpu", sizes=sizes, warmup=1, iters=5)
    out = capsys.readouterr().out
    assert "[rank0] op" in out and "busbw GB/s" in out and "all_gather" in out
    table = bw.table()
    assert (bw.world_size, bw.backend, bw.device) == (2, "gloo", "cpu")
    assert table.groupby("op")["size_bytes"].apply(list).to_dict() == {
        op: sizes for op in ("all_reduce", "all_gather", "reduce_scatter")}
    assert (table["time_min_us"] <= table["time_us"]).all() and (table["time_us"] <= table["time_max_us"]).all()
    assert (table["iters"] == 5).all() and (table["busbw_GBps"] > 0).all()
    model = bw.fit(stat="min")
    assert model.world_size == 2 and model.busbw_GBps > 0 and math.isfinite(model.max_error)
    assert model.time_s(2**24, world_size=4) > model.time_s(2**24) > model.time_s(2**20) > 0
