"""labkit._diagnose.profile: one DDP step taken apart from a trace, its all-reduced bytes, PowerSGD's rule,
on small traces written here (shaped like kineto's, as in test_trace.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

import labkit
from labkit.models import SmallResNet


def _event(name, ts, dur, *, tid=1, cat="cpu_op", **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 10, "tid": tid, "ts": ts, "dur": dur, "args": args}


def _trace(folder, name="trace_rank0.json", dtype="float", numel=1000):
    """One CPU DDP step (ProfilerStep#6): data, forward, backward with two gradient computations,
    one all-reduce on gloo's thread overlapping the second, optimizer; and step 7's all-reduce."""
    meta = [{"ph": "M", "name": "thread_name", "pid": 10, "tid": 1, "args": {"name": "thread 1 (python)"}},
            {"ph": "M", "name": "thread_name", "pid": 10, "tid": 2, "args": {"name": "thread 2 (pt_gloo_runloop)"}}]
    events = [
        _event("ProfilerStep#6", 0, 10_000, cat="user_annotation"),
        _event("enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__", 100, 400, cat="user_annotation"),
        _event("forward", 600, 2000, cat="user_annotation"),
        _event("backward", 2700, 5000, cat="user_annotation"),
        _event("autograd::engine::evaluate_function: ConvolutionBackward0", 2800, 1000),
        _event("autograd::engine::evaluate_function: AddmmBackward0", 4000, 1500),
        _event("gloo:all_reduce", 3900, 2500, tid=2, cat="user_annotation",
               **{"Input Dims": [[numel]], "Input type": [dtype]}),
        _event("optimizer", 7800, 500, cat="user_annotation"),
        _event("ProfilerStep#7", 10_000, 5000, cat="user_annotation"),
        _event("gloo:all_reduce", 11_000, 1000, tid=2, cat="user_annotation",
               **{"Input Dims": [[numel]], "Input type": [dtype]}),
    ]
    path = folder / name
    path.write_text(json.dumps({"traceEvents": meta + events}))
    return path


def test_a_step_is_taken_apart_into_phases_computations_and_all_reduces(tmp_path):
    trace = labkit.read_trace(_trace(tmp_path))
    phases, compute, comm = labkit.step_events(trace, 6)
    assert dict(zip(phases["name"].str[:9], phases["label"])) == {
        "enumerate": "data", "forward": "forward", "backward": "backward", "optimizer": "optimizer"}
    assert len(compute) == 2 and set(compute["lane"]) == {"backward (main thread)"}
    assert list(comm["lane"]) == ["gloo thread 2"] and list(comm["label"]) == ["all-reduce of a bucket"]
    assert labkit.overlap_ms(comm, compute) == pytest.approx(1.5)   # 4.0-5.5 ms, both at once
    with pytest.raises(ValueError, match=r"no event of step 9; its profiled steps: \[6, 7\]"):
        labkit.step_events(trace, 9)


def test_the_bytes_of_each_steps_all_reduces_are_counted_from_the_trace(tmp_path):
    _trace(tmp_path, dtype="c10::BFloat16")
    sent, types = labkit.allreduce_bytes(SimpleNamespace(run_dir=tmp_path))
    assert sent.to_dict() == {6: 2000.0, 7: 2000.0} and types == {("c10::BFloat16",)}
    with pytest.raises(FileNotFoundError, match="no trace at"):
        labkit.allreduce_bytes(tmp_path, rank=1)


def test_powersgd_compresses_the_matrices_where_it_pays():
    conv = torch.nn.Conv2d(64, 64, 3)            # 64 x 576: (64 + 576) * 4 * 2 < 64 * 576: compressed
    small = torch.nn.Linear(8, 10)               # 10 x 8: (10 + 8) * 4 * 2 > 80: sent as it is
    model = torch.nn.Sequential(conv, small)
    assert labkit.powersgd_numbers(model, rank=4) == (64 + 576) * 4 + 64 + 80 + 10
    assert labkit.powersgd_numbers(model, rank=1000) == sum(p.numel() for p in model.parameters())
    assert labkit.powersgd_numbers(SmallResNet(width=8, norm="group")) < sum(
        p.numel() for p in SmallResNet(width=8, norm="group").parameters()) / 3
    with pytest.raises(ValueError, match="rank must be a whole number >= 1"):
        labkit.powersgd_numbers(model, rank=0)
