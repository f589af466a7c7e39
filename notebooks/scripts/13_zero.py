"""Lesson 13: ZeRO by hand. Each strategy trains the same model on the same batches, one after
another, in one launch: DDP, ZeRO stages 1, 2 and 3 built from collectives, PyTorch's
ZeroRedundancyOptimizer, and FSDP2 (lesson 06).

Run it:  torchrun --standalone --nproc-per-node=2 scripts/13_zero.py
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from labkit import comm, memory, metrics
from labkit.models import MLPStack
from zero import FlatShard, zero_step  # scripts/zero.py: ZeRO by hand

STRATEGIES = "ddp,zero1,zero2,zero3,zero_redundancy,fsdp"  # ddp first: the others are compared with it
parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--strategies", default=STRATEGIES, help="which to run, in this order")
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--batches", type=int, default=8, help="distinct batches per rank, cycled")
parser.add_argument("--batch-size", type=int, default=32, help="per rank")
parser.add_argument("--lr", type=float, default=1e-3, help="AdamW's")
parser.add_argument("--dim", type=int, default=256, help="width of the MLP stack")
parser.add_argument("--depth", type=int, default=4, help="blocks in the MLP stack")
parser.add_argument("--log-every", type=int, default=4, help="steps between metrics lines")
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

# --- the process group, as in lesson 02 --------------------------------------------------
rank = int(os.environ["RANK"])
local_rank = int(os.environ["LOCAL_RANK"])
world_size = int(os.environ["WORLD_SIZE"])
if torch.cuda.is_available():
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)  # before init: NCCL binds each rank to its own GPU
else:
    device = torch.device("cpu")
dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
data = torch.Generator().manual_seed(args.seed + 1 + rank)  # each rank its own batches...
batches = [(torch.randn(args.batch_size, args.dim, generator=data).to(device),
            torch.randint(0, 10, (args.batch_size,), generator=data).to(device))
           for _ in range(args.batches)]  # ...and the same ones for every strategy


def build(strategy: str):
    """The same initial weights every time; the model, its optimizer and its ZeRO units."""
    torch.manual_seed(args.seed)
    model = MLPStack(dim=args.dim, depth=args.depth, in_features=args.dim).to(device)
    units = []
    if strategy in ("ddp", "zero_redundancy"):  # a whole copy and a whole gradient on every rank
        model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None,
                    gradient_as_bucket_view=True)
    if strategy.startswith("zero") and strategy[-1].isdigit():  # ZeRO by hand: one unit per piece
        units = [FlatShard(m, int(strategy[-1])) for m in (model.stem, *model.blocks, model.head)]
        return model, units, torch.optim.AdamW([u.shard for u in units], lr=args.lr)
    if strategy == "zero_redundancy":  # PyTorch's: each rank the state of whole parameters
        return model, units, ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=args.lr)
    if strategy == "fsdp":  # lesson 06
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    return model, units, torch.optim.AdamW(model.parameters(), lr=args.lr)


def held(model, units, optimizer) -> dict:
    """Bytes this rank holds, counted from the memory blocks behind its tensors."""
    params = [*model.parameters(), *(u.shard for u in units)]
    state = getattr(optimizer, "optim", optimizer).state  # ZeroRedundancyOptimizer: its local one
    return {"param_bytes": memory.storage_bytes(params),
            "grad_bytes": memory.storage_bytes([t.grad for t in params if t.grad is not None]),
            "optim_bytes": memory.tensor_bytes([v for s in state.values() for k, v in s.items() if k != "step"])}


def full_weights(model, units) -> torch.Tensor:
    """Every weight, whole, in one vector: to compare with DDP's."""
    for unit in units:
        if unit.stage == 3:
            unit.gather()
    whole = [p.full_tensor() if isinstance(p, DTensor) else p for p in model.parameters()]
    return torch.cat([p.detach().flatten() for p in whole])



reference = {}  # DDP's mean gradient of the first step, and its final weights
for strategy in args.strategies.split(","):
    stage = int(strategy[-1]) if strategy[-1].isdigit() else 0  # zero1, zero2, zero3
    model, units, optimizer = build(strategy)
    window_loss = torch.zeros((), device=device)
    for step in range(1, args.steps + 1):
        x, y = batches[(step - 1) % args.batches]
        with comm.count_collectives() as sent:  # every collective of one whole step
            loss = F.cross_entropy(model(x), y)
            model.zero_grad(set_to_none=True)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if step == 3:  # the optimizer state exists, and backward has just ended
                metrics.log(step, strategy=strategy, **held(model, units, optimizer))
            zero_step(units, optimizer, stage) if units else optimizer.step()
        if step == 3:  # the first two steps set up: DDP rebuilds its buckets in the second
            metrics.log(step, strategy=strategy, sent_bytes=sent.sent_bytes,
                        **{f"bytes_{kind}": n for kind, n in sent.bytes.items()})
        if step == 1 and strategy == "ddp":
            reference["grad"] = torch.cat([p.grad.flatten() for p in model.parameters()])
            metrics.log(step, strategy=strategy, grad_max=reference["grad"].abs().max().item())  # grad_gap's scale
        if step == 1 and units:  # this rank's slice of the mean gradient, against DDP's
            offset, gap = 0, 0.0
            for unit in units:
                numel = unit.flat.numel() - unit.padding
                mean = F.pad(reference["grad"][offset:offset + numel], (0, unit.padding))
                gap = max(gap, (unit.shard.grad - mean.chunk(world_size)[rank]).abs().max().item())
                offset += numel
            metrics.log(step, strategy=strategy, grad_gap=gap)
        window_loss += loss.detach()
        if step % args.log_every == 0:
            metrics.log(step, strategy=strategy, loss=(window_loss / args.log_every).item(),
                        samples=args.log_every * args.batch_size)
            window_loss.zero_()
    weights = full_weights(model, units)
    reference.setdefault("weights", weights)  # the first strategy's: DDP's
    metrics.log(step, strategy=strategy, weight_gap=(weights - reference["weights"]).abs().max().item())
    if rank == 0:
        print(f"{strategy:>15}: loss {loss.item():.4f} at step {step}")

dist.destroy_process_group()
