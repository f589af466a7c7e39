"""Lesson 05, part 2: activation checkpointing. Measure the memory it saves and the compute it costs.

Run it:  python scripts/05_activations.py --width 8 --batch-sizes 16,32
(one process is enough; under torchrun every rank measures the same thing on its own device)
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from labkit import memory, metrics
from labkit.models import SmallResNet

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--width", type=int, default=32, help="channels of the first block")
parser.add_argument("--batch-sizes", default="64,128,256", help="comma-separated")
parser.add_argument("--share", type=float, default=0.2,
                    help="checkpoint every block that holds at least this share of the saved bytes")
parser.add_argument("--repeats", type=int, default=10, help="timed steps per measurement")
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()
batch_sizes = [int(b) for b in args.batch_sizes.split(",")]

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(args.seed)
model = SmallResNet(width=args.width).to(device)
print(f"device: {device}, threads: {torch.get_num_threads()}, batch sizes: {batch_sizes}")


def batch(n: int):
    gen = torch.Generator().manual_seed(n)  # the same batch for both modes
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


def step(x, y):
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()


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
    with memory.SavedTensorMeter(exclude=model) as meter:
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    found = dict(saved_bytes=meter.bytes, held_after_backward=meter.held_bytes(),
                 forwards=",".join(map(str, forwards)),
                 bn_updates=",".join(str(int(bn.num_batches_tracked) - s)
                                     for bn, s in zip(norms, seen)),
                 grads=[p.grad.clone() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    sync()
    memory.reset_cuda_peak(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    step(x, y)  # also a warm-up for the timing below
    peak = memory.cuda_peak_bytes(device)
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
        print(f"batch {n:4d}, checkpointing {mode:3s}: {found[mode]['saved_bytes'] / 2**20:7.2f} MiB "
              f"saved for backward, step {statistics.median(t) * 1e3:6.1f} ms (median of {len(t)})")
        row += 1
    metrics.log(row, batch=n, grad_max_diff=diff)  # the same maths, recomputed
