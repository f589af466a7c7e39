"""Lesson 09's project: the distributed part in one place: set-up, tear-down, logging, metrics."""
from __future__ import annotations

import logging
import os
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Runtime:
    rank: int              # this process among all of them
    local_rank: int        # among the processes of its node: picks the GPU
    group_rank: int        # which node (torchrun's GROUP_RANK)
    local_world_size: int  # processes on this node
    world_size: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0


def setup() -> Runtime:
    """Read what torchrun set, pick the device, join the process group (skipped alone)."""
    env = os.environ
    rank, local_rank = int(env.get("RANK", 0)), int(env.get("LOCAL_RANK", 0))
    group_rank, world_size = int(env.get("GROUP_RANK", 0)), int(env.get("WORLD_SIZE", 1))
    local_world_size = int(env.get("LOCAL_WORLD_SIZE", 1))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)  # GPUs are numbered per node
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return Runtime(rank, local_rank, group_rank, local_world_size, world_size, device)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def get_logger(rt: Runtime, out_dir: str) -> logging.Logger:
    """Every rank writes its own file; only rank 0 also prints, so the console stays readable."""
    log = logging.getLogger("trainer")
    log.setLevel(logging.INFO)
    form = logging.Formatter(f"%(asctime)s rank{rt.rank} %(message)s", "%H:%M:%S")
    folder = Path(out_dir, "logs")
    folder.mkdir(parents=True, exist_ok=True)
    handlers = [logging.FileHandler(folder / f"rank{rt.rank}.log")]
    if rt.main:
        handlers.append(logging.StreamHandler(sys.stdout))
    for handler in handlers:
        handler.setFormatter(form)
        log.addHandler(handler)
    log.info("rank %d of %d: node %d (%s), local rank %d, pid %d, %s", rt.rank, rt.world_size,
             rt.group_rank, socket.gethostname(), rt.local_rank, os.getpid(), rt.device)
    return log


def mean_over_ranks(values: torch.Tensor) -> torch.Tensor:
    """The mean over every rank of each entry of ``values``: one all-reduce for all metrics."""
    values = values.detach().clone()
    if dist.is_initialized():
        dist.all_reduce(values)  # a sum, on every rank
        values /= dist.get_world_size()
    return values


class StopRequest:
    """Slurm sends SIGTERM before it ends a job (a requeue, the time limit, scancel).

    The handler only takes note; the loop asks at every log step whether *any* rank has
    been told, so that all ranks stop after the same step and the checkpoint is consistent.
    """

    def __init__(self) -> None:
        self.noted = False
        signal.signal(signal.SIGTERM, self._note)

    def _note(self, signum, frame) -> None:
        self.noted = True

    def agreed(self, device: torch.device) -> bool:
        flag = torch.tensor([float(self.noted)], device=device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # one rank told: every rank stops
        return bool(flag.item())
