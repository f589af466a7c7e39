"""The script ``labkit.bandwidth`` launches: all-reduce, all-gather and reduce-scatter, each
timed over message sizes the way nccl-tests times them (lesson 07). A script, not imported:
it loads torch, as a lesson's script does.

    torchrun --standalone --nproc-per-node=2 labkit/_rank/collectives.py --sizes 1024,1048576

A size is the bytes of the whole float32 tensor (nccl-tests' convention): the all-reduce's
buffer, the all-gather's output, the reduce-scatter's input; each rank holds one world_size-th
of it as the all-gather's input and the reduce-scatter's output. A size is rounded down to a
whole number of float32 elements per rank (at least one); the size logged is the one timed.

Each measurement: ``--warmup`` calls left out, then ``--iters`` calls, each started together
(a barrier first) and timed to its end on the device; an iteration takes as long as its
slowest rank, and rank 0 logs the median over the iterations (with the fastest and slowest).
"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from labkit import metrics
from labkit._diagnose.ring import OPS, bus_factor, format_bytes

# torch 2.14 renamed the tensor forms (the old names warn); older releases have only those.
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", required=True, help="bytes, comma separated")
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    return parser.parse_args()


def collective(op: str, nbytes: int, world: int, device: torch.device):
    """(a call that runs ``op`` once, the bytes it moves in nccl-tests' convention)."""
    per_rank = max(1, nbytes // 4 // world)
    whole = torch.zeros(per_rank * world, device=device)  # zeros: sums never overflow
    part = torch.zeros(per_rank, device=device)
    calls = {"all_reduce": lambda: dist.all_reduce(whole),
             "all_gather": lambda: ALL_GATHER(whole, part),
             "reduce_scatter": lambda: REDUCE_SCATTER(part, whole)}
    return calls[op], whole.numel() * whole.element_size()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(call, device: torch.device, warmup: int, iters: int) -> list[float]:
    """Seconds of each timed call, each the slowest rank's."""
    for _ in range(warmup):
        call()
    sync(device)
    seconds = []
    for _ in range(iters):
        dist.barrier()  # everyone starts together: the time is the collective's, not a late peer's
        sync(device)
        start = time.perf_counter()
        call()
        sync(device)
        seconds.append(time.perf_counter() - start)
    slowest = torch.tensor(seconds, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.tolist()


def main() -> None:
    args = parse_args()
    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    # device_id binds the group to this rank's GPU: NCCL's barrier then knows its device (and
    # says nothing about guessing it). None, the default, for gloo on CPU.
    dist.init_process_group("nccl" if use_cuda else "gloo", device_id=device if use_cuda else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        print(f"{'op':<15}{'size':>10}{'time (us)':>12}{'algbw GB/s':>12}{'busbw GB/s':>12}"
              f"   ({world} ranks, {dist.get_backend()})")
    step = 0
    for op in args.ops.split(","):
        for nbytes in (int(s) for s in args.sizes.split(",")):
            call, nbytes = collective(op, nbytes, world, device)
            seconds = timed(call, device, args.warmup, args.iters)
            median = statistics.median(seconds)
            if rank == 0:
                algbw = nbytes / median / 1e9
                print(f"{op:<15}{format_bytes(nbytes):>10}{median * 1e6:>12.1f}{algbw:>12.3f}"
                      f"{algbw * bus_factor(op, world):>12.3f}", flush=True)
                metrics.log(step, op=op, size_bytes=nbytes, time_s=median, time_min_s=min(seconds),
                            time_max_s=max(seconds), iters=len(seconds), backend=dist.get_backend())
            step += 1
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
