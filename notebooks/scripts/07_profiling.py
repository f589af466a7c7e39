"""Lesson 07: the lesson-02 DDP loop, profiled: where a step's time goes, and what its all-reduces send.

Run it:  torchrun --standalone --nproc-per-node=2 scripts/07_profiling.py --synthetic --profile-steps 2
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, record_function, schedule
from torch.utils.data import DataLoader, DistributedSampler

from labkit import metrics
from labkit.data import get_datasets
from labkit.models import SmallResNet

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--epochs", type=int, default=5)
parser.add_argument("--batch-size", type=int, default=128, help="per rank")
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--width", type=int, default=32, help="channels of the first block")
parser.add_argument("--norm", choices=["batch", "group"], default="batch",
                    help="group: GroupNorm, no statistics shared across a batch (lesson 02's proof)")
parser.add_argument("--train-size", type=int, default=None, help="use a subset of this many images")
parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
parser.add_argument("--log-every", type=int, default=10, help="steps between metrics lines")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--data-dir", default="data")
parser.add_argument("--synthetic", action="store_true", help="the synthetic set, no CIFAR-10")
# --- lesson 07's knobs: what to profile, and how the gradients travel --------------------
parser.add_argument("--profile-steps", type=int, default=0, help="profile this many steps")
parser.add_argument("--profile-after", type=int, default=4, help="steps to run before profiling")
parser.add_argument("--bucket-cap-mb", type=float, default=25, help="DDP's gradient bucket size")
parser.add_argument("--comm-hook", choices=["none", "bf16", "fp16", "powersgd"], default="none",
                    help="compress the gradients DDP all-reduces")
parser.add_argument("--nvtx", action="store_true", help="GPU: NVTX ranges for Nsight Systems")
args = parser.parse_args()
os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # the profiler's own start and stop notes: off

# --- the distributed part: torchrun starts one process per device ------------------------
ddp = "RANK" in os.environ  # under plain `python` this is one process, no process group
rank = int(os.environ.get("RANK", 0))
local_rank = int(os.environ.get("LOCAL_RANK", 0))
world_size = int(os.environ.get("WORLD_SIZE", 1))
if torch.cuda.is_available():
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)  # before init: NCCL binds each rank to its own GPU
else:
    device = torch.device("cpu")
if ddp:
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
master = rank == 0  # rank 0 alone prints summaries

torch.manual_seed(args.seed)  # same initial weights everywhere (DDP also broadcasts rank 0's)
# No random crops or flips: we compare runs at different world sizes, and each would draw
# its own for the same image. Lesson 01 trains with them; here the batches must match.
data = get_datasets(args.data_dir, synthetic=args.synthetic, train_size=args.train_size,
                    test_size=1, seed=args.seed, augment=False)  # no test here: one image
if master:
    print(data.description)
    print(f"per-rank batch {args.batch_size} × {world_size} rank(s) = "
          f"global batch {args.batch_size * world_size}")

# Each rank takes its own 1/world_size of every epoch, reshuffled per epoch by set_epoch.
sampler = DistributedSampler(data.train, num_replicas=world_size, rank=rank, shuffle=True,
                             seed=args.seed, drop_last=True)
# Pinned (page-locked) host memory lets the copy to the GPU run asynchronously;
# worker processes prepare the next batches while this one trains.
pin = device.type == "cuda"
train_loader = DataLoader(data.train, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                          num_workers=args.workers, persistent_workers=args.workers > 0,
                          pin_memory=pin)

model = SmallResNet(width=args.width, norm=args.norm).to(device)  # on its device BEFORE wrapping
if ddp:
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None,
                bucket_cap_mb=args.bucket_cap_mb)  # gradients travel in buckets of this size
    if args.comm_hook in ("bf16", "fp16"):  # all-reduce 2-byte copies, then back to float32
        hook = {"bf16": default_hooks.bf16_compress_hook, "fp16": default_hooks.fp16_compress_hook}
        model.register_comm_hook(None, hook[args.comm_hook])
    elif args.comm_hook == "powersgd":  # send low-rank approximations of the gradient matrices
        # PyTorch's advice: exact all-reduces for the first tenth of the steps, then the lowest
        # rank that training tolerates (start at 1 and double it: 4 keeps up on this model).
        powersgd = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=4,
            start_powerSGD_iter=max(2, args.epochs * len(train_loader) // 10))
        model.register_comm_hook(powersgd, powerSGD_hook.powerSGD_hook)
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)


def save_trace(prof):  # called once the profiled steps are over
    prof.export_chrome_trace(os.path.join(os.environ.get(metrics.RUN_DIR_ENV, "."),
                                          f"trace_rank{rank}.json"))  # labkit's run folder
    if master:  # the operators that took the most time themselves (their children excluded)
        key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=12))


profiler = None
if args.profile_steps:  # not the first steps: DDP rebuilds its buckets after step 1
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    profiler = profile(activities=activities, record_shapes=True, on_trace_ready=save_trace,
                       schedule=schedule(wait=args.profile_after, warmup=1,
                                         active=args.profile_steps, repeat=1))
    profiler.start()
if args.nvtx:  # Nsight Systems: every operator and the phases below become NVTX ranges
    if device.type != "cuda" or args.profile_steps:
        parser.error("--nvtx needs a GPU, and no --profile-steps (one profiler at a time)")
    torch.autograd.profiler.emit_nvtx().__enter__()  # on until the process ends

step = 0
window_loss = torch.zeros((), device=device)  # summed on the device: no sync per step
start = time.perf_counter()
for epoch in range(args.epochs):
    sampler.set_epoch(epoch)  # without it, every epoch repeats the same order
    for x, y in train_loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with record_function("forward"):
            loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)  # frees the old gradients instead of writing zeros
        with record_function("backward"):
            loss.backward()  # DDP all-reduces each bucket here, as soon as it fills
        with record_function("optimizer"):
            optimizer.step()
        window_loss += loss.detach()
        step += 1
        if profiler:
            profiler.step()  # a step is over: the schedule decides what to record next
        if step % args.log_every == 0:
            # .item() waits for the device to finish: a sync point, once per window,
            # so the time metrics.log stamps is when this window's work really ended.
            metrics.log(step, loss=(window_loss / args.log_every).item(),
                        samples=args.log_every * args.batch_size, epoch=epoch)
            window_loss.zero_()
if profiler:
    profiler.stop()

# --- what DDP and the hooks counted ------------------------------------------------------
if ddp:
    stats = model._get_ddp_logging_data()  # DDP's own bookkeeping, averaged over sampled steps
    metrics.log(step, buckets=len(str(stats["rebuilt_bucket_sizes"]).split(",")),
                overlap_ms=stats.get("avg_backward_compute_comm_overlap_time", 0) / 1e6)
    weights = torch.cat([p.detach().flatten().float() for p in model.parameters()])
    highest, lowest = weights.clone(), weights.clone()
    dist.all_reduce(highest, op=dist.ReduceOp.MAX)  # the largest value of each weight...
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN)   # ...and the smallest, over the ranks
    metrics.log(step, replica_gap=(highest - lowest).max())  # 0: every rank holds the same
    if args.comm_hook == "powersgd":
        _, before, after = powersgd.compression_stats()  # numbers it all-reduced, and would have
        metrics.log(step, powersgd_numel_before=before, powersgd_numel_after=after,
                    powersgd_start=powersgd.start_powerSGD_iter)  # the steps it did not compress
if master:
    print(f"{step} steps in {time.perf_counter() - start:.1f} s; comm hook {args.comm_hook}, "
          f"buckets of {args.bucket_cap_mb:g} MB")
if ddp:
    dist.destroy_process_group()
