"""Lesson 05, part 2: activation checkpointing under DDP (or FSDP2). The memory it saves, the compute it costs.

Run it:  torchrun --standalone --nproc-per-node=2 scripts/05_activations.py --width 8 --batch-sizes 16,32
(lesson 06 runs it with --strategy fsdp; under plain `python` it measures one process)
"""
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from labkit import memory, metrics
from labkit.models import SmallResNet

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--width", type=int, default=32, help="channels of the first block")
parser.add_argument("--batch-sizes", default="64,128,256", help="comma-separated")
parser.add_argument("--share", type=float, default=0.2,
                    help="checkpoint every block that holds at least this share of the saved bytes")
parser.add_argument("--repeats", type=int, default=10, help="timed steps per measurement")
parser.add_argument("--train-steps", type=int, default=3, help="SGD steps each way, to compare the training")
parser.add_argument("--strategy", choices=["ddp", "fsdp"], default="ddp", help="under torchrun")
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()
batch_sizes = [int(b) for b in args.batch_sizes.split(",")]

ddp = "RANK" in os.environ  # under torchrun: one process per device, as in training
rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
if device.type == "cuda":
    torch.cuda.set_device(device)
if ddp:
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
torch.manual_seed(args.seed)
model = SmallResNet(width=args.width).to(device)
if rank == 0:
    print(f"device: {device}, threads: {torch.get_num_threads()}, batch sizes per rank: {batch_sizes}")


def batch(n: int, salt: int = 0):
    gen = torch.Generator().manual_seed(1000 * n + 100 * salt + rank)  # the same for both modes
    return (torch.randn(n, 3, 32, 32, generator=gen).to(device),
            torch.randint(0, 10, (n,), generator=gen).to(device))


# --- 1. where is the memory? Bytes each part of the model saves for backward --------------
parts = {"stem": model.stem, **{f"block{i}": b for i, b in enumerate(model.blocks)},
         "head": model.head}
x, y = batch(batch_sizes[0])
with memory.SavedTensorMeter(exclude=model, modules=parts) as meter:
    loss = F.cross_entropy(model(x), y)
loss.backward()
census = meter.by_module
heavy = [i for i in range(len(model.blocks)) if census[f"block{i}"] >= args.share * meter.bytes]
if rank == 0:  # every rank counts the same: the same model, batches of the same size
    for name, nbytes in census.items():
        print(f"  {name:7s} saves {nbytes / 2**20:7.2f} MiB ({nbytes / meter.bytes:5.1%})")
    print(f"checkpointing blocks {heavy}: each holds at least {args.share:.0%} of the saved bytes")
metrics.log(0, **{f"census_{name}": nbytes for name, nbytes in census.items()},
            census_total=meter.bytes, heavy=",".join(map(str, heavy)))


# --- 2. the switch: a wrapper that recomputes its block in backward when enabled ----------
class Checkpointed(nn.Module):
    """Runs `block` under activation checkpointing when `enabled`."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block, self.enabled = block, False

    def forward(self, x):
        if self.enabled:  # keep only x; recompute the block's activations during backward
            return checkpoint(self.block, x, use_reentrant=False)
        return self.block(x)


norms = [block.bn1 for block in model.blocks]  # BatchNorm counts the batches it has seen
for i in heavy:
    model.blocks[i] = Checkpointed(model.blocks[i])
# Count the forward passes each block starts, recomputation included. A *pre*-hook: the
# recomputation stops as soon as it has rebuilt what backward needs, before the block returns.
forwards = [0] * len(model.blocks)
for i in range(len(model.blocks)):
    inner = model.blocks[i].block if i in heavy else model.blocks[i]
    inner.register_forward_pre_hook(lambda *_, i=i: forwards.__setitem__(i, forwards[i] + 1))
net = model  # what runs a step: the model, inside DDP, or sharded in place by FSDP2
if ddp and args.strategy == "fsdp":
    for block in model.blocks:  # each block its own unit, checkpointed or not (lesson 06)
        fully_shard(block)
    fully_shard(model)
elif ddp:
    net = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)


def step(x, y):
    model.zero_grad(set_to_none=True)
    F.cross_entropy(net(x), y).backward()


def sync():
    if device.type == "cuda":
        torch.cuda.synchronize()  # time the GPU's work, not the launch of it


# --- 3. with and without, at each batch size ----------------------------------------------
def use_checkpointing(on: bool) -> None:
    for i in heavy:
        model.blocks[i].enabled = on


def measure(x, y, on: bool) -> dict:
    """One step with checkpointing on or off: what it held for backward, and what it ran."""
    use_checkpointing(on)
    model.zero_grad(set_to_none=True)  # backward adds to .grad: start from nothing
    forwards[:] = [0] * len(forwards)
    seen = [int(bn.num_batches_tracked) for bn in norms]
    with memory.SavedTensorMeter(exclude=model) as meter:  # parameters, gathered ones too, are not counted
        loss = F.cross_entropy(net(x), y)
    loss.backward()
    found = dict(saved_bytes=meter.bytes, held_after_backward=meter.held_bytes(),
                 forwards=",".join(map(str, forwards)),
                 bn_updates=",".join(str(int(bn.num_batches_tracked) - s)
                                     for bn, s in zip(norms, seen)),
                 grads=[memory.local_tensor(p.grad).clone() for p in model.parameters()])  # this rank's
    model.zero_grad(set_to_none=True)
    sync()
    # On a GPU, the allocator's own count: its peak during the forward pass (when all that
    # backward needs is held), then its peak over the whole step, backward included.
    memory.reset_cuda_peak(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    loss = F.cross_entropy(net(x), y)  # also a warm-up for the timing below
    in_forward = memory.cuda_peak_bytes(device)
    loss.backward()
    peak = memory.cuda_peak_bytes(device)
    found["forward_peak_cuda_bytes"] = None if peak is None else in_forward - base
    found["peak_cuda_bytes"] = None if peak is None else peak - base
    return found


def time_steps(x, y) -> dict:
    """Seconds per training step, `--repeats` of each mode, interleaved."""
    times = {"off": [], "on": []}
    for _ in range(args.repeats):  # interleaved: a slow spell of the machine hits both modes
        for mode in ("off", "on"):
            use_checkpointing(mode == "on")
            sync()
            start = time.perf_counter()
            step(x, y)
            sync()
            times[mode].append(time.perf_counter() - start)
    return times


row = 0
for n in batch_sizes:
    x, y = batch(n)
    found = {mode: measure(x, y, on=mode == "on") for mode in ("off", "on")}
    times = time_steps(x, y)
    diff = max((a - b).abs().max().item()
               for a, b in zip(found["off"].pop("grads"), found["on"].pop("grads")))
    for mode in ("off", "on"):
        t = times[mode]
        metrics.log(row, batch=n, mode=mode, **found[mode], step_time_s=statistics.median(t),
                    step_time_min_s=min(t), step_time_max_s=max(t))
        if rank == 0:
            print(f"batch {n:4d}, checkpointing {mode:3s}: {found[mode]['saved_bytes'] / 2**20:7.2f} MiB "
                  f"saved for backward, step {statistics.median(t) * 1e3:6.1f} ms (median of {len(t)})")
        row += 1
    metrics.log(row, batch=n, grad_max_diff=diff)  # the same maths, recomputed


# --- 4. equal training: a few SGD steps each way, from the same weights ------------------
start = [memory.local_tensor(t).clone() for t in model.state_dict().values()]
for mode in ("off", "on"):
    for t, saved in zip(model.state_dict().values(), start):  # back to the same weights and buffers
        memory.local_tensor(t).copy_(saved)
    use_checkpointing(mode == "on")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for s in range(args.train_steps):
        x, y = batch(batch_sizes[0], salt=s + 1)
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        optimizer.step()
        metrics.log(s, trained=mode, train_loss=loss.item())
if ddp:
    dist.destroy_process_group()
