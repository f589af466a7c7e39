"""Lesson 04 check: k accumulated micro-batches = one batch k times larger; what no_sync saves, counted.

Run it:  torchrun --standalone --nproc-per-node=2 scripts/04_check.py
"""
import argparse
import copy
import os
import statistics
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from labkit import comm, metrics
from labkit.models import SmallResNet

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--batch-size", type=int, default=8, help="per rank and micro-step")
parser.add_argument("--accum-steps", type=int, default=4, help="k, for the gradient check")
parser.add_argument("--width", type=int, default=8)
parser.add_argument("--sweep", default="1,2,4,8", help="k values to count and time")
parser.add_argument("--repeats", type=int, default=5, help="timed optimizer steps per k and mode")
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

local_rank = int(os.environ.get("LOCAL_RANK", 0))
device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
if device.type == "cuda":
    torch.cuda.set_device(device)
    torch.backends.cudnn.allow_tf32 = False  # compare float32 with float32, not TF32
dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
master = rank == 0

torch.manual_seed(args.seed)
reference = SmallResNet(width=args.width, norm="group").to(device)  # GroupNorm: see the lesson
model = DDP(copy.deepcopy(reference), device_ids=[local_rank] if device.type == "cuda" else None)
counter = comm.count_allreduces(model)


def batch(n: int, seed: int):
    """n samples, the same on every rank (same seed)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 3, 32, 32, generator=gen).to(device),
            torch.randint(0, 10, (n,), generator=gen).to(device))


def accumulate(net, x, y, k: int, *, no_sync: bool = True, scale: bool = True) -> None:
    """k micro-steps on (x, y) split in k; no_sync on all but the last when net is DDP."""
    for j, (xj, yj) in enumerate(zip(x.chunk(k), y.chunk(k))):
        quiet = no_sync and isinstance(net, DDP) and j < k - 1
        with net.no_sync() if quiet else nullcontext():
            loss = F.cross_entropy(net(xj), yj)
            (loss / k if scale else loss).backward()


def take_grads(net) -> torch.Tensor:
    flat = torch.cat([p.grad.flatten() for p in net.parameters()])
    net.zero_grad(set_to_none=True)
    return flat


# 1. Gradients. The reference: ONE process, ONE batch of W·k·B (every rank computes it).
k, B = args.accum_steps, args.batch_size
x, y = batch(world_size * k * B, args.seed)
F.cross_entropy(reference(x), y).backward()
want = take_grads(reference)
mine = slice(rank * k * B, (rank + 1) * k * B)  # this rank's k micro-batches
runs = {"one process, k micro-batches": (reference, x, y, {}),
        "DDP, no_sync": (model, x[mine], y[mine], {}),
        "DDP, all-reduce every micro-step": (model, x[mine], y[mine], {"no_sync": False}),
        "pitfall: DDP, no_sync, loss not divided by k": (model, x[mine], y[mine], {"scale": False})}
for name, (net, xs, ys, options) in runs.items():
    accumulate(net, xs, ys, k, **options)
    got = take_grads(net)
    found = torch.stack([(got - want).abs().max() / want.abs().max(),  # relative gap
                         got.norm() / want.norm()])
    dist.all_reduce(found, op=dist.ReduceOp.MAX)  # the worst rank
    metrics.log(0, check=name, k=k, grad_gap=found[0].item(), norm_ratio=found[1].item())
    if master:
        print(f"{name:>46}: gradient gap {found[0]:.1e} of the largest, |g| ratio {found[1]:.3f}")

# 2. Counts and times: one optimizer step of k micro-steps, with and without no_sync.
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
for k in [int(v) for v in args.sweep.split(",")]:
    x, y = batch(k * B, args.seed + rank + 1)  # different data per rank, as with a sampler
    times, counts = {True: [], False: []}, {True: set(), False: set()}
    for repeat in range(args.repeats + 1):  # the first of each is a warm-up, not kept
        for no_sync in (True, False):       # interleaved: a slow spell hits both alike
            dist.barrier()
            counter.reset()
            start = time.perf_counter()
            accumulate(model, x, y, k, no_sync=no_sync)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if repeat:
                times[no_sync].append(time.perf_counter() - start)
                counts[no_sync].add((counter.calls, counter.bytes))
    for no_sync in (True, False):
        (calls, nbytes), = counts[no_sync]  # the same in every repeat, or this fails
        metrics.log(k, mode="no_sync" if no_sync else "every micro-step", k=k, allreduces=calls,
                    allreduced_bytes=nbytes, param_bytes=param_bytes,
                    step_time_s=statistics.median(times[no_sync]),
                    step_time_min_s=min(times[no_sync]), step_time_max_s=max(times[no_sync]))
    if master:
        print(f"k={k}: all-reduces per optimizer step {counts[True]} with no_sync, "
              f"{counts[False]} without (calls, bytes)")

dist.destroy_process_group()
