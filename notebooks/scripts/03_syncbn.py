"""Lesson 03: the lesson-02 DDP loop, with BatchNorm statistics synchronised over the ranks.

Run it:  torchrun --standalone --nproc-per-node=2 scripts/03_syncbn.py --synthetic --epochs 1
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset

from labkit import metrics, syncbn
from labkit.data import get_datasets
from labkit.models import SmallResNet

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--epochs", type=int, default=5)
parser.add_argument("--batch-size", type=int, default=8, help="per rank: small, as with big images")
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--width", type=int, default=32, help="channels of the first block")
parser.add_argument("--norm", choices=["batch", "group"], default="batch",
                    help="group: GroupNorm, no statistics shared across a batch (lesson 02's proof)")
parser.add_argument("--sync-bn", choices=["auto", "torch", "labkit", "none"], default="auto",
                    help="auto: nn.SyncBatchNorm on GPUs, labkit.syncbn on CPU; none: per-rank BN")
parser.add_argument("--train-size", type=int, default=None, help="use a subset of this many images")
parser.add_argument("--test-size", type=int, default=None)
parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
parser.add_argument("--log-every", type=int, default=10, help="steps between metrics lines")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--data-dir", default="data")
parser.add_argument("--synthetic", action="store_true", help="the synthetic set, no CIFAR-10")
parser.add_argument("--save", default=None, help="rank 0 saves the trained weights here")
args = parser.parse_args()

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
master = rank == 0  # rank 0 alone prints summaries and saves files

torch.manual_seed(args.seed)  # same initial weights everywhere (DDP also broadcasts rank 0's)
# No random crops or flips: we compare runs at different world sizes, and each would draw
# its own for the same image. Lesson 01 trains with them; here the batches must match.
data = get_datasets(args.data_dir, synthetic=args.synthetic, train_size=args.train_size,
                    test_size=args.test_size, seed=args.seed, augment=False)
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
test_shard = Subset(data.test, range(rank, len(data.test), world_size))  # no padding, no overlap
test_loader = DataLoader(test_shard, batch_size=256, num_workers=args.workers, pin_memory=pin)

model = SmallResNet(width=args.width, norm=args.norm)
sync_bn = {"auto": "torch" if device.type == "cuda" else "labkit"}.get(args.sync_bn, args.sync_bn)
if sync_bn == "torch":     # PyTorch's: CUDA kernels, NCCL; DDP refuses it on CPU
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
elif sync_bn == "labkit":  # lesson 03's: one differentiable all_reduce per layer, any backend
    model = syncbn.convert_sync_batchnorm(model)
model = model.to(device)  # convert, move, THEN wrap: DDP checks and hooks what it is given
if ddp:
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
if master:
    bn_batch = args.batch_size * (world_size if sync_bn != "none" else 1)
    print(f"BatchNorm ({sync_bn}): statistics over {bn_batch} samples, {args.batch_size} per rank")
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)


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


step = 0
window_loss = torch.zeros((), device=device)  # summed on the device: no sync per step
for epoch in range(args.epochs):
    sampler.set_epoch(epoch)  # without it, every epoch repeats the same order
    order = tuple(list(iter(sampler))[:16])  # this rank's first samples this epoch
    metrics.log(step, epoch=epoch, order_fingerprint=hash(order) % 1_000_000_007)
    epoch_start = time.perf_counter()
    for x, y in train_loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)  # frees the old gradients instead of writing zeros
        loss.backward()  # DDP all-reduces the gradients here, bucket by bucket, overlapped
        optimizer.step()
        window_loss += loss.detach()
        step += 1
        if step % args.log_every == 0:
            # .item() waits for the device to finish: a sync point, once per window,
            # so the time metrics.log stamps is when this window's work really ended.
            metrics.log(step, loss=(window_loss / args.log_every).item(),
                        samples=args.log_every * args.batch_size, epoch=epoch,
                        bn_allreduces=sum(syncbn.allreduce_counts().values()))  # labkit.syncbn's, so far
            window_loss.zero_()
    accuracy = evaluate()
    mean_loss = loss.detach().clone()
    if ddp:
        dist.all_reduce(mean_loss)  # a sum (older gloo has no average)...
        mean_loss /= world_size     # ...so divide by the number of ranks
    metrics.log(step, test_acc=accuracy, epoch=epoch)
    if master:
        print(f"epoch {epoch}: {step} steps, last loss {mean_loss.item():.3f} (mean of ranks), "
              f"test accuracy {accuracy:.1%}, {time.perf_counter() - epoch_start:.1f} s")

if master and args.save:
    torch.save(model.module.state_dict() if ddp else model.state_dict(), args.save)  # unwrapped
if ddp:
    dist.destroy_process_group()
