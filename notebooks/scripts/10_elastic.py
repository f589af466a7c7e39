"""Lesson 10: lesson 05's script, made elastic: nodes may leave and join while it trains.

Run it on each node:  torchrun --nnodes=1:2 --nproc-per-node=1 --max-restarts=3 --rdzv-backend=c10d
    --rdzv-endpoint=<first node>:29500 --rdzv-id=job1 scripts/10_elastic.py --synthetic
"""
import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset

from labkit import checkpoint, metrics
from labkit.data import get_datasets
from labkit.models import SmallResNet

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--epochs", type=int, default=5)
parser.add_argument("--global-batch", type=int, default=256, help="all ranks, any world size")
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--width", type=int, default=32, help="channels of the first block")
parser.add_argument("--norm", choices=["batch", "group"], default="batch",
                    help="group: GroupNorm, no statistics shared across a batch (lesson 02's proof)")
parser.add_argument("--train-size", type=int, default=None, help="use a subset of this many images")
parser.add_argument("--test-size", type=int, default=None)
parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
parser.add_argument("--log-every", type=int, default=10, help="steps between metrics lines")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--data-dir", default="data")
parser.add_argument("--synthetic", action="store_true", help="the synthetic set, no CIFAR-10")
parser.add_argument("--save", default=None, help="rank 0 saves the trained weights here")
parser.add_argument("--ckpt-dir", default="checkpoints/05", help="where checkpoints go")
parser.add_argument("--ckpt-every", type=int, default=100, help="steps between checkpoints")
parser.add_argument("--crash-at-step", type=int, default=None, help="fault drill: crash there")
parser.add_argument("--crash-rank", type=int, default=1, help="fault drill: the rank that crashes")
parser.add_argument("--step-pause", type=float, default=0.0, help="seconds to rest after each step")
parser.add_argument("--timeout", type=float, default=600, help="seconds a collective may wait")
args = parser.parse_args()

# --- the distributed part: torchrun starts one process per device ------------------------
ddp = "RANK" in os.environ  # under plain `python` this is one process, no process group
rank = int(os.environ.get("RANK", 0))
local_rank = int(os.environ.get("LOCAL_RANK", 0))
world_size = int(os.environ.get("WORLD_SIZE", 1))
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))  # torchrun counts restarts
if torch.cuda.is_available():
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)  # before init: NCCL binds each rank to its own GPU
else:
    device = torch.device("cpu")
if ddp:
    # The timeout is how soon NCCL notices a dead peer; gloo notices a closed socket at once.
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=args.timeout))
master = rank == 0  # rank 0 alone prints summaries and saves files
# The world size can change between restarts; the global batch must not, so each rank's share does.
if args.global_batch % world_size:
    raise SystemExit(f"--global-batch {args.global_batch} does not split over {world_size} ranks")
batch_size = args.global_batch // world_size

torch.manual_seed(args.seed)  # same initial weights everywhere (DDP also broadcasts rank 0's)
# No augmentation in DataLoader workers: their RNG streams live in other processes and
# cannot be checkpointed. The loop flips images on the device instead, drawn from (seed, step).
data = get_datasets(args.data_dir, synthetic=args.synthetic, train_size=args.train_size,
                    test_size=args.test_size, seed=args.seed, augment=False)
if master:
    print(data.description)
    print(f"per-rank batch {batch_size} × {world_size} rank(s) = global batch {args.global_batch}")



class ResumableSampler(DistributedSampler):
    """A DistributedSampler that can start part-way through an epoch: skip `start` samples."""
    start = 0

    def __iter__(self):
        return iter(list(super().__iter__())[self.start:])

    def __len__(self):
        return super().__len__() - self.start


# Each rank takes its own 1/world_size of every epoch, reshuffled per epoch by set_epoch.
sampler = ResumableSampler(data.train, num_replicas=world_size, rank=rank, shuffle=True,
                           seed=args.seed, drop_last=True)
# Pinned (page-locked) host memory lets the copy to the GPU run asynchronously;
# worker processes prepare the next batches while this one trains.
pin = device.type == "cuda"
# Each loader gets its own generator: starting an iterator draws a seed from it, and a resumed
# run starts other iterators than the uninterrupted run did (one more training epoch, one
# evaluation fewer), which would shift every random number drawn after them.
train_loader = DataLoader(data.train, batch_size=batch_size, sampler=sampler, drop_last=True,
                          num_workers=args.workers, persistent_workers=args.workers > 0,
                          pin_memory=pin, generator=torch.Generator())
test_shard = Subset(data.test, range(rank, len(data.test), world_size))  # no padding, no overlap
test_loader = DataLoader(test_shard, batch_size=256, num_workers=args.workers, pin_memory=pin,
                         generator=torch.Generator())
steps_per_epoch = len(train_loader)
total_steps = args.epochs * steps_per_epoch

model = SmallResNet(width=args.width, norm=args.norm).to(device)  # on its device BEFORE wrapping
if ddp:
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
raw_model = model.module if ddp else model  # what we save: no "module." in the keys
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)
use_amp = device.type == "cuda"  # fp16 autocast needs a GradScaler; on CPU both are off
scaler = torch.amp.GradScaler(device.type, enabled=use_amp)


def evaluate() -> float:
    model.eval()  # BatchNorm uses its running statistics, not the batch's
    counts = torch.zeros(2, device=device)  # correct, total: on this rank's shard
    with torch.no_grad():
        for x, y in test_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            counts += torch.stack([(model(x).argmax(1) == y).sum(), torch.tensor(len(y), device=device)])
    if ddp:
        dist.all_reduce(counts)  # sum over ranks: the accuracy of the whole test set
    model.train()
    return (counts[0] / counts[1]).item()


# --- resume: every rank reads the newest complete checkpoint, if there is one -------------
step, epoch = 0, 0
latest = checkpoint.latest(args.ckpt_dir)
if latest is not None:
    state = torch.load(latest, map_location=device, weights_only=True)  # only tensors and plain types unpickle
    raw_model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    scaler.load_state_dict(state["scaler"])
    step, epoch = state["step"], state["epoch"]
    sampler.start = state["batch_in_epoch"] * batch_size  # the position in the epoch
    if master:
        print(f"resumed from {latest}: step {step}, epoch {epoch}, restart {restart}, "
              f"{world_size} rank(s) now")
    metrics.log(step, resumed_from=state["step"])


def save_checkpoint(step: int, epoch: int, batch_in_epoch: int) -> None:
    # No per-rank RNG streams: the ranks of the next attempt may be fewer, or more.
    if master:
        state = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                 "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                 "step": step, "epoch": epoch, "batch_in_epoch": batch_in_epoch}
        checkpoint.save_atomic(state, checkpoint.step_path(args.ckpt_dir, step))
        metrics.log(step, checkpoint_saved=step)
        checkpoint.prune(args.ckpt_dir, keep=2)  # the newest two: a fallback if the newest is damaged
    # Every rank's lines up to this step reach the disk with the checkpoint: a node killed
    # later loses only lines of steps the next round does again.
    metrics.flush()
    if ddp:
        dist.barrier()  # no rank goes on until the checkpoint is complete on disk


window_loss = torch.zeros((), device=device)  # summed on the device: no sync per step
while step < total_steps:  # a resumed run starts part-way: count steps, not epochs
    sampler.set_epoch(epoch)  # the epoch's shuffle; sampler.start skips what was done
    order = tuple(list(iter(sampler))[:16])  # this rank's first samples this epoch
    metrics.log(step, epoch=epoch, order_fingerprint=hash(order) % 1_000_000_007)
    epoch_start = time.perf_counter()
    batch_in_epoch = sampler.start // batch_size
    for x, y in train_loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        # Augmentation drawn for the whole global batch from (seed, step), then this rank's
        # share (the sampler deals samples round-robin): the same flips for any world size.
        draw = torch.Generator(device).manual_seed(args.seed * 1_000_003 + step)
        flips = torch.rand(args.global_batch, generator=draw, device=device) < 0.5
        flip = flips[rank::world_size]
        x = torch.where(flip[:, None, None, None], x.flip(3), x)
        with torch.autocast(device.type, dtype=torch.float16, enabled=use_amp):
            loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)  # frees the old gradients instead of writing zeros
        scaler.scale(loss).backward()  # DDP all-reduces the gradients here, bucket by bucket
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        window_loss += loss.detach()
        step, batch_in_epoch = step + 1, batch_in_epoch + 1
        if step % args.log_every == 0:
            # .item() waits for the device to finish: a sync point, once per window,
            # so the time metrics.log stamps is when this window's work really ended.
            metrics.log(step, loss=(window_loss / args.log_every).item(),
                        samples=args.log_every * batch_size, epoch=epoch,
                        batch_fp=hash(tuple(y.tolist())) % 1_000_000_007)  # which data
            window_loss.zero_()
            metrics.flush()  # on disk now: a node killed next keeps this step's line, to compare
        if step == args.crash_at_step and rank == args.crash_rank and restart == 0:
            raise RuntimeError(f"fault drill: rank {rank} crashes at step {step}")
        if step % args.ckpt_every == 0:
            done = batch_in_epoch == steps_per_epoch  # an epoch ends: resume at the next one
            save_checkpoint(step, epoch + done, 0 if done else batch_in_epoch)
        time.sleep(args.step_pause)
        if step == total_steps:
            break
    accuracy = evaluate()
    mean_loss = loss.detach().clone()
    if ddp:
        dist.all_reduce(mean_loss)  # a sum (older gloo has no average)...
        mean_loss /= world_size     # ...so divide by the number of ranks
    metrics.log(step, test_acc=accuracy, epoch=epoch)
    if master:
        print(f"epoch {epoch}: {step} steps, last loss {mean_loss.item():.3f} (mean of ranks), "
              f"test accuracy {accuracy:.1%}, {time.perf_counter() - epoch_start:.1f} s")
    sampler.start, epoch = 0, epoch + 1

if master and args.save:
    checkpoint.save_atomic(raw_model.state_dict(), args.save)  # unwrapped, atomic
if ddp:
    dist.destroy_process_group()
