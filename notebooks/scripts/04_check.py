"""Lesson 04 check: k accumulated micro-batches = one batch k times larger; clipping; what no_sync saves, counted.

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


def clipped(net, x, y, k: int, max_norm: float, *, every: bool = False, scaler=None, unscale_first=True):
    """k micro-steps with no_sync, then the gradient's norm clipped to max_norm; returns the norm
    the clip saw. every=True: the mistake, a clip after every micro-step. With a GradScaler the
    loss is scaled (fp16 autocast on GPUs), and unscaled before the clip, or after it (the mistake)."""
    holder = torch.optim.SGD(net.parameters(), lr=0.0)  # unscale_ finds the gradients through an optimizer
    for j, (xj, yj) in enumerate(zip(x.chunk(k), y.chunk(k))):
        with net.no_sync() if j < k - 1 else nullcontext():
            with torch.autocast(device.type, torch.float16, enabled=scaler is not None and device.type == "cuda"):
                loss = F.cross_entropy(net(xj), yj) / k
            (scaler.scale(loss) if scaler else loss).backward()
        if every and j < k - 1:  # the mistake: this rank's partial sum, not the whole gradient
            torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm)
    if scaler and unscale_first:
        scaler.unscale_(holder)  # divide by the loss scale first: the true gradient again
    seen = torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm)  # the sync micro-step: whole now
    if scaler and not unscale_first:
        scaler.unscale_(holder)  # too late: the clip measured the scaled gradient
    return seen


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

# 2. Clipping. The threshold is half the reference's norm, so that the clip bites.
max_norm = 0.5 * want.norm().item()
F.cross_entropy(reference(x), y).backward()
want_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
want_clipped = take_grads(reference)
ways = {"DDP, no_sync, clipped after the last micro-step": {},
        "pitfall: DDP, no_sync, clipped after every micro-step": {"every": True},
        "GradScaler: unscale_, then clip": {"scaler": True},
        "pitfall: GradScaler: clip, then unscale_": {"scaler": True, "unscale_first": False}}
for name, options in ways.items():
    if options.get("scaler"):
        options["scaler"] = torch.amp.GradScaler(device.type)  # a fresh one: its scale is 2**16
    seen = clipped(model, x[mine], y[mine], k, max_norm, **options)
    got = take_grads(model)
    found = torch.stack([(got - want_clipped).abs().max() / want_clipped.abs().max(),
                         got.norm() / want_clipped.norm(), seen / want_norm])
    dist.all_reduce(found, op=dist.ReduceOp.MAX)  # the worst rank
    metrics.log(0, check=name, k=k, grad_gap=found[0].item(), norm_ratio=found[1].item(),
                seen_ratio=found[2].item(), fp16=bool(options.get("scaler")) and device.type == "cuda")
    if master:
        print(f"{name:>53}: gap {found[0]:.1e}, |g| ratio {found[1]:.3f}, the clip saw {found[2]:.4g}× the norm")

# 3. A parameter the loss never uses: DDP's reducer waits for its gradient, in vain.
class WithUnusedHead(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net, self.aux = copy.deepcopy(reference), torch.nn.Linear(10, 10).to(device)

    def forward(self, x):
        return self.net(x)  # self.aux is never called: its parameters never get a gradient


ids = [local_rank] if device.type == "cuda" else None
error = "none"
try:
    broken = DDP(WithUnusedHead(), device_ids=ids)
    for _ in range(2):  # the second forward finds the first backward's reduction unfinished
        F.cross_entropy(broken(x[mine]), y[mine]).backward()
except RuntimeError as err:
    error = str(err).split(". ")[0]
fixed = DDP(WithUnusedHead(), device_ids=ids, find_unused_parameters=True)  # searches the graph
fixed_counter = comm.count_allreduces(fixed)
F.cross_entropy(fixed(x[mine]), y[mine]).backward()
got = torch.cat([p.grad.flatten() for p in fixed.module.net.parameters()])
found = torch.stack([(got - want).abs().max() / want.abs().max()])
dist.all_reduce(found, op=dist.ReduceOp.MAX)
metrics.log(0, unused_error=error, unused_fixed_gap=found[0].item(), unused_bytes=fixed_counter.bytes,
            unused_param_bytes=sum(p.numel() * p.element_size() for p in fixed.parameters()))
searching = DDP(copy.deepcopy(reference), device_ids=ids, find_unused_parameters=True)
times = {"search": [], "no search": []}  # what the search costs, on a model that uses every parameter
for repeat in range(args.repeats + 1):
    for mode, net in (("search", searching), ("no search", model)):
        dist.barrier()
        start = time.perf_counter()
        F.cross_entropy(net(x[mine]), y[mine]).backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if repeat:  # the first of each is a warm-up
            times[mode].append(time.perf_counter() - start)
        net.zero_grad(set_to_none=True)
metrics.log(0, **{f"{mode.replace(' ', '_')}_step_s": statistics.median(t) for mode, t in times.items()})
if master:
    print(f"find_unused_parameters=False, with an unused head: {error}")

# 4. Counts and times: one optimizer step of k micro-steps, with and without no_sync.
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
