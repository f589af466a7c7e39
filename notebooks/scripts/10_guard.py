"""Lesson 10: a slow rank and a NaN, found from what every rank measures and agrees on.

Run it:  torchrun --standalone --nproc-per-node=2 scripts/10_guard.py --slow-rank 0 --nan-rank 1
"""
import argparse
import time

import torch
import torch.distributed as dist

from labkit import metrics

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--slow-rank", type=int, default=-1, help="this rank works --slow-s longer a step")
parser.add_argument("--slow-s", type=float, default=0.1)
parser.add_argument("--nan-rank", type=int, default=-1, help="this rank's gradient turns NaN ...")
parser.add_argument("--nan-step", type=int, default=10, help="... at this step")
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
weights = torch.randn(256, 256)

for step in range(1, args.steps + 1):
    start = time.perf_counter()
    grad = weights @ torch.randn(256, 256)  # this rank's work: stands in for forward and backward
    if rank == args.slow_rank:
        time.sleep(args.slow_s)  # the straggler: a throttled GPU, a busy host, a poor link
    if rank == args.nan_rank and step == args.nan_step:
        grad[0, 0] = float("nan")  # one bad batch, on one rank
    worked = time.perf_counter() - start
    # The guard: one all-reduce tells every rank the highest rank with a non-finite gradient.
    bad = torch.tensor([0.0 if torch.isfinite(grad).all() else rank + 1.0])
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    if bad.item():  # the same answer on every rank: all of them stop here, together
        metrics.log(step, stopped_for=int(bad.item()) - 1)
        metrics.flush()
        raise FloatingPointError(f"step {step}: rank {int(bad.item()) - 1}'s gradient is not finite; "
                                 f"every rank stops here")
    dist.all_reduce(grad)  # the gradients' sum: it waits for the slowest rank
    metrics.log(step, worked_s=worked, waited_s=time.perf_counter() - start - worked)
dist.destroy_process_group()
