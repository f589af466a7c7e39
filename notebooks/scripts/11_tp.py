"""Lesson 11: lesson 06's MLP stack on several ranks: data parallel (DDP, FSDP), tensor parallel
(each block's matrices split; with sequence parallel, the rows between them too), or FSDP and
tensor parallel together on a 2-D mesh.

Run it:  torchrun --standalone --nproc-per-node=2 scripts/11_tp.py --strategy tp
"""
import argparse
import contextlib
import logging
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel, parallelize_module)
from torch.nn.parallel import DistributedDataParallel as DDP

from labkit import comm, memory, metrics
from labkit.models import MLPStack

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--strategy", choices=["none", "ddp", "fsdp", "tp", "tp+sp", "fsdp+tp"], default="tp")
parser.add_argument("--tp", type=int, default=2, help="fsdp+tp: ranks in a tensor-parallel group")
parser.add_argument("--dim", type=int, default=256, help="width of the MLP stack")
parser.add_argument("--depth", type=int, default=4, help="blocks in the MLP stack")
parser.add_argument("--batch-size", type=int, default=32, help="global: data-parallel ranks split it")
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--data-batches", type=int, default=8, help="the data set: this many batches")
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--bf16", action="store_true", help="autocast to bfloat16: half the bytes to send")
parser.add_argument("--out", default=os.environ.get(metrics.RUN_DIR_ENV, "."),
                    help="folder for grads_rank<R>.pt and weights_rank<R>.pt (default: run folder)")
args = parser.parse_args()

# --- ranks and the device mesh ------------------------------------------------------------
rank = int(os.environ.get("RANK", 0))
local_rank = int(os.environ.get("LOCAL_RANK", 0))
world_size = int(os.environ.get("WORLD_SIZE", 1))
if torch.cuda.is_available():
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
else:
    device = torch.device("cpu")
tp = {"none": 1, "ddp": 1, "fsdp": 1, "tp": world_size, "tp+sp": world_size, "fsdp+tp": args.tp}[args.strategy]
dp = world_size // tp  # data-parallel ranks: each its own slice of the batch
if args.strategy == "none" and world_size > 1:
    parser.error(f"--strategy none is one process, but WORLD_SIZE is {world_size}: launch 1 rank")
if dp * tp != world_size:
    parser.error(f"dp({dp}) * tp({tp}) != WORLD_SIZE({world_size}): --tp must divide the ranks")
if 4 * args.dim % tp:
    parser.error(f"each block's hidden width 4*dim ({4 * args.dim}) must divide by tp ({tp})")
if args.strategy == "tp+sp" and args.batch_size % tp:
    parser.error(f"sequence parallel splits the batch's rows: --batch-size ({args.batch_size}) must divide by {tp}")
if world_size > 1:
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    # Rank r sits at row r // tp, column r % tp: the ranks of one row form a tensor-parallel
    # group (on GPUs, neighbours: the same machine), each column a data-parallel group.
    mesh = init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
else:
    mesh, dp_rank = None, 0
if rank == 0 and mesh is None:
    print(f"{args.strategy}: one process, so no mesh and no collectives")
elif rank == 0:
    print(f"{args.strategy}: {world_size} rank(s) as a {dp} x {tp} mesh (data x tensor parallel)")

# --- data: the same global batches in every run -------------------------------------------
# A small data set of random inputs, labelled by a fixed random linear "teacher": something
# to learn, and nothing to download.
# Every rank draws the whole global batch from the same seed and keeps its data-parallel
# slice. The ranks of a tensor-parallel group share one slice: they compute one model together.
teacher = torch.randn(args.dim, 10, generator=torch.Generator().manual_seed(args.seed + 1))


def batch(step: int):
    generator = torch.Generator().manual_seed(1000 * args.seed + step % args.data_batches)
    x = torch.randn(args.batch_size, args.dim, generator=generator)
    y = (x @ teacher).argmax(dim=1)
    return x.chunk(dp)[dp_rank].to(device), y.chunk(dp)[dp_rank].to(device)

# --- the one place where the parallelism is chosen ----------------------------------------
# Tensor parallel, inside every block: fc1 (dim -> 4*dim) split by its outputs, so each rank
# computes its own slice of the hidden layer, and GELU needs nothing from the others; fc2
# (4*dim -> dim) split by its inputs, so each rank multiplies its slice into a partial sum
# of the whole output, and one all-reduce adds the partial sums up.
PLAN = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
# Sequence parallel (tp+sp): between the matrices each rank keeps its own rows only. fc1
# gathers every row first; fc2 reduce-scatters, handing each rank its own rows, summed.
SP_PLAN = {"norm": SequenceParallel(sequence_dim=0), "fc1": ColwiseParallel(input_layouts=Shard(0)),
           "fc2": RowwiseParallel(output_layouts=Shard(0))}


def build():
    torch.manual_seed(args.seed)  # the same initial weights in every run
    model = MLPStack(dim=args.dim, depth=args.depth, in_features=args.dim).to(device)
    if tp > 1:  # tensor parallel first: its weights become DTensors sharded over "tp"...
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], SP_PLAN if args.strategy == "tp+sp" else PLAN)
    if args.strategy == "tp+sp":  # the stem hands each rank its own rows; the head gathers them all
        parallelize_module(model.stem, mesh["tp"], PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(0)))
        parallelize_module(model.head, mesh["tp"], PrepareModuleInput(
            input_layouts=Shard(0), desired_input_layouts=Replicate(), use_local_output=True))
    if args.strategy in ("fsdp", "fsdp+tp"):  # ...then FSDP shards them again, over "dp"
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    elif args.strategy == "ddp":
        model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None,
                    gradient_as_bucket_view=True)
    return model


# --- the model, and what each rank holds of it --------------------------------------------
model = build()
plain = model.module if isinstance(model, DDP) else model
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
shapes = {}
for name in ("fc1", "fc2"):
    weight = getattr(plain.blocks[0], name).weight
    shard, placement = memory.local_tensor(weight), str(getattr(weight, "placements", "(all of it)"))
    print(f"rank {rank}: blocks.0.{name}.weight {tuple(weight.shape)}, this rank holds {tuple(shard.shape)} {placement}")
    shapes.update({f"{name}_rows": shard.shape[0], f"{name}_cols": shard.shape[1], f"{name}_placement": placement})
metrics.log(0, **shapes)


# --- whole tensors, to compare with one process -------------------------------------------
def whole(tensor):  # a DTensor's full value (an all-gather: every rank must call it)
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def save(name: str, tensors: dict) -> None:  # the whole tensors, gathered; rank 0 writes them
    # (a tensor sharded over both mesh dimensions takes two all-gathers: PyTorch warns that
    # this is slow, which matters little for two saves; its warning is silenced here)
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    tensors = {key.removeprefix("module."): whole(t).detach().cpu() for key, t in tensors.items()}
    if rank == 0:
        torch.save(tensors, os.path.join(args.out, f"{name}_rank{rank}.pt"))


# --- training, every collective counted ---------------------------------------------------
for step in range(1, args.steps + 1):
    x, y = batch(step)
    bf16 = torch.autocast(device.type, torch.bfloat16, enabled=args.bf16)  # off: all float32
    # step 1: the bytes autograd keeps for backward (measured once; later steps keep the same)
    saved = memory.SavedTensorMeter(exclude=model) if step == 1 else contextlib.nullcontext()
    with comm.count_collectives() as forward, bf16, saved:
        loss = F.cross_entropy(model(x), y)
    with comm.count_collectives() as backward:
        loss.backward()
    if step == 1:  # the first gradients, to compare with one process
        save("grads", {name: p.grad for name, p in model.named_parameters()})
    optimizer.step()
    if step == 1:  # gradients and momentum exist now: what does this rank hold?
        held = memory.model_bytes(model, optimizer)
        metrics.log(step, param_bytes=held.params, grad_bytes=held.grads, optim_bytes=held.optimizer,
                    saved_bytes=saved.bytes)
    optimizer.zero_grad(set_to_none=True)
    metrics.log(step, loss=loss.item(), samples=len(x),
                sent_bytes=forward.sent_bytes + backward.sent_bytes,
                **{f"forward_{kind}": n for kind, n in forward.calls.items()},
                **{f"backward_{kind}": n for kind, n in backward.calls.items()},
                **{f"bytes_{kind}": forward.bytes.get(kind, 0) + backward.bytes.get(kind, 0)
                   for kind in {**forward.bytes, **backward.bytes}})
    if rank == 0 and (step == 1 or step == args.steps):
        share = "the whole batch" if len(x) == args.batch_size else "rank 0's slice"
        print(f"step {step}: loss {loss.item():.4f} ({share}); collectives in forward "
              f"{forward.calls}, in backward {backward.calls}")

save("weights", dict(model.named_parameters()))
if world_size > 1:
    dist.destroy_process_group()
