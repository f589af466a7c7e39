"""Lesson 12: lesson 06's MLP stack, pipeline parallel: each rank runs a stage of consecutive
blocks, and the batch flows through the stages in micro-batches.

Run it:  torchrun --standalone --nproc-per-node=2 scripts/12_pp.py --schedule 1f1b
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, SplitPoint,
                                         pipeline)

from labkit import comm, memory, metrics
from labkit.models import MLPStack

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--schedule", choices=["gpipe", "1f1b"], default="1f1b")
parser.add_argument("--split", choices=["manual", "traced"], default="manual",
                    help="cut the model into stages by hand, or trace it and cut at split points")
parser.add_argument("--microbatches", type=int, default=8, help="micro-batches per batch")
parser.add_argument("--dim", type=int, default=256, help="width of the MLP stack")
parser.add_argument("--depth", type=int, default=4, help="blocks in the MLP stack")
parser.add_argument("--batch-size", type=int, default=32, help="global: the micro-batches split it")
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--data-batches", type=int, default=8, help="the data set: this many batches")
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--out", default=os.environ.get(metrics.RUN_DIR_ENV, "."),
                    help="folder for grads_rank<R>.pt and weights_rank<R>.pt (default: run folder)")
args = parser.parse_args()

# --- ranks: one pipeline stage each -------------------------------------------------------
rank = int(os.environ.get("RANK", 0))
local_rank = int(os.environ.get("LOCAL_RANK", 0))
world_size = int(os.environ.get("WORLD_SIZE", 1))
if torch.cuda.is_available():
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
else:
    device = torch.device("cpu")
stages, first, last = world_size, rank == 0, rank == world_size - 1
if args.depth % stages:
    parser.error(f"depth ({args.depth}) must divide into {stages} stages of equal blocks")
if args.batch_size % args.microbatches:
    parser.error(f"batch size ({args.batch_size}) must divide into {args.microbatches} micro-batches")
if args.schedule == "1f1b" and args.microbatches < stages:
    parser.error(f"1F1B needs as many micro-batches as stages, or more: {args.microbatches} < {stages}")
if world_size > 1:
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
if rank == 0:
    print(f"{args.schedule}: {stages} stage(s) of {args.depth // stages} block(s), "
          f"{args.microbatches} micro-batches of {args.batch_size // args.microbatches}")

# --- data: the same global batches in every run -------------------------------------------
# A small data set of random inputs, labelled by a fixed random linear "teacher": something
# to learn, and nothing to download.
# Every rank draws the whole global batch from the same seed: the first stage takes the
# inputs from it, the last stage the labels.
teacher = torch.randn(args.dim, 10, generator=torch.Generator().manual_seed(args.seed + 1))


def batch(step: int):
    generator = torch.Generator().manual_seed(1000 * args.seed + step % args.data_batches)
    x = torch.randn(args.batch_size, args.dim, generator=generator)
    y = (x @ teacher).argmax(dim=1)
    return x.to(device), y.to(device)

# --- the one place where the parallelism is chosen ----------------------------------------
def build():
    torch.manual_seed(args.seed)  # the same initial weights in every run
    model = MLPStack(dim=args.dim, depth=args.depth, in_features=args.dim).to(device)
    per_stage = args.depth // stages
    if args.split == "manual":  # this rank keeps its blocks; the others become nn.Identity,
        for i in range(args.depth):  # so every weight keeps its name (blocks.2.fc1.weight)
            if i // per_stage != rank:
                model.blocks[i] = nn.Identity()
        if not first:
            model.stem = nn.Identity()
        if not last:
            model.head = nn.Identity()
        return PipelineStage(model, rank, stages, device)
    # traced: torch.export records the whole model on one micro-batch, then cuts the graph
    # at the beginning of every stage's first block (the split points)
    split = {f"blocks.{s * per_stage}": SplitPoint.BEGINNING for s in range(1, stages)}
    example = torch.zeros(args.batch_size // args.microbatches, args.dim, device=device)
    return pipeline(model, mb_args=(example,), split_spec=split).build_stage(rank, device)


# --- this rank's stage, and the schedule that drives it -----------------------------------
stage = build()
model = stage.submod  # this rank's part of the model
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[args.schedule](
    stage, n_microbatches=args.microbatches, loss_fn=F.cross_entropy)  # mean of micro-batch losses
names = [name for name, _ in model.named_parameters()]
print(f"rank {rank}: stage {rank} holds {len(names)} tensors, {names[0]} ... {names[-1]}")

# --- the schedule's work, timed: which micro-batch this stage computes, and when ----------
events = []


def timed(kind: str, work):
    def run(microbatch, *inputs, **options):
        if device.type == "cuda":
            torch.cuda.synchronize()  # GPU work is asynchronous: time it done, not queued
        start = time.time()  # wall clock: the same clock for every rank on one machine
        out = work(microbatch, *inputs, **options)
        if device.type == "cuda":
            torch.cuda.synchronize()
        # stage.fwd_cache: the micro-batches whose forward PyTorch keeps for their backward
        events.append((kind, microbatch, start, time.time(), len(stage.fwd_cache)))
        return out
    return run


stage.forward_one_chunk = timed("F", stage.forward_one_chunk)
stage.backward_one_chunk = timed("B", stage.backward_one_chunk)


# --- whole tensors, to compare with one process -------------------------------------------
def save(name: str, tensors: dict) -> None:  # each stage holds its tensors whole, and writes them
    torch.save({key: t.detach().cpu() for key, t in tensors.items()},
               os.path.join(args.out, f"{name}_rank{rank}.pt"))


# --- training: the schedule runs forward and backward over the micro-batches --------------
for step in range(1, args.steps + 1):
    x, y = batch(step)
    losses, events[:] = [], []
    if world_size > 1:
        dist.barrier()  # every stage starts the step together: the chart shows the pipeline
    with comm.count_collectives() as sent:
        schedule.step(*([x] if first else []), **(dict(target=y, losses=losses) if last else {}))
    if step == 1:  # the first gradients (averaged over micro-batches), to compare with one process
        save("grads", {name: p.grad for name, p in model.named_parameters()})
    optimizer.step()
    if step == 1:
        held = memory.model_bytes(model, optimizer)
        metrics.log(step, param_bytes=held.params, grad_bytes=held.grads, optim_bytes=held.optimizer)
    optimizer.zero_grad(set_to_none=True)
    for kind, microbatch, start, end, held in events:
        metrics.log(step, phase=kind, microbatch=microbatch, start=start, end=end, held=held)
    loss = {"loss": torch.stack(losses).mean().item()} if last else {}  # the batch's mean loss
    metrics.log(step, samples=args.batch_size, sent_bytes=sent.sent_bytes,
                sends=sent.calls.get("send", 0), **loss)
    if last and (step == 1 or step == args.steps):  # step 1 also sends the stages' set-up (shapes): not counted
        n = sent.calls.get("send", 0)
        sends = f"; the last stage sent {n} tensor{'s' * (n != 1)} back" if step > 1 else ""
        print(f"step {step}: loss {loss['loss']:.4f}{sends}")

save("weights", dict(model.named_parameters()))
if world_size > 1:
    dist.destroy_process_group()
