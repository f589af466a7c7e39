"""Lesson 09's project: every setting in one dataclass, which is also the command line."""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass


@dataclass
class Config:
    # data and model
    data_dir: str = "data"
    synthetic: bool = False      # the synthetic set instead of CIFAR-10
    train_size: int = 0          # use the first N training images (0: all of them)
    width: int = 32              # channels of the model's first block
    # training
    epochs: int = 2
    batch_size: int = 64         # per rank and micro-step
    accum_steps: int = 1         # micro-steps per optimizer step
    lr: float = 0.05
    seed: int = 0
    amp: bool = True             # bf16 autocast, on CPU and GPU alike
    # bookkeeping
    out_dir: str = "runs/09"     # each rank's log and the checkpoints
    log_every: int = 5           # optimizer steps between metrics lines
    ckpt_every: int = 20         # optimizer steps between checkpoints
    resume: bool = True          # continue from the newest checkpoint in out_dir
    workers: int = 0             # DataLoader worker processes per rank

    def __post_init__(self):
        small = [f"{name}={getattr(self, name)}" for name in
                 ("epochs", "batch_size", "accum_steps", "log_every", "ckpt_every")
                 if getattr(self, name) < 1]
        if small or self.lr <= 0:
            raise ValueError(f"{', '.join(small) or f'lr={self.lr}'}: must be positive")

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> "Config":
        """Config.from_args(["--epochs", "3", "--no-amp"]): one flag per field."""
        parser = argparse.ArgumentParser(description="Lesson 09's trainer")
        for field in dataclasses.fields(cls):
            flag = "--" + field.name.replace("_", "-")
            if field.type == "bool":  # --amp / --no-amp
                parser.add_argument(flag, action=argparse.BooleanOptionalAction,
                                    default=field.default)
            else:
                kind = {"int": int, "float": float, "str": str}[field.type]
                parser.add_argument(flag, type=kind, default=field.default)
        return cls(**vars(parser.parse_args(argv)))
