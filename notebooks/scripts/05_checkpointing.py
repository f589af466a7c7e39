"""Lesson 05: lesson 02's DDP loop, made to save its whole state and resume exactly.

Run it:  torchrun --standalone --nproc-per-node=2 scripts/05_checkpointing.py --synthetic --epochs 2
Fault drill: add --crash-at-step 30 and torchrun's --max-restarts=1; the restarted job resumes.
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from labkit import checkpoint, metrics
from labkit.data import get_datasets
from labkit.models import SmallResNet

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--epochs", type=int, default=5)
parser.add_argument("--batch-size", type=int, default=128, help="per rank")
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--width", type=int, default=32, help="channels of the first block")
parser.add_argument("--train-size", type=int, default=None, help="use a subset of this many images")
parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
parser.add_argument("--log-every", type=int, default=10, help="steps between metrics lines")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--data-dir", default="data")
parser.add_argument("--synthetic", action="store_true", help="the synthetic set, no CIFAR-10")
parser.add_argument("--ckpt-dir", default="checkpoints/05", help="where checkpoints go")
parser.add_argument("--ckpt-every", type=int, default=100, help="steps between checkpoints")
parser.add_argument("--save", default=None, help="rank 0 saves the final weights here")
parser.add_argument("--crash-at-step", type=int, default=None, help="fault drill: crash there")
parser.add_argument("--crash-rank", type=int, default=1, help="fault drill: the rank that crashes")
parser.add_argument("--naive-save", action="store_true", help="pitfall: every rank saves the wrapper")
parser.add_argument("--forget-sampler", action="store_true", help="pitfall: resume without the sampler")
args = parser.parse_args()

ddp = "RANK" in os.environ
rank = int(os.environ.get("RANK", 0))
local_rank = int(os.environ.get("LOCAL_RANK", 0))
world_size = int(os.environ.get("WORLD_SIZE", 1))
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))  # torchrun counts restarts
if torch.cuda.is_available():
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
else:
    device = torch.device("cpu")
if ddp:
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
master = rank == 0

torch.manual_seed(args.seed)  # the same initial weights on every rank
# No augmentation in DataLoader workers: their RNG streams live in other processes and
# cannot be checkpointed. We flip images on the device instead, from streams we do save.
data = get_datasets(args.data_dir, synthetic=args.synthetic, train_size=args.train_size,
                    test_size=1, seed=args.seed, augment=False)  # no evaluation here
if master:
    print(data.description)


class ResumableSampler(DistributedSampler):
    """A DistributedSampler that can start part-way through an epoch: skip `start` samples."""
    start = 0

    def __iter__(self):
        return iter(list(super().__iter__())[self.start:])

    def __len__(self):
        return super().__len__() - self.start


sampler = ResumableSampler(data.train, num_replicas=world_size, rank=rank, shuffle=True,
                           seed=args.seed, drop_last=True)
# The loader gets its own generator: starting an iterator draws a seed from it, and a
# resumed epoch starts one more iterator than the uninterrupted run did.
train_loader = DataLoader(data.train, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                          num_workers=args.workers, persistent_workers=args.workers > 0,
                          pin_memory=device.type == "cuda", generator=torch.Generator())
steps_per_epoch = len(train_loader)
total_steps = args.epochs * steps_per_epoch

model = SmallResNet(width=args.width).to(device)
if ddp:
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
raw_model = model.module if ddp else model  # what we save: no "module." in the keys
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)
use_amp = device.type == "cuda"  # fp16 autocast needs a GradScaler; on CPU both are off
scaler = torch.amp.GradScaler(device.type, enabled=use_amp)
torch.manual_seed(args.seed + 1 + rank)  # each rank its own augmentation stream

# --- resume: every rank reads the newest complete checkpoint, if there is one -------------
step, epoch = 0, 0
latest = checkpoint.latest(args.ckpt_dir)
if latest is not None:
    state = torch.load(latest, map_location=device, weights_only=True)  # only tensors and plain types unpickle
    raw_model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    scaler.load_state_dict(state["scaler"])
    checkpoint.set_rng_state(state["rng"][rank])  # this rank's own streams
    step = state["step"]
    if not args.forget_sampler:
        epoch = state["epoch"]
        sampler.start = state["batch_in_epoch"] * args.batch_size  # the position in the epoch
    if master:
        print(f"resumed from {latest}: step {step}, epoch {epoch}, restart {restart}")
    metrics.log(step, resumed_from=state["step"])


def save_checkpoint(step: int, epoch: int, batch_in_epoch: int) -> None:
    rngs = [checkpoint.rng_state()] * world_size  # one process: its own streams
    if ddp:  # each rank has its own streams: rank 0 gathers them all
        dist.gather_object(rngs[0], rngs if master else None, dst=0)
    if master:
        state = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                 "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                 "step": step, "epoch": epoch, "batch_in_epoch": batch_in_epoch, "rng": rngs}
        checkpoint.save_atomic(state, checkpoint.step_path(args.ckpt_dir, step))
        checkpoint.prune(args.ckpt_dir, keep=2)  # the newest two: one survives a crash mid-save
    if ddp:
        dist.barrier()  # no rank goes on until the checkpoint is complete on disk


window_loss = torch.zeros((), device=device)
while step < total_steps:
    sampler.set_epoch(epoch)  # the epoch's shuffle; sampler.start skips what was done
    batch_in_epoch = sampler.start // args.batch_size
    for x, y in train_loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        flip = torch.rand(len(x), device=device) < 0.5  # augmentation from this rank's RNG
        x = torch.where(flip[:, None, None, None], x.flip(3), x)
        with torch.autocast(device.type, dtype=torch.float16, enabled=use_amp):
            loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        window_loss += loss.detach()
        step, batch_in_epoch = step + 1, batch_in_epoch + 1
        if step % args.log_every == 0:
            metrics.log(step, loss=(window_loss / args.log_every).item(), epoch=epoch,
                        samples=args.log_every * args.batch_size,
                        batch_fp=hash(tuple(y.tolist())) % 1_000_000_007)  # which data
            window_loss.zero_()
        if step == args.crash_at_step and rank == args.crash_rank and restart == 0:
            raise RuntimeError(f"fault drill: rank {rank} crashes at step {step}")
        if step % args.ckpt_every == 0:
            done = batch_in_epoch == steps_per_epoch  # an epoch ends: resume at the next one
            save_checkpoint(step, epoch + done, 0 if done else batch_in_epoch)
            if args.naive_save:  # the pitfall: every rank, the wrapper, no temporary file
                with open(os.path.join(args.ckpt_dir, "naive.pt"), "wb") as f:
                    torch.save(model.state_dict(), f)
                    metrics.log(step, naive_bytes_written=f.tell())
        if step == total_steps:
            break
    sampler.start, epoch = 0, epoch + 1

if master and args.save:
    checkpoint.save_atomic(raw_model.state_dict(), args.save)
if ddp:
    dist.destroy_process_group()
