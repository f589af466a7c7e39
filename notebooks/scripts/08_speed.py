"""Lesson 08: lesson 07's profiled DDP loop, with the knobs that make a step cheaper or hide its waits.

Run it:  torchrun --standalone --nproc-per-node=2 scripts/08_speed.py --synthetic --precision bf16
"""
import argparse
import multiprocessing
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, record_function, schedule
from torch.utils.data import DataLoader, Dataset, DistributedSampler

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
# --- lesson 08's knobs: cheaper maths, fewer kernels, a loader that hides the disk -------
parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32",
                    help="autocast's dtype (fp16 with a GradScaler: GPUs only)")
parser.add_argument("--compile", default=None, metavar="BACKEND",
                    help="torch.compile the model with this backend (inductor, aot_eager)")
parser.add_argument("--data-delay-ms", type=float, default=0, help="a slow read: ms per image")
args = parser.parse_args()
if args.precision == "fp16" and not torch.cuda.is_available():
    parser.error("--precision fp16 needs a GPU: on a CPU, float16 is slow; use bf16")
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


class SlowRead(Dataset):
    """Each image takes `delay_ms` to arrive: a stand-in for files on a slow or remote disk."""

    def __init__(self, images, delay_ms: float):
        self.images, self.delay_s = images, delay_ms / 1000

    def __len__(self):
        return len(self.images)

    def __getitem__(self, index):
        time.sleep(self.delay_s)  # waiting, not computing: another process can wait instead
        return self.images[index]


train_set = SlowRead(data.train, args.data_delay_ms) if args.data_delay_ms else data.train
# Each rank takes its own 1/world_size of every epoch, reshuffled per epoch by set_epoch.
sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True,
                             seed=args.seed, drop_last=True)
# Pinned (page-locked) host memory lets the copy to the GPU run asynchronously;
# worker processes prepare the next batches while this one trains.
pin = device.type == "cuda"
train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True,
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
if args.compile:
    model = torch.compile(model, backend=args.compile)  # compiles at the first forward
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
amp_dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.precision]
# float16 cannot hold gradients below 6e-8: the scaler multiplies the loss before backward
# and divides the gradients after it, so that small ones do not round to zero.
scaler = torch.amp.GradScaler(device.type, enabled=args.precision == "fp16")


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

step, in_window, wait_s = 0, 0, 0.0
window_loss = torch.zeros((), device=device)  # summed on the device: no sync per step
start = time.perf_counter()
for epoch in range(args.epochs):
    sampler.set_epoch(epoch)  # without it, every epoch repeats the same order
    ready, first = time.perf_counter(), True
    for x, y in train_loader:
        waited = time.perf_counter() - ready  # waiting for this batch: nothing else to do
        wait_s += waited
        if first:  # the workers start here (and again every epoch, unless they persist)
            workers = sorted(p.pid for p in multiprocessing.active_children())  # this rank's
            metrics.log(step, epoch=epoch, first_batch_wait_s=waited,
                        worker_pids=" ".join(map(str, workers)) or "none")
            first = False
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with record_function("forward"), torch.autocast(device.type, amp_dtype, enabled=bool(amp_dtype)):
            logits = model(x)  # under autocast: in the format autocast chose for the last layer
            loss = F.cross_entropy(logits, y)
        optimizer.zero_grad(set_to_none=True)  # frees the old gradients instead of writing zeros
        with record_function("backward"):
            scaler.scale(loss).backward()  # DDP all-reduces each bucket here, as soon as it fills
        with record_function("optimizer"):
            scaler.step(optimizer)  # fp16: skipped if a gradient overflowed, and the scale shrinks
            scaler.update()
        window_loss += loss.detach()
        step, in_window = step + 1, in_window + 1
        if profiler:
            profiler.step()  # a step is over: the schedule decides what to record next
        if step == 1 or step % args.log_every == 0:  # step 1 alone: what its one-off costs are
            # .item() waits for the device to finish: a sync point, once per window,
            # so the time metrics.log stamps is when this window's work really ended.
            metrics.log(step, loss=(window_loss / in_window).item(), epoch=epoch,
                        samples=in_window * args.batch_size, data_wait_s=wait_s)
            if step == 1:  # and the evidence of the number format the forward ran in
                metrics.log(step, first_step_s=time.perf_counter() - start,
                            logits_dtype=str(logits.dtype).removeprefix("torch."))
            window_loss.zero_()
            in_window, wait_s = 0, 0.0
        ready = time.perf_counter()
if profiler:
    profiler.stop()

# --- what DDP, the hooks and the compiler counted ----------------------------------------
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
if args.precision == "fp16":
    metrics.log(step, loss_scale=scaler.get_scale())  # where the scaler settled
if args.compile:
    from torch._dynamo.utils import counters  # what torch.compile traced, and where it broke off
    metrics.log(step, graphs=counters["stats"]["unique_graphs"],
                graph_breaks=sum(counters["graph_break"].values()))
    if master:
        for reason, count in counters["graph_break"].items():  # the line that names the code
            lines = [line.strip() for line in reason.splitlines() if line.strip()]
            said = next((line for line in lines if line.startswith("Explanation")), lines[0])
            print(f"graph break (×{count}): {said}")
if device.type == "cuda":  # section 3: 64 MiB of images to the GPU, from pageable and pinned memory
    images = x.cpu().repeat(-(-2**24 // x.numel()), 1, 1, 1)  # the last batch, repeated
    for kind, source in (("pageable", images), ("pinned", images.pin_memory())):
        source.to(device, non_blocking=True)  # a first copy, not timed: the allocator's start-up
        torch.cuda.synchronize()
        copied = time.perf_counter()
        copy = source.to(device, non_blocking=True)
        held_s = time.perf_counter() - copied  # how long the call kept this process waiting
        running = not torch.cuda.current_stream().query()  # was the copy still going on then?
        torch.cuda.synchronize()
        metrics.log(step, copy=kind, copy_gbps=source.nbytes / (time.perf_counter() - copied) / 1e9,
                    copy_held_s=held_s, copy_running=running, copy_equal=torch.equal(copy.cpu(), images))
if master:
    print(f"{step} steps in {time.perf_counter() - start:.1f} s; {args.precision}, "
          f"comm hook {args.comm_hook}, buckets of {args.bucket_cap_mb:g} MB")
if ddp:
    dist.destroy_process_group()
