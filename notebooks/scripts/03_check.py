"""Lesson 03 check: BatchNorm synchronised over W ranks, batch B each = BatchNorm on one process, batch W·B.

Run it:  torchrun --standalone --nproc-per-node=2 scripts/03_check.py
"""
import argparse
import os
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from labkit import metrics, syncbn

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--batch-size", type=int, default=4, help="per rank")
parser.add_argument("--channels", type=int, default=8)
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

local_rank = int(os.environ.get("LOCAL_RANK", 0))
device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
if device.type == "cuda":
    torch.cuda.set_device(device)
dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
master = rank == 0

# The same global batch on every rank (same seed), and a fixed upstream gradient, as from a loss.
gen = torch.Generator().manual_seed(args.seed)
shape = (world_size * args.batch_size, args.channels, 8, 8)
x = (torch.randn(shape, generator=gen) * 2 + 0.5).to(device)
grad_y = torch.randn(shape, generator=gen).to(device)
mine = slice(rank * args.batch_size, (rank + 1) * args.batch_size)  # this rank's slice

# The reference: plain BatchNorm in ONE process on the WHOLE batch (each rank computes it).
reference = nn.BatchNorm2d(args.channels).to(device)
x_all = x.clone().requires_grad_()
y_all = reference(x_all)
y_all.backward(grad_y)


def gaps(layer: nn.Module) -> dict:
    """Largest differences from the reference, over every rank, for one training step + eval."""
    x_mine = x[mine].clone().requires_grad_()
    y = layer(x_mine)
    y.backward(grad_y[mine])
    shares = torch.cat([layer.weight.grad, layer.bias.grad])
    dist.all_reduce(shares)  # each rank holds its share of dW and db: their sum is the whole
    layer.eval(), reference.eval()
    issued = sum(syncbn.allreduce_counts().values())
    with torch.no_grad():
        eval_gap = (layer(x[mine]) - reference(x[mine])).abs().max()
    eval_allreduces = sum(syncbn.allreduce_counts().values()) - issued  # eval uses running stats
    layer.train(), reference.train()
    found = torch.stack([
        (y - y_all[mine]).abs().max(),
        (x_mine.grad - x_all.grad[mine]).abs().max(),
        (shares - torch.cat([reference.weight.grad, reference.bias.grad])).abs().max(),
        (layer.running_mean - reference.running_mean).abs().max(),
        (layer.running_var - reference.running_var).abs().max(),
        eval_gap,
        torch.tensor(float(eval_allreduces), device=device)])
    dist.all_reduce(found, op=dist.ReduceOp.MAX)  # the worst rank
    names = ["output", "input_grad", "weight_bias_grad", "running_mean", "running_var", "eval_output", "eval_allreduces"]
    return dict(zip(names, found.tolist()))


class ForwardOnlySync(syncbn.SyncBatchNorm):
    """The classic mistake: the same sums, all-reduced by a plain dist.all_reduce."""

    def sum_over_ranks(self, local):
        dist.all_reduce(local)  # in place: autograd never learns that other ranks took part
        return local


layers = {"per-rank nn.BatchNorm2d": nn.BatchNorm2d(args.channels),  # the problem: must NOT match
          "mistake: forward-only sync": ForwardOnlySync(args.channels),
          "labkit.syncbn.SyncBatchNorm": syncbn.SyncBatchNorm(args.channels)}
if device.type == "cuda":
    layers["nn.SyncBatchNorm"] = nn.SyncBatchNorm(args.channels)
else:
    try:  # PyTorch's own, on CPU ranks: DDP refuses it when it wraps the model
        DDP(nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(args.channels))))
    except ValueError as err:
        metrics.log(0, torch_syncbn_on_cpu=f"{type(err).__name__}: {err}")
        if master:
            print(f"nn.SyncBatchNorm under DDP on CPU -> {type(err).__name__}: {err}")
for name, layer in layers.items():
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        found = gaps(layer.to(device))
    said = "; ".join(sorted({". ".join(str(w.message).split(". ")[:2]) + "." for w in warned}))
    metrics.log(0, layer=name, batch_per_rank=args.batch_size, torch_warned=said, **found)
    if master:
        print(f"{name:>28}: largest gap " + ", ".join(f"{k} {v:.1e}" for k, v in found.items())
              + (f"\n{'':>30}(PyTorch warned: {said})" if said else ""))

# Per-rank BatchNorm under DDP: how far each rank's running mean is from rank 0's, after a
# training forward on its own slice, then after the first eval() forward that follows it.
ddp_bn = DDP(nn.BatchNorm2d(args.channels).to(device),
             device_ids=[local_rank] if device.type == "cuda" else None)
spread = []
for mode in ("train", "eval"):
    ddp_bn.train(mode == "train")
    with torch.set_grad_enabled(mode == "train"):
        ddp_bn(x[mine])
    running = ddp_bn.module.running_mean.clone()
    rank0 = running.clone()
    dist.broadcast(rank0, src=0)
    spread.append((running - rank0).abs().max())
spread = torch.stack(spread)
dist.all_reduce(spread, op=dist.ReduceOp.MAX)  # the rank furthest from rank 0
metrics.log(0, ddp_buffers_after_train=spread[0].item(), ddp_buffers_after_eval=spread[1].item())
dist.destroy_process_group()
