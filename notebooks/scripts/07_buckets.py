"""Lesson 07 bench: one DDP training step of the lesson's model, timed on many settings side by side.

Run it:  torchrun --standalone --nproc-per-node=2 scripts/07_buckets.py
DDP's bucket sizes and two options that save work, each from the same initial weights on the
same batches, timed interleaved; then a profiled round at each bucket size.
"""
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from labkit import metrics
from labkit.models import SmallResNet

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--width", type=int, default=32)
parser.add_argument("--batch-size", type=int, default=128, help="per rank")
parser.add_argument("--steps", type=int, default=5, help="timed steps in each repeat")
parser.add_argument("--repeats", type=int, default=5, help="rounds over every setting")
parser.add_argument("--bucket-caps", default="0.02,0.2,25", help="DDP: bucket_cap_mb to compare")
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

rank = int(os.environ.get("RANK", 0))
world_size = int(os.environ.get("WORLD_SIZE", 1))
if torch.cuda.is_available():
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
else:
    device = torch.device("cpu")
dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # the profiler's own start and stop notes: off


def batches(size):
    """The same `steps` batches for every setting of one size; each rank its own samples."""
    data = torch.Generator().manual_seed(args.seed + 1 + rank)
    return [(torch.randn(size, 3, 32, 32, generator=data).to(device),
             torch.randint(0, 10, (size,), generator=data).to(device)) for _ in range(args.steps)]


def make(options=None, threads=None, batch_size=args.batch_size):
    """A fresh model (the same initial weights every time), its optimizer and its batches."""
    torch.manual_seed(args.seed)
    model = SmallResNet(width=args.width, norm="group").to(device)
    if options is not None:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    return {"model": model, "optimizer": optimizer, "threads": threads, "batches": batches(batch_size)}


def run_steps(setting, profiler=None) -> float:
    """Train on the setting's batches; return the seconds per step."""
    if setting["threads"]:
        torch.set_num_threads(setting["threads"])
    model, optimizer = setting["model"], setting["optimizer"]
    start = time.perf_counter()
    for x, y in setting["batches"]:
        optimizer.zero_grad(set_to_none=True)
        with record_function("forward"):
            loss = F.cross_entropy(model(x), y)
        with record_function("backward"):
            loss.backward()
        with record_function("optimizer"):
            optimizer.step()
        if profiler:
            profiler.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / len(setting["batches"])


def bench(settings) -> None:
    """Time every setting `repeats` times, interleaved so that a slow spell of the machine
    spreads over all of them, after one warm-up round that is not logged; print each setting's
    median over the repeats of the slowest rank's time."""
    times = {name: [] for name in settings}
    for repeat in range(args.repeats + 1):
        for name, setting in settings.items():
            step_s = run_steps(setting)
            if repeat:
                times[name].append(step_s)
                metrics.log(repeat, setting=name, step_time_s=step_s,
                            batch_size=len(setting["batches"][0][1]))
    slowest = torch.tensor(list(times.values()), dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
    if rank == 0:
        for name, found in zip(times, slowest.tolist()):
            print(f"{name:>34}: {1000 * statistics.median(found):7.1f} ms a step "
                  f"(the slowest rank's, median of {len(found)} repeats)")


def save_trace(setting, name: str) -> None:
    """Profile a round of the setting's steps, after one round that is not kept, into the run
    folder (labkit's, else here) as trace_rank<R>_<name>.json."""
    steps = len(setting["batches"])
    path = os.path.join(os.environ.get(metrics.RUN_DIR_ENV, "."), f"trace_rank{rank}_{name}.json")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=True, on_trace_ready=lambda p: p.export_chrome_trace(path),
                 schedule=schedule(wait=0, warmup=steps, active=steps, repeat=1)) as profiler:
        for _ in range(2):
            run_steps(setting, profiler)



# --- DDP on every rank: bucket sizes, and two options that save work ------------------------
settings = {f"buckets of {cap:g} MB": make({"bucket_cap_mb": cap})
            for cap in map(float, args.bucket_caps.split(","))}
settings["gradient_as_bucket_view"] = make({"gradient_as_bucket_view": True})
settings["static_graph"] = make({"static_graph": True})
bench(settings)
first, layouts = None, {}  # the first setting's weights; the first setting of each bucket layout
for name, setting in settings.items():
    model = setting["model"]
    stats = model._get_ddp_logging_data()  # what DDP measured and decided (sampled steps)
    grads = {p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes()
             for p in model.parameters()}  # each distinct block of gradient memory, once
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    first = weights if first is None else first
    sizes = str(stats["rebuilt_bucket_sizes"])  # the bytes of each bucket
    # the gradients each bucket holds, in order (where each sits in its bucket's sum); a static
    # graph settles its buckets on a schedule of its own (its first step waits for backward's end)
    layout = (stats["rebuilt_per_bucket_param_indices"], model.static_graph)
    twin, twin_weights = layouts.setdefault(layout, (name, weights))
    metrics.log(0, setting=name, buckets=len(sizes.split(",")), bucket_bytes=sum(map(int, sizes.split(","))),
                overlap_ms=stats.get("avg_backward_compute_comm_overlap_time", 0) / 1e6,
                grad_blocks=len(grads), grad_bytes=sum(grads.values()),
                gap_to_first=(weights - first).abs().max(),  # the same maths
                same_buckets_as=twin, gap_to_same=(weights - twin_weights).abs().max())  # same sums
for i, name in enumerate(settings):  # each bucket size's steps, as the profiler sees them
    if name.startswith("buckets"):
        save_trace(settings[name], f"buckets{i}")
dist.destroy_process_group()
