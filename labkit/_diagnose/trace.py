"""Profiler traces: read the Chrome trace that ``torch.profiler`` writes into a table; draw it.

A lesson script profiles a few steps and saves each rank's trace in its run folder
(``prof.export_chrome_trace(...)``). The notebook reads it back here, counts what it needs
(the all-reduces of each step and their bytes, how long communication overlapped
computation) and draws a timeline, one lane per thread or GPU stream::

    trace = labkit.read_trace(run.run_dir / "trace_rank0.json")
    trace[trace["collective"].notna()]                # every all-reduce, with its bytes
    labkit.plot_timeline(trace[trace["step"] == 5])

The same file opens in Perfetto (https://ui.perfetto.dev) or ``chrome://tracing``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

#: Bytes per element of the dtypes the profiler names in "Input type" (C++ spellings).
DTYPE_BYTES = {
    "double": 8, "float": 4, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "int": 4,
    "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1,
    "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1, "c10::complex<float>": 8,
    "c10::complex<double>": 16,
}
#: A collective as the process group records it: "gloo:all_reduce", "nccl:all_reduce", ...
_COLLECTIVE = re.compile(r"^(gloo|nccl|ucc|mpi|xccl):(\w+)$")
_STEP = re.compile(r"^ProfilerStep#(\d+)$")
_GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"}
COLUMNS = ["name", "cat", "lane", "device", "pid", "tid", "step", "start_ms", "end_ms", "dur_ms",
           "self_ms", "collective", "bytes", "dims", "dtypes", "correlation"]
#: The colour of each label of ``step_events``, the same in every chart (tab10's first six, in the
#: order lesson 07's first timeline meets them; gloo's and NCCL's all-reduces share one).
LABEL_COLOURS = {"data": "tab:blue", "forward": "tab:orange", "backward": "tab:green",
                 "optimizer": "tab:red", "gradient computation": "tab:purple",
                 "all-reduce of a bucket": "tab:brown", "all-reduce kernel": "tab:brown"}


def _tensor_bytes(dims, dtypes) -> float:
    """Bytes of the tensors an event received, from its "Input Dims" and "Input type"; NaN when
    a dtype is unknown or nothing was recorded (a trace without ``record_shapes=True``)."""
    total, found = 0, False
    for shape, dtype in zip(dims or [], dtypes or []):
        if not isinstance(shape, list) or not shape or not all(isinstance(d, int) for d in shape):
            continue  # a scalar argument, or a list of tensors
        if dtype not in DTYPE_BYTES:
            return float("nan")
        numel = 1
        for d in shape:
            numel *= d
        total, found = total + numel * DTYPE_BYTES[dtype], True
    return float(total) if found else float("nan")


def _self_ms(df) -> list[float]:
    """Each event's own time: its duration less its direct children's, as the profiler's table
    counts "Self CPU" (and "Self CUDA"). On one thread (or GPU stream) events nest: a child
    starts and ends inside its parent. Returns one value per row of ``df``, in its order."""
    own = dict(zip(df.index, df["dur_ms"]))
    nested = df.sort_values(["start_ms", "end_ms"], ascending=[True, False], kind="stable")
    for _, rows in nested.groupby(["pid", "tid"], sort=False):
        holding: list[tuple[object, float]] = []  # (row, end) of the events that hold this one
        for i, start, end in zip(rows.index, rows["start_ms"], rows["end_ms"]):
            while holding and holding[-1][1] <= start:
                holding.pop()  # it ended before this one began
            if holding and end <= holding[-1][1]:
                own[holding[-1][0]] -= end - start  # the parent's own time leaves this child out
            holding.append((i, end))
    return [own[i] for i in df.index]


def _lane_names(events: list[dict]) -> dict:
    """(pid, tid) -> a readable lane: "main thread", "pt_gloo_runloop 812", "GPU 0 stream 7"."""
    threads, processes = {}, {}
    for e in events:
        if e.get("ph") != "M":
            continue
        name = (e.get("args") or {}).get("name") or (e.get("args") or {}).get("labels")
        if e.get("name") == "thread_name" and name:
            threads[(e.get("pid"), e.get("tid"))] = str(name)
        elif e.get("name") in ("process_name", "process_labels") and name:
            processes.setdefault(e.get("pid"), str(name))
    steps = {(e.get("pid"), e.get("tid")) for e in events
             if e.get("ph") == "X" and _STEP.match(str(e.get("name", "")))}
    lanes = {}
    for key in {(e.get("pid"), e.get("tid")) for e in events if e.get("ph") == "X"}:
        thread = threads.get(key, f"thread {key[1]}")
        found = re.match(r"thread (\d+) \((.+)\)$", thread)  # kineto: "thread 812 (python)"
        if key in steps:
            lanes[key] = "main thread"
        elif found:
            lanes[key] = f"{found.group(2)} {found.group(1)}"
        elif str(processes.get(key[0], "")).startswith("GPU"):
            lanes[key] = f"{processes[key[0]]} {thread}"
        else:
            lanes[key] = thread
    return lanes


def read_trace(path: str | os.PathLike):
    """Every timed event of a ``torch.profiler`` Chrome trace, one row each, in time order.

    Columns: ``name``; ``cat`` (the profiler's category: ``cpu_op``, ``user_annotation`` for
    ``record_function`` labels, ``kernel`` on GPUs, ...); ``lane`` (the thread or GPU stream:
    "main thread" is the one that called ``prof.step()``); ``device`` ("cpu" or "gpu");
    ``pid`` and ``tid``; ``step`` (the profiled step whose ``ProfilerStep#N`` span holds the
    event's start, on the CPU's timeline or, for GPU events, the GPU's; else NA); ``start_ms``, ``end_ms`` and ``dur_ms`` (milliseconds
    from the first event); ``self_ms`` (the event's own time: ``dur_ms`` less that of the events
    it directly holds on its thread or stream, the profiler table's "Self CPU"); ``collective`` (the operation of a process group's record, e.g.
    "all_reduce" for ``gloo:all_reduce`` or ``nccl:all_reduce``, else None); ``bytes`` (of the
    tensors the event received, from ``record_shapes=True``; NaN where unknown); ``dims`` and
    ``dtypes`` as the profiler recorded them; ``correlation`` (on GPUs, the number that links a
    kernel to the CUDA runtime call on the CPU that launched it, in both rows; else NA).

    ``df.attrs`` holds the trace's ``path`` and, for a distributed run, its ``rank``,
    ``world_size`` and ``backend``.

    Args:
        path: a ``.json`` trace from ``prof.export_chrome_trace(path)``.

    Returns:
        a pandas DataFrame.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is not a Chrome trace, or holds no timed event.

    Example (lesson 07)::

        trace = labkit.read_trace(run.run_dir / "trace_rank0.json")
        per_step = trace[trace["collective"] == "all_reduce"].groupby("step")["bytes"].sum()
    """
    import pandas as pd

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"no trace at {path}. HINT: the script writes it with prof.export_chrome_trace(...) "
            f"when its profiled steps end; did the run profile any step?")
    try:
        document = json.loads(path.read_text())
        events = document["traceEvents"]
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path} is not a Chrome trace from torch.profiler ({err!r})") from None
    timed = [e for e in events if isinstance(e, dict) and e.get("ph") == "X" and "ts" in e]
    if not timed:
        raise ValueError(f"{path} holds no timed event: was anything run while profiling?")
    lanes = _lane_names(events)
    origin = min(float(e["ts"]) for e in timed)
    rows = []
    for e in timed:
        args = e.get("args") or {}
        start = (float(e["ts"]) - origin) / 1000
        found = _COLLECTIVE.match(str(e.get("name", "")))
        dims, dtypes = args.get("Input Dims"), args.get("Input type")
        rows.append({
            "name": str(e.get("name", "")), "cat": e.get("cat"),
            "lane": lanes[(e.get("pid"), e.get("tid"))],
            "device": "gpu" if e.get("cat") in _GPU_CATEGORIES else "cpu",
            "pid": e.get("pid"), "tid": e.get("tid"), "start_ms": start,
            "end_ms": start + float(e.get("dur", 0)) / 1000, "dur_ms": float(e.get("dur", 0)) / 1000,
            "collective": found.group(2) if found else None,
            "bytes": _tensor_bytes(dims, dtypes), "dims": dims, "dtypes": dtypes,
            "correlation": args["correlation"] if type(args.get("correlation")) is int else None})
    df = pd.DataFrame(rows).sort_values(["start_ms", "end_ms"], kind="stable").reset_index(drop=True)
    df["self_ms"] = _self_ms(df)
    df["correlation"] = pd.array(df["correlation"], dtype="Int64")
    df["step"] = pd.array([pd.NA] * len(df), dtype="Int64")
    spans = df[df["name"].str.match(_STEP.pattern)]
    for device in ("cpu", "gpu"):
        # A GPU runs behind the CPU that launched its kernels: kineto marks each step on the GPU's
        # timeline too ("gpu_user_annotation"); without those marks, the CPU's spans decide.
        own = spans[spans["device"] == device]
        for _, span in (own if len(own) else spans[spans["device"] == "cpu"]).iterrows():
            inside = (df["start_ms"] >= span["start_ms"]) & (df["start_ms"] < span["end_ms"])
            df.loc[inside & (df["device"] == device), "step"] = int(_STEP.match(span["name"]).group(1))
    df = df[COLUMNS]
    info = document.get("distributedInfo") or {}
    df.attrs.update(path=str(path), rank=info.get("rank"), world_size=info.get("world_size"),
                    backend=info.get("backend"))
    return df


def _union(intervals) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted((float(s), float(e)) for s, e in intervals if e > s):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def overlap_ms(events, others) -> float:
    """How long, in ms, any event of ``events`` ran while any event of ``others`` ran.

    Each is a DataFrame with ``start_ms`` and ``end_ms`` (rows of ``read_trace``); events
    within one set may overlap each other (each set is merged into its union first).

    Example (lesson 07: communication hidden behind the backward pass)::

        hidden = labkit.overlap_ms(trace[trace["collective"].notna()], backward_ops)
    """
    a = _union(zip(events["start_ms"], events["end_ms"]))
    b = _union(zip(others["start_ms"], others["end_ms"]))
    total, j = 0.0, 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            total += min(end, b[k][1]) - max(start, b[k][0])
            k += 1
    return total


def _colours(labels) -> dict:
    """{label: colour}: ``LABEL_COLOURS``'s; for the others, in order, tab10's and tab20's light
    shades, less every colour of ``LABEL_COLOURS`` (an unknown label never looks like a known one)."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgba

    fixed = {to_rgba(c) for c in LABEL_COLOURS.values()}
    spare = [c for c in map(to_rgba, plt.cm.tab10.colors + plt.cm.tab20.colors[1::2]) if c not in fixed]
    others = {label: spare[i % len(spare)]
              for i, label in enumerate(label for label in labels if label not in LABEL_COLOURS)}
    return {label: to_rgba(LABEL_COLOURS[label]) if label in LABEL_COLOURS else others[label] for label in labels}


def plot_timeline(events, *, lanes=None, ax=None, title: str | None = None, legend: bool = True):
    """Draw trace events as bars on a time axis, one row per lane (thread or GPU stream).

    Args:
        events: rows of ``read_trace`` (``lane``, ``start_ms``, ``end_ms``, ``name``), already
            chosen: a step's phases and its all-reduces, say; or any table with those columns
            (a pipeline's schedule, one lane per stage). A ``label`` column, where present,
            names each bar (and picks its colour: ``LABEL_COLOURS``, else one none of those
            has) instead of ``name``. Each label is written once per lane, in its widest bar
            (when wide enough); a ``text`` column, where present, is written in every bar wide
            enough instead (a micro-batch's number, say).
        lanes: the rows to draw, top to bottom, and what to call them: a list of lane names,
            or a dict {lane: shown name}. Default: every lane, in order of first appearance.
        ax: the axes to draw on (a new figure if None).
        title: the axes' title.
        legend: a legend of the labels (one colour each).

    Returns:
        the matplotlib Axes; time runs from the first drawn event, in ms.

    Raises:
        ValueError: no events, a missing column, or a lane that ``lanes`` leaves out.

    Example (lesson 07)::

        step = trace[trace["step"] == 5]
        labkit.plot_timeline(step[step["name"].isin(["forward", "backward", "optimizer"])
                                  | step["collective"].notna()])
    """
    import matplotlib.pyplot as plt

    missing = [c for c in ("lane", "start_ms", "end_ms", "name") if c not in getattr(events, "columns", [])]
    if missing:
        raise ValueError(f"plot_timeline needs the columns lane, start_ms, end_ms and name "
                         f"(rows of labkit.read_trace); missing: {', '.join(missing)}")
    if len(events) == 0:
        raise ValueError("plot_timeline got no events to draw. HINT: check the filter that chose "
                         "them, e.g. the step number (trace['step'].unique()).")
    names = dict(lanes) if isinstance(lanes, dict) else {lane: lane for lane in (
        lanes if lanes is not None else dict.fromkeys(events["lane"]))}
    unknown = sorted(set(events["lane"]) - set(names), key=str)
    if unknown:
        raise ValueError(f"events on lanes {unknown} that lanes= leaves out; lanes given: {list(names)}")
    labels = events["label"].fillna(events["name"]) if "label" in events.columns else events["name"]
    widths = events["end_ms"] - events["start_ms"]
    if "text" in events.columns:
        texts = events["text"].fillna(labels)
    else:  # a label once per lane, in its widest bar: many narrow bars would write over each other
        groups = [events["lane"], labels]
        widest = widths.eq(widths.groupby(groups).transform("max"))
        texts = labels.where(widest & widest.groupby(groups).cumsum().eq(1), "")  # the first widest
    colour = _colours(dict.fromkeys(labels))
    origin = float(events["start_ms"].min())
    span = float(events["end_ms"].max()) - origin or 1.0
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.7 + 0.55 * len(names)))
    rows = {lane: len(names) - 1 - i for i, lane in enumerate(names)}
    for (_, event), label, text in zip(events.iterrows(), labels, texts):
        start, width = float(event["start_ms"]) - origin, float(event["end_ms"] - event["start_ms"])
        y = rows[event["lane"]]
        ax.broken_barh([(start, max(width, span / 2000))], (y - 0.38, 0.76), color=colour[label],
                       alpha=0.85, edgecolor="white", linewidth=0.3)
        if text != "" and width > span / 12:
            ax.text(start + width / 2, y, str(text), ha="center", va="center", fontsize=7,
                    clip_on=True)
    ax.set_yticks(list(rows.values()), [names[lane] for lane in rows])
    ax.set_ylim(-0.6, len(names) - 0.4)
    ax.set_xlim(0, span * 1.01)
    ax.set_xlabel("ms")
    ax.grid(axis="x", alpha=0.3)
    if legend:
        from matplotlib.patches import Patch

        ax.legend(handles=[Patch(color=c, label=str(l)) for l, c in colour.items()], fontsize=7,
                  loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    if title is not None:
        ax.set_title(title)
    return ax
