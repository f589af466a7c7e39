"""labkit._diagnose.trace: a profiler trace read into a table, overlaps measured, a timeline drawn.

The unit tests use small Chrome traces written here, shaped like the ones kineto writes. The
launch test profiles real DDP steps on 2 gloo ranks: the bytes counted from the trace are
every gradient once in float32, half that with PyTorch's bf16 compression hook, and a hook
that does not compress fails the "halved" check that lesson 07 makes.
"""

from __future__ import annotations

import json
import math

import matplotlib
import pytest

import labkit
from labkit._diagnose import trace as _trace

matplotlib.use("Agg")


def _event(name, ts, dur, *, tid=1, pid=10, cat="cpu_op", **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": args}


def _write(tmp_path, events, **extra) -> str:
    meta = [
        {"ph": "M", "name": "thread_name", "pid": 10, "tid": 1, "args": {"name": "thread 1 (python)"}},
        {"ph": "M", "name": "thread_name", "pid": 10, "tid": 2, "args": {"name": "thread 2 (pt_gloo_runloop)"}},
        {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "GPU 0"}},
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": 7, "args": {"name": "stream 7"}},
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": meta + events, **extra}))
    return path


STEP_EVENTS = [
    _event("ProfilerStep#5", 1000, 10_000, cat="user_annotation"),
    _event("backward", 2000, 6000, cat="user_annotation"),
    _event("gloo:all_reduce", 3000, 4000, tid=2, cat="user_annotation",
           **{"Input Dims": [[1000]], "Input type": ["float"]}),
    _event("gloo:all_reduce", 5000, 1000, tid=2, cat="user_annotation",
           **{"Input Dims": [[10, 50]], "Input type": ["c10::BFloat16"]}),
    _event("ProfilerStep#6", 11_000, 5000, cat="user_annotation"),
    _event("nccl:all_reduce", 12_000, 100, **{"Input Dims": [[8]], "Input type": ["mystery"]}),
    _event("c10d::allreduce_", 12_500, 50, **{"Input Dims": [[[8]], [], []], "Input type": ["TensorList", "", ""]}),
    _event("ncclDevKernel_AllReduce", 13_000, 2000, pid=0, tid=7, cat="kernel"),
]


def test_read_trace_names_lanes_steps_collectives_and_bytes(tmp_path):
    path = _write(tmp_path, STEP_EVENTS, distributedInfo={"rank": 1, "world_size": 2, "backend": "gloo"})
    trace = labkit.read_trace(path)
    assert list(trace.columns) == _trace.COLUMNS
    assert trace["start_ms"].iloc[0] == 0 and trace["name"].iloc[0] == "ProfilerStep#5"
    assert trace.attrs["rank"] == 1 and trace.attrs["world_size"] == 2 and trace.attrs["backend"] == "gloo"
    lanes = dict(zip(trace["name"], trace["lane"]))
    assert lanes["backward"] == "main thread"          # the thread that calls prof.step()
    assert lanes["gloo:all_reduce"] == "pt_gloo_runloop 2"
    assert lanes["ncclDevKernel_AllReduce"] == "GPU 0 stream 7"
    reduces = trace[trace["collective"] == "all_reduce"]
    assert list(reduces["name"]) == ["gloo:all_reduce", "gloo:all_reduce", "nccl:all_reduce"]
    assert reduces["bytes"].iloc[0] == 4000 and reduces["bytes"].iloc[1] == 1000   # float32, bf16
    assert math.isnan(reduces["bytes"].iloc[2])       # a dtype the table does not know: no guess
    assert trace.loc[trace["name"] == "c10d::allreduce_", "collective"].isna().all()  # the launch, not the collective
    assert list(reduces["step"]) == [5, 5, 6]
    row = trace[trace["name"] == "backward"].iloc[0]
    assert (row["start_ms"], row["dur_ms"], row["end_ms"], row["device"]) == (1.0, 6.0, 7.0, "cpu")
    kernel = trace[trace["name"] == "ncclDevKernel_AllReduce"].iloc[0]
    assert kernel["device"] == "gpu" and kernel["step"] == 6   # no GPU step marks: the CPU's spans decide


def test_self_time_leaves_out_the_events_an_event_holds_on_its_own_thread(tmp_path):
    """As the profiler's table counts "Self CPU": a parent's time less its direct children's,
    a grandchild counted once (in its parent), another thread's events never."""
    events = [
        _event("aten::conv2d", 0, 10_000),                  # holds two children
        _event("aten::convolution", 1000, 3000),             # holds a grandchild
        _event("aten::mkldnn_convolution", 2000, 1000),
        _event("aten::add", 5000, 4000),
        _event("gloo:all_reduce", 500, 9000, tid=2),         # another thread: not a child
        _event("aten::linear", 20_000, 10_000),              # a child that starts with its parent
        _event("aten::addmm", 20_000, 5000),
    ]
    trace = labkit.read_trace(_write(tmp_path, events))
    own = dict(zip(trace["name"], trace["self_ms"]))
    assert own == {"aten::conv2d": 3.0, "aten::convolution": 2.0, "aten::mkldnn_convolution": 1.0,
                   "aten::add": 4.0, "gloo:all_reduce": 9.0, "aten::linear": 5.0, "aten::addmm": 5.0}
    assert (trace["self_ms"] <= trace["dur_ms"]).all()


def test_gpu_events_follow_the_gpus_own_step_marks(tmp_path):
    events = STEP_EVENTS + [_event("ProfilerStep#5", 12_500, 3000, pid=0, tid=7, cat="gpu_user_annotation")]
    trace = labkit.read_trace(_write(tmp_path, events))
    assert trace.loc[trace["name"] == "ncclDevKernel_AllReduce", "step"].iloc[0] == 5   # the GPU runs behind


@pytest.mark.parametrize("content, message", [
    ("not json", "not a Chrome trace"),
    (json.dumps({"events": []}), "not a Chrome trace"),
    (json.dumps({"traceEvents": [{"ph": "M", "name": "thread_name"}]}), "no timed event"),
])
def test_read_trace_refuses_what_is_not_a_trace(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        labkit.read_trace(path)


def test_read_trace_says_where_a_missing_trace_comes_from(tmp_path):
    with pytest.raises(FileNotFoundError, match="export_chrome_trace"):
        labkit.read_trace(tmp_path / "trace_rank0.json")


def test_overlap_merges_each_set_then_intersects():
    import pandas as pd

    def spans(*pairs):
        return pd.DataFrame(pairs, columns=["start_ms", "end_ms"])

    comm = spans((0, 4), (2, 6), (10, 12))          # union: [0, 6] and [10, 12]
    compute = spans((1, 3), (5, 11), (20, 30))      # union: [1, 3], [5, 11], [20, 30]
    assert labkit.overlap_ms(comm, compute) == pytest.approx(2 + 1 + 1)
    assert labkit.overlap_ms(compute, comm) == pytest.approx(4)
    assert labkit.overlap_ms(comm, spans((6, 10))) == 0     # touching is not overlapping
    assert labkit.overlap_ms(comm, spans()) == 0


def test_plot_timeline_draws_one_row_per_lane(tmp_path):
    trace = labkit.read_trace(_write(tmp_path, STEP_EVENTS))
    step = trace[trace["step"] == 5].assign(label=lambda t: t["name"].where(t["collective"].isna(), "all-reduce"))
    ax = labkit.plot_timeline(step, lanes={"main thread": "main", "pt_gloo_runloop 2": "gloo"}, title="step 5")
    rows = dict(zip([t.get_text() for t in ax.get_yticklabels()], ax.get_yticks()))
    assert set(rows) == {"main", "gloo"} and rows["main"] > rows["gloo"]   # the first lane on top
    assert ax.get_title() == "step 5" and ax.get_xlim()[0] == 0
    assert {t.get_text() for t in ax.get_legend().get_texts()} == {"ProfilerStep#5", "backward", "all-reduce"}


def test_plot_timeline_writes_a_label_once_per_lane_in_its_widest_bar():
    import pandas as pd

    ops = pd.DataFrame({"lane": ["main"] * 3 + ["gloo"], "name": ["op", "op", "op", "all-reduce"],
                        "start_ms": [0.0, 10.0, 40.0, 5.0], "end_ms": [9.0, 39.0, 49.0, 45.0]})
    ax = labkit.plot_timeline(ops)
    assert sorted((t.get_text(), t.get_position()[0]) for t in ax.texts) == [("all-reduce", 25.0), ("op", 24.5)]


def test_plot_timeline_draws_any_table_of_spans_with_its_own_text():
    """Not only traces: a pipeline's schedule, one lane per stage, each bar numbered."""
    import pandas as pd

    schedule = pd.DataFrame({"lane": ["stage 0", "stage 0", "stage 1"], "name": ["F", "B", "F"],
                             "start_ms": [0.0, 10.0, 5.0], "end_ms": [5.0, 20.0, 10.0], "text": ["0", "0", "0"]})
    ax = labkit.plot_timeline(schedule, legend=False)
    assert sorted(t.get_text() for t in ax.texts) == ["0", "0", "0"] and ax.get_legend() is None


def test_plot_timeline_gives_a_label_the_same_colour_in_every_chart():
    """Lesson 07 draws a step with the loader, then one without: "all-reduce of a bucket" must not
    take the colour the first chart gave "gradient computation". A label labkit does not know gets
    a colour of its own, never one of a known label."""
    import pandas as pd
    from matplotlib.colors import to_rgba

    def chart(labels):
        bars = pd.DataFrame({"lane": "main", "name": labels, "start_ms": [float(i) for i in range(len(labels))]})
        ax = labkit.plot_timeline(bars.assign(end_ms=bars["start_ms"] + 1))
        legend = ax.get_legend()
        return {t.get_text(): to_rgba(h.get_facecolor()) for t, h in zip(legend.get_texts(), legend.legend_handles)}

    with_data = chart(["data", "forward", "backward", "optimizer", "gradient computation", "all-reduce of a bucket"])
    without = chart(["forward", "backward", "optimizer", "all-reduce of a bucket", "gradient computation",
                     "ProfilerStep#5", "my label"])
    for label in with_data:
        if label in without:
            assert with_data[label] == without[label], label
    assert len(set(with_data.values())) == len(with_data)                  # six labels, six colours
    known = {to_rgba(c) for c in _trace.LABEL_COLOURS.values()}
    assert without["ProfilerStep#5"] not in known and without["my label"] not in known
    assert without["ProfilerStep#5"] != without["my label"]
    assert with_data["gradient computation"] == to_rgba("tab:purple")   # as the first chart drew it
    many = chart([f"label {i}" for i in range(30)])                       # past the spare colours: they repeat,
    assert not set(many.values()) & known                                 # but never as a known label's


def test_plot_timeline_refuses_bad_input(tmp_path):
    import pandas as pd

    trace = labkit.read_trace(_write(tmp_path, STEP_EVENTS))
    with pytest.raises(ValueError, match="missing: lane"):
        labkit.plot_timeline(trace.drop(columns=["lane"]))
    with pytest.raises(ValueError, match="no events"):
        labkit.plot_timeline(trace[trace["step"] == 99])
    with pytest.raises(ValueError, match="leaves out"):
        labkit.plot_timeline(trace, lanes=["main thread"])
    with pytest.raises(ValueError, match="columns"):
        labkit.plot_timeline(pd.Series([1, 2]))


# -- real traces from 2 gloo ranks --------------------------------------------------------
def _profiled_ddp_step(rank: int, world_size: int, hook: str, folder: str) -> dict:
    """One DDP step of a small model, profiled after two unprofiled ones; the trace's path."""
    import os

    import torch
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.profiler import ProfilerActivity, profile

    os.environ["KINETO_LOG_LEVEL"] = "6"
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)),
                bucket_cap_mb=0.0005)   # 524 bytes: each layer a bucket of its own
    hooks = {"bf16": default_hooks.bf16_compress_hook, "allreduce": default_hooks.allreduce_hook}
    if hook in hooks:
        model.register_comm_hook(None, hooks[hook])
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    for _ in range(2):  # the first step makes one bucket of everything; then DDP rebuilds them
        F.cross_entropy(model(x), y).backward()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        F.cross_entropy(model(x), y).backward()
    path = os.path.join(folder, f"{hook}_rank{rank}.json")
    prof.export_chrome_trace(path)
    buckets = len(str(model._get_ddp_logging_data()["rebuilt_bucket_sizes"]).split(","))
    return {"path": path, "buckets": buckets,
            "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


@pytest.mark.launch
def test_bytes_counted_from_real_traces_tell_compression_apart(tmp_path):
    from _ranks import run_ranks

    sent = {}
    for hook in ("none", "bf16", "allreduce"):
        results = run_ranks(2, _profiled_ddp_step, hook, str(tmp_path))
        for result in results:
            trace = labkit.read_trace(result["path"])
            reduces = trace[trace["collective"] == "all_reduce"]
            assert len(reduces) == result["buckets"] == 2, (hook, reduces)
            sent.setdefault(hook, set()).add(reduces["bytes"].sum())
        param_bytes = results[0]["param_bytes"]
    assert sent["none"] == {param_bytes}                  # every float32 gradient, once
    assert sent["bf16"] == {param_bytes / 2}              # the lesson's check: halved...
    assert sent["allreduce"] == {param_bytes}             # ...which a hook that does not compress fails
    assert not 2 * min(sent["allreduce"]) == param_bytes


# -- what lesson 07 says of PyTorch's own hooks, checked on this PyTorch -----------------
def _batched_powersgd_steps(rank: int, world_size: int) -> dict:
    """Train a small DDP model with batched_powerSGD_hook; where does it stop, and why?"""
    import traceback

    import torch
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)))
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    model.register_comm_hook(state, powerSGD_hook.batched_powerSGD_hook)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    for step in range(4):
        try:
            F.cross_entropy(model(x), y).backward()
        except Exception as err:  # noqa: BLE001 - the failure is what the test looks at
            return {"step": step, "error": type(err).__name__, "traceback": traceback.format_exc()}
    return {"step": None}


@pytest.mark.launch
def test_batched_powersgd_fails_at_its_first_compressed_step_in_this_pytorch():
    """Lesson 07 says batched_powerSGD_hook fails in PyTorch 2.14.1 and uses powerSGD_hook. When a
    PyTorch fixes it, this test fails: then the lesson's note should go."""
    from _ranks import run_ranks

    for result in run_ranks(2, _batched_powersgd_steps):
        assert result["step"] == 2, result           # 2 exact warm-up steps pass; the first compressed one fails
        assert result["error"] == "AssertionError" and "_orthogonalize" in result["traceback"], result
