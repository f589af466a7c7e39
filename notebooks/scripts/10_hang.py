"""Lesson 10: rank 1 skips one all_reduce. Where do the ranks part ways?

Run it:  torchrun --standalone --nproc-per-node=2 scripts/10_hang.py --timeout 10
"""
import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist

from labkit import metrics

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--skip-step", type=int, default=2, help="the step whose all_reduce rank 1 skips")
parser.add_argument("--timeout", type=float, default=1800,
                    help="seconds a collective may wait before it fails (gloo's default: 30 min)")
parser.add_argument("--flight-dump", action="store_true", help="write the flight record on a failure")
args = parser.parse_args()

# gloo on every machine: a hang is about the order of collectives, not about the device.
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
rank, world_size = dist.get_rank(), dist.get_world_size()
print(f"rank {rank} of {world_size} is pid {os.getpid()}")


def train_step(step: int) -> None:
    grad = torch.full((4,), 10.0 * step + rank)  # stands in for this rank's gradients
    dist.all_reduce(grad)  # every rank must call it, every step, in the same order
    expected = sum(10.0 * step + r for r in range(world_size))
    metrics.log(step, reduced=grad[0].item(), expected=expected)
    print(f"step {step}: all_reduce gave {grad[0].item():g}, expected {expected:g}")


try:
    for step in range(args.steps):
        if rank == 1 and step == args.skip_step:
            continue  # the bug: a data-dependent early exit that only one rank takes
        train_step(step)
    dist.barrier()  # nobody leaves before everybody is done
except RuntimeError:
    # gloo writes no flight record by itself: dump ours now, while we know something is wrong.
    if args.flight_dump:  # the recorder itself is on by default: 2000 calls in PyTorch 2.14
        from torch._C._distributed_c10d import _dump_fr_trace  # no public name for it yet
        prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE", "/tmp/nccl_trace_rank_")
        with open(f"{prefix}{rank}.tmp", "wb") as f:  # another name until it is whole
            f.write(_dump_fr_trace())
        os.replace(f"{prefix}{rank}.tmp", f"{prefix}{rank}")
        # torchrun stops every rank once one fails: wait for the others' dumps (10 s at most)
        dumps, deadline = [f"{prefix}{r}" for r in range(world_size)], time.monotonic() + 10
        while not all(map(os.path.exists, dumps)) and time.monotonic() < deadline:
            time.sleep(0.05)
    raise
dist.destroy_process_group()
