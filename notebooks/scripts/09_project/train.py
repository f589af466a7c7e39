"""Lesson 09's project: train the course's CNN on every rank torchrun started, on any node.

    torchrun --standalone --nproc-per-node=2 scripts/09_project/train.py --synthetic
    torchrun --nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        --rdzv-id=JOB scripts/09_project/train.py        # on every node (see 09_job.sbatch)
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from config import Config
from runtime import Runtime, StopRequest, get_logger, mean_over_ranks, setup, teardown
from labkit import checkpoint, metrics
from labkit.data import get_datasets
from labkit.models import SmallResNet


def build(cfg: Config, rt: Runtime):
    """The data each rank reads (its own shard of every epoch), the model and the optimizer."""
    data = get_datasets(cfg.data_dir, synthetic=cfg.synthetic, train_size=cfg.train_size or None,
                        test_size=1, seed=cfg.seed, augment=False)
    sampler = DistributedSampler(data.train, num_replicas=rt.world_size, rank=rt.rank,
                                 shuffle=True, seed=cfg.seed, drop_last=True)
    loader = DataLoader(data.train, batch_size=cfg.batch_size, sampler=sampler, drop_last=True,
                        num_workers=cfg.workers, pin_memory=rt.device.type == "cuda")
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    model = SmallResNet(width=cfg.width).to(rt.device)  # to the device before DDP wraps it
    if rt.world_size > 1:
        model = DDP(model, device_ids=[rt.local_rank] if rt.device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)
    return data, sampler, loader, model, optimizer


def save(cfg: Config, rt: Runtime, model, optimizer, step: int, epoch: int) -> None:
    """Rank 0 writes the whole state to a temporary file and renames it: a crash mid-save
    leaves the previous checkpoint whole. The others wait until it is on disk."""
    if rt.main:
        raw = model.module if isinstance(model, DDP) else model  # no "module." in the keys
        state = {"model": raw.state_dict(), "optimizer": optimizer.state_dict(),
                 "step": step, "epoch": epoch, "config": dataclasses.asdict(cfg)}
        folder = Path(cfg.out_dir, "checkpoints")
        checkpoint.save_atomic(state, checkpoint.step_path(folder, step))
        checkpoint.prune(folder, keep=2)
    if rt.world_size > 1:
        torch.distributed.barrier()


def load(cfg: Config, rt: Runtime, model, optimizer) -> tuple[int, int]:
    """Every rank reads the newest checkpoint, if any: (step, epoch) to go on from."""
    latest = checkpoint.latest(Path(cfg.out_dir, "checkpoints")) if cfg.resume else None
    if latest is None:
        return 0, 0
    state = torch.load(latest, map_location=rt.device, weights_only=True)
    raw = model.module if isinstance(model, DDP) else model
    raw.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state["step"], state["epoch"]


def optimizer_step(cfg: Config, rt: Runtime, model, optimizer, batches) -> torch.Tensor:
    """One optimizer step of ``accum_steps`` micro-batches; returns [loss sum, micro-batches]."""
    seen = torch.zeros(2, device=rt.device)
    for micro in range(cfg.accum_steps):
        x, y = (t.to(rt.device, non_blocking=True) for t in next(batches))
        last = micro == cfg.accum_steps - 1
        # DDP all-reduces the gradients in backward(); no_sync() skips that on all but the
        # last micro-step, so the gradients travel once per optimizer step, averaged over the ranks.
        sync = model.no_sync() if isinstance(model, DDP) and not last else contextlib.nullcontext()
        with sync:
            with torch.autocast(rt.device.type, dtype=torch.bfloat16, enabled=cfg.amp):
                loss = F.cross_entropy(model(x), y)
            (loss / cfg.accum_steps).backward()  # the mean over the micro-batches
        seen += torch.stack([loss.detach().float(), torch.ones((), device=rt.device)])
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return seen


def train(cfg: Config, rt: Runtime) -> None:
    log = get_logger(rt, cfg.out_dir)
    data, sampler, loader, model, optimizer = build(cfg, rt)
    if rt.main:
        log.info("%s; global batch %d", data.description,
                 cfg.batch_size * cfg.accum_steps * rt.world_size)
    metrics.log(0, group_rank=rt.group_rank, local_rank=rt.local_rank,  # where each rank ran
                local_world_size=rt.local_world_size, host=socket.gethostname(), pid=os.getpid(),
                master=f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}")
    steps_per_epoch = len(loader) // cfg.accum_steps
    step, epoch = load(cfg, rt, model, optimizer)
    if step:
        log.info("resumed from step %d (epoch %d)", step, epoch)
    stop, window = StopRequest(), torch.zeros(2, device=rt.device)
    while epoch < cfg.epochs:
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        batches = iter(loader)
        for _ in range((step - epoch * steps_per_epoch) * cfg.accum_steps):
            next(batches)  # resumed mid-epoch: skip what the checkpoint already saw
        while step < (epoch + 1) * steps_per_epoch:
            window += optimizer_step(cfg, rt, model, optimizer, batches)
            step += 1
            if step % cfg.log_every == 0:
                loss_sum, count = mean_over_ranks(window).tolist()  # one sync per log line
                window.zero_()
                metrics.log(step, loss=loss_sum / count, epoch=epoch,
                            samples=cfg.log_every * cfg.accum_steps * cfg.batch_size)
                if rt.main:
                    log.info("step %d  epoch %d  loss %.4f", step, epoch, loss_sum / count)
                if stop.agreed(rt.device):  # SIGTERM on any rank: all save, then leave
                    save(cfg, rt, model, optimizer, step, epoch)
                    log.info("stopped at step %d as asked; checkpoint saved", step)
                    return
            if step % cfg.ckpt_every == 0:
                save(cfg, rt, model, optimizer, step, epoch)
        epoch += 1
    save(cfg, rt, model, optimizer, step, epoch)
    log.info("done: %d steps", step)


if __name__ == "__main__":
    config = Config.from_args()
    runtime = setup()
    try:
        train(config, runtime)
    finally:
        teardown()
