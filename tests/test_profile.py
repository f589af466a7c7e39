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


def _gpu_trace(folder, correlation=True):
    """One GPU DDP step (ProfilerStep#6), one bucket. The main thread (tid 1) runs forward,
    backward and optimizer; autograd's thread (tid 3) the gradient computations, whose launches
    (cudaLaunchKernel, tied to their kernel by a correlation number) start kernels on stream 7.
    The last gradient's AccumulateGrad launches the bucket's NCCL all-reduce. Then DDP copies the
    averaged bucket back into the gradients (launched by autograd's thread, outside any
    evaluate_function) and the optimizer's kernel runs: both start after the all-reduce did."""
    meta = [{"ph": "M", "name": "thread_name", "pid": 10, "tid": 1, "args": {"name": "thread 1 (python)"}},
            {"ph": "M", "name": "thread_name", "pid": 10, "tid": 3, "args": {"name": "thread 3 (python)"}},
            {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "GPU 0"}},
            {"ph": "M", "name": "thread_name", "pid": 0, "tid": 7, "args": {"name": "stream 7"}}]

    def launched(name, at, number, start, dur, *, tid=1):
        tie = {"correlation": number} if correlation else {}
        return [_event("cudaLaunchKernel", at, 20, tid=tid, cat="cuda_runtime", **tie),
                {**_event(name, start, dur, tid=7, cat="kernel", **tie), "pid": 0}]

    events = [
        _event("ProfilerStep#6", 0, 12_000, cat="user_annotation"),
        _event("forward", 600, 2000, cat="user_annotation"),
        *launched("forward_conv_kernel", 700, 1, 800, 1000),
        _event("backward", 2700, 6000, cat="user_annotation"),
        _event("autograd::engine::evaluate_function: ConvolutionBackward0", 2800, 1000, tid=3),
        *launched("conv_backward_kernel", 2900, 2, 3000, 2000, tid=3),
        _event("autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", 3900, 600, tid=3),
        *launched("elementwise_kernel (into the bucket)", 4000, 3, 5000, 200, tid=3),
        *launched("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 4300, 4, 5200, 1800, tid=3),
        *launched("elementwise_kernel (back into the gradients)", 4700, 5, 7000, 300, tid=3),
        _event("optimizer", 8800, 500, cat="user_annotation"),
        *launched("multi_tensor_apply_kernel (SGD)", 8900, 6, 9000, 400),
    ]
    path = folder / "trace_rank0.json"
    path.write_text(json.dumps({"traceEvents": meta + events}))
    return path


def test_on_gpus_a_gradient_computation_is_a_kernel_that_autograd_launched(tmp_path):
    """Not the optimizer's kernel, nor DDP's copy back into the gradients, though both run on the
    GPU after the all-reduce began: with one bucket, no gradient computation starts after it."""
    trace = labkit.read_trace(_gpu_trace(tmp_path))
    phases, compute, comm = labkit.step_events(trace, 6)
    assert list(compute["name"]) == ["conv_backward_kernel", "elementwise_kernel (into the bucket)"]
    assert set(compute["label"]) == {"gradient computation"} and list(comm["label"]) == ["all-reduce kernel"]
    assert list(comm["name"]) == ["ncclDevKernel_AllReduce_Sum_f32_RING_LL"]
    backward_end = phases.loc[phases["name"] == "backward", "end_ms"].max()
    sgd = trace[trace["name"].str.startswith("multi_tensor_apply")]
    assert (sgd["start_ms"] > backward_end).all() and not sgd.index.isin(compute.index).any()
    later = int((compute["start_ms"] > comm["start_ms"].min()).sum())   # lesson 07's check
    assert later == 0
    every_kernel = trace[(trace["cat"] == "kernel") & ~trace["name"].str.startswith("nccl")]
    assert int((every_kernel["start_ms"] > comm["start_ms"].min()).sum()) == 2   # what it counted before


def test_on_gpus_without_launches_the_backward_range_decides(tmp_path):
    """A trace whose kernels cannot be tied to their launches: the kernels that start inside the
    backward range count (so the optimizer's, after it, does not)."""
    trace = labkit.read_trace(_gpu_trace(tmp_path, correlation=False))
    assert trace["correlation"].isna().all()
    _, compute, _ = labkit.step_events(trace, 6)
    assert list(compute["name"]) == ["conv_backward_kernel", "elementwise_kernel (into the bucket)",
                                     "elementwise_kernel (back into the gradients)"]


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
