"""Lesson 00: what a failing rank looks like. Rank 1 cannot find its data; rank 0 waits for it.

Run it:  torchrun --standalone --nproc-per-node=2 scripts/00_fail.py
"""
import os

import torch
import torch.distributed as dist

if torch.cuda.is_available():
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
else:
    device = torch.device("cpu")
dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
rank = dist.get_rank()


def load_shard(rank: int) -> torch.Tensor:
    path = f"data/shard-{rank}.pt"
    if rank == 1:  # pretend rank 1's file is missing
        raise FileNotFoundError(f"rank {rank} cannot find its data shard {path}")
    return torch.ones(4, device=device)


shard = load_shard(rank)
print(f"rank {rank} (pid {os.getpid()}) loaded its shard; now waiting for the others")
dist.all_reduce(shard)  # rank 0 waits here for rank 1, which is already gone
dist.destroy_process_group()
