"""Lesson 06: lesson 02's loop with the model sharded by FSDP2 (or replicated by DDP, to compare).

Run it:  torchrun --standalone --nproc-per-node=2 scripts/06_fsdp.py --synthetic --epochs 1 --strategy fsdp
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_state_dict)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset

from labkit import checkpoint, memory, metrics
from labkit.data import get_datasets
from labkit.models import MLPStack

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--strategy", choices=["fsdp", "ddp"], default="fsdp")
parser.add_argument("--epochs", type=int, default=5)
parser.add_argument("--batch-size", type=int, default=128, help="per rank")
parser.add_argument("--lr", type=float, default=1e-3, help="AdamW's")
parser.add_argument("--dim", type=int, default=1024, help="width of the MLP stack")
parser.add_argument("--depth", type=int, default=8, help="blocks in the MLP stack")
parser.add_argument("--train-size", type=int, default=None, help="use a subset of this many images")
parser.add_argument("--test-size", type=int, default=None)
parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
parser.add_argument("--log-every", type=int, default=10, help="steps between metrics lines")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--data-dir", default="data")
parser.add_argument("--synthetic", action="store_true", help="the synthetic set, no CIFAR-10")
parser.add_argument("--bf16", action="store_true", help="FSDP mixed precision: bf16 compute, fp32 reduce")
parser.add_argument("--save-dcp", default=None, help="save a sharded checkpoint (a folder) at the end")
parser.add_argument("--load-dcp", default=None, help="start from a sharded checkpoint, any world size")
parser.add_argument("--naive-save", default=None, help="pitfall: rank 0 torch.saves model.state_dict()")
parser.add_argument("--clip-norm", type=float, default=None, help="clip the gradient's norm to this")
args = parser.parse_args()
if args.bf16 and args.strategy != "fsdp":
    parser.error("--bf16 sets FSDP's mixed-precision policy; use it with --strategy fsdp")

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
fsdp = ddp and args.strategy == "fsdp"  # distributed, and sharded rather than replicated

torch.manual_seed(args.seed)  # same initial weights everywhere (DDP also broadcasts rank 0's)
# No random crops or flips: DDP and FSDP must train on the very same batches.
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
# The same number of test images on every rank (the last few left out): under FSDP every
# forward all-gathers, so a rank with one batch more would wait for the others for ever.
test_shard = Subset(data.test, range(rank, len(data.test) // world_size * world_size, world_size))
test_loader = DataLoader(test_shard, batch_size=256, num_workers=args.workers, pin_memory=pin)



def build(seed: int):
    """The model, replicated (DDP) or sharded (FSDP2), and its optimizer."""
    torch.manual_seed(seed)  # the same initial weights for DDP and FSDP
    model = MLPStack(dim=args.dim, depth=args.depth).to(device)
    if fsdp:
        # bf16 copies of the weights for forward and backward; gradients reduced in fp32.
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if args.bf16 else None,
                                  reduce_dtype=torch.float32 if args.bf16 else None)
        for block in model.blocks:  # each block its own unit: gathered just before it runs
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)  # the root last: stem and head, and the step's hooks
    elif ddp:  # gradients as views into DDP's buckets: no second copy of them
        model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None,
                    gradient_as_bucket_view=True)
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr)


def load_and_check(model, optimizer, path: str, step: int) -> None:
    """Read a DCP checkpoint (saved at any world size); compare it with the gathered copy."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)  # each rank reads the pieces its own shards need
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if master:  # full_state_dict gathers every tensor onto rank 0 only
        expected = torch.load(f"{path}.full.pt", map_location="cpu", weights_only=True)
        mismatched = [k for k in expected if not torch.equal(expected[k], full[k])]
        print(f"loaded {path} on {world_size} rank(s): {len(expected) - len(mismatched)} of "
              f"{len(expected)} tensors equal the saved model's")
        metrics.log(step, dcp_world_size=world_size, dcp_tensors=len(expected),
                    dcp_mismatched=len(mismatched))


model, optimizer = build(args.seed)
blocks = (model.module if isinstance(model, DDP) else model).blocks
fc1 = blocks[0].fc1  # one weight to look at
shard = memory.local_tensor(fc1.weight)
print(f"rank {rank}: blocks.0.fc1.weight is a {type(fc1.weight).__name__} of shape "
      f"{tuple(fc1.weight.shape)}; this rank holds {tuple(shard.shape)} ({shard.dtype})")
metrics.log(0, shard_rows=shard.shape[0], full_rows=fc1.weight.shape[0], shard_dtype=str(shard.dtype))
seen = {"gathered_bytes": 0}  # observed as each block starts, after FSDP has gathered it


def observe(block, args) -> None:  # FSDP swaps a gathered weight in as a plain tensor
    whole = [p for p in model.parameters() if not isinstance(p, DTensor)]
    seen["gathered_bytes"] = max(seen["gathered_bytes"], memory.tensor_bytes(whole))
    seen["compute_dtype"] = str(block.fc1.weight.dtype)  # what the layer computes with


for block in blocks:
    block.register_forward_pre_hook(observe)
if args.load_dcp:
    load_and_check(model, optimizer, args.load_dcp, step=0)


def evaluate() -> float:
    model.eval()  # no dropout or BatchNorm in this model, but the habit costs nothing
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
memory.reset_cuda_peak(device)
for epoch in range(args.epochs):
    sampler.set_epoch(epoch)  # without it, every epoch repeats the same order
    order = tuple(list(iter(sampler))[:16])  # this rank's first samples this epoch
    metrics.log(step, epoch=epoch, order_fingerprint=hash(order) % 1_000_000_007)
    epoch_start = time.perf_counter()
    for x, y in train_loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = F.cross_entropy(model(x), y)  # FSDP all-gathers each block's shards as it runs
        optimizer.zero_grad(set_to_none=True)  # frees the old gradients instead of writing zeros
        loss.backward()  # FSDP reduce-scatters gradients: each rank keeps only its shard's
        if args.clip_norm is not None:  # FSDP: the norm of DTensor gradients, all ranks' shards together
            mine = torch.linalg.vector_norm(torch.stack([memory.local_tensor(p.grad).norm() for p in model.parameters()]))
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_norm)
        optimizer.step()  # each rank updates its own shard (and its own optimizer state)
        window_loss += loss.detach()
        step += 1
        if step == 1:  # gradients and optimizer state exist now: count what this rank holds
            held = memory.model_bytes(model, optimizer)
            metrics.log(step, param_bytes=held.params, grad_bytes=held.grads,
                        optim_bytes=held.optimizer, **seen)
        if step % args.log_every == 0:
            # .item() waits for the device to finish: a sync point, once per window,
            # so the time metrics.log stamps is when this window's work really ended.
            clip = {} if args.clip_norm is None else {  # the norm the clip saw, and this rank's shards' alone
                "grad_norm": (grad_norm.full_tensor() if fsdp else grad_norm).item(),
                "shard_norm": mine.item()}
            metrics.log(step, loss=(window_loss / args.log_every).item(),
                        samples=args.log_every * args.batch_size, epoch=epoch, **clip)
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

metrics.log(step, peak_cuda_bytes=memory.cuda_peak_bytes(device))  # None on CPU

if args.naive_save and master:  # the pitfall: under FSDP this holds rank 0's shards only
    torch.save(model.state_dict(), args.naive_save)
if args.save_dcp:
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=args.save_dcp)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if master:  # a gathered, ordinary copy of the weights: what the loads are checked against
        checkpoint.save_atomic(full, f"{args.save_dcp}.full.pt")
    fresh_model, fresh_optimizer = build(args.seed + 1)  # other weights, overwritten by the load
    load_and_check(fresh_model, fresh_optimizer, args.save_dcp, step)
if ddp:
    dist.destroy_process_group()
