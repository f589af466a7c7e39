"""The script ``labkit.doctor(launch=True)`` launches: every rank adds its rank number to an
all-reduce, the smallest test that rendezvous, loopback and the backend all work."""

import os

import torch
import torch.distributed as dist

from labkit import metrics

rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
use_cuda = torch.cuda.is_available()
if use_cuda:
    torch.cuda.set_device(local_rank)
dist.init_process_group("nccl" if use_cuda else "gloo")
value = torch.tensor([float(rank)], device=f"cuda:{local_rank}" if use_cuda else "cpu")
dist.all_reduce(value)
metrics.log(0, rank_sum=value.item())
dist.destroy_process_group()
