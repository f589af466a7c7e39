"""Lesson 00: every rank says who it is, then the ranks add up their rank numbers.

Run it:  torchrun --standalone --nproc-per-node=2 scripts/00_hello.py
"""
import os
import time

import torch
import torch.distributed as dist

from labkit import metrics

# torchrun tells each process who it is through environment variables.
rank = int(os.environ["RANK"])              # this process, counted over all machines
local_rank = int(os.environ["LOCAL_RANK"])  # this process, counted on this machine: picks its GPU
world_size = int(os.environ["WORLD_SIZE"])  # how many processes take part

if torch.cuda.is_available():
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    backend = "nccl"   # NVIDIA's collectives: GPU to GPU
else:
    device = torch.device("cpu")
    backend = "gloo"   # collectives over TCP: works on any CPU
dist.init_process_group(backend)  # meets the other ranks at MASTER_ADDR:MASTER_PORT

print(f"I am rank {rank} of {world_size} (local rank {local_rank}), pid {os.getpid()}, "
      f"on {device}, backend {backend}")
if rank == 0:
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "OMP_NUM_THREADS"):
        print(f"  {key}={os.environ.get(key)}")

# Rank r reaches the collective r × 0.3 s late, so we can watch the others wait for it.
ready = time.time()
time.sleep(0.3 * rank)
value = torch.tensor([float(rank), 1.0], device=device)  # my rank number, and a 1 to count me
arrive = time.time()
dist.all_reduce(value)  # a collective: every rank must call it, and all get the sums
rank_sum, counted = value.tolist()  # waits for the result (on a GPU the call only queues it)
leave = time.time()
print(f"rank {rank}: the sum of all ranks is {rank_sum:.0f}, over {counted:.0f} ranks "
      f"(waited {leave - arrive:.2f} s in all_reduce)")
metrics.log(0, rank_sum=rank_sum, counted=counted, pid=os.getpid(), ready=ready, arrive=arrive,
            leave=leave)

dist.destroy_process_group()
