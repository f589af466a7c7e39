"""Lesson 08 bench: one training step of the lesson's model, under DDP and as one process alone.

Run it:  torchrun --standalone --nproc-per-node=2 scripts/08_scaling.py
On several ranks: DDP at its default buckets; then rank 0 alone (the others wait, idle) times
the same step as one process, for the scaling report. On one process: that part only.
"""
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import record_function
from torch.utils.flop_counter import FlopCounterMode

from labkit import metrics
from labkit.models import SmallResNet

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--width", type=int, default=32)
parser.add_argument("--batch-size", type=int, default=128, help="per rank")
parser.add_argument("--steps", type=int, default=5, help="timed steps in each repeat")
parser.add_argument("--repeats", type=int, default=5, help="rounds over every setting")
parser.add_argument("--ranks", type=int, default=2, help="one process alone: the world size to compare")
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

rank = int(os.environ.get("RANK", 0))
world_size = int(os.environ.get("WORLD_SIZE", 1))
rank_threads = torch.get_num_threads()  # what each rank was given (OMP_NUM_THREADS)
if torch.cuda.is_available():
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
else:
    device = torch.device("cpu")
if world_size > 1:
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
    spreads over all of them, after one warm-up round that is not logged; print rank 0's medians."""
    times = {name: [] for name in settings}
    for repeat in range(args.repeats + 1):
        for name, setting in settings.items():
            step_s = run_steps(setting)
            if repeat:
                times[name].append(step_s)
                metrics.log(repeat, setting=name, step_time_s=step_s,
                            batch_size=len(setting["batches"][0][1]))
    if rank == 0:
        for name, found in times.items():
            print(f"{name:>34}: {1000 * statistics.median(found):7.1f} ms a step (rank 0's, median of {len(found)} repeats)")


def baselines(ranks: int) -> None:
    """One process alone on the machine: the same step with one rank's threads and with every
    core, at the per-rank and the global batch; the FLOPs of a step; the peak of a matmul."""
    sizes = {"per-rank batch": args.batch_size, "global batch": ranks * args.batch_size}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = sorted({rank_threads, cores}) if device.type == "cpu" else [None]  # a GPU: no threads
    settings = {f"{n} thread(s), {what}" if n else what: make(threads=n, batch_size=size)
                for n in threads for what, size in sizes.items()}
    bench(settings)
    model = make()["model"]
    for what, size in sizes.items():
        x, y = batches(size)[0]
        with FlopCounterMode(display=False) as counter:  # counts matmuls and convolutions
            F.cross_entropy(model(x), y).backward()
        metrics.log(0, batch_size=size, flops_per_step=counter.get_total_flops())
    n = 4096 if device.type == "cuda" else 1024  # the peak: a large matmul, the best case
    torch.backends.cuda.matmul.allow_tf32 = True  # on GPUs in TF32, as cuDNN's convolutions run
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    for count in threads:
        if count:
            torch.set_num_threads(count)
        rates = []
        for _ in range(args.repeats + 1):  # each repeat: about 0.1 s of matmuls, timed
            calls, start = 0, time.perf_counter()
            while calls == 0 or time.perf_counter() - start < 0.1:
                a @ b
                if device.type == "cuda":
                    torch.cuda.synchronize()
                calls += 1
            rates.append(calls * 2 * n ** 3 / (time.perf_counter() - start))
        metrics.log(0, threads=count or 0, peak_flops=statistics.median(rates[1:]))
        where = f"{count} thread(s)" if count else "the GPU"
        print(f"peak of a {n}×{n} matmul on {where}: {statistics.median(rates[1:]) / 1e9:,.1f} GFLOP/s")



if world_size > 1:  # --- DDP on every rank, at its default buckets; then one process alone ----
    bench({"DDP": make({})})
    # The wait below is a gloo barrier even on GPUs: gloo's ranks sleep in a socket read, where
    # NCCL's would keep a core busy polling the GPU, and take it from rank 0's baselines.
    idle = dist.new_group(backend="gloo") if device.type == "cuda" else None  # None: the gloo world
    waited, used = time.perf_counter(), time.process_time()
    if rank == 0:  # then rank 0 alone is one process on the machine: the baselines
        baselines(world_size)
    dist.barrier(group=idle)  # the other ranks wait here meanwhile...
    if rank:  # ...and say how much CPU time they used while they waited
        metrics.log(0, waited_s=time.perf_counter() - waited, waited_cpu_s=time.process_time() - used)
    dist.destroy_process_group()
else:
    baselines(args.ranks)
