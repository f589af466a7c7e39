"""The planner's figures are the measured ones: every configuration lessons 06, 11, 12 and 13 run,
launched here with the lessons' own scripts at their smoke-mode sizes, read back as the lessons
read it (the metrics the scripts log, ``labkit.measured_cost``), and compared with
``labkit.plan_table`` rank by rank. No figure is typed in: both sides come from the same
settings, one from a run, the other from the arithmetic.

At ``LABKIT_RANKS=4`` (``make test-scale``) the configurations are the lessons' at 4 ranks.
"""

from __future__ import annotations

import math
import shutil

import pytest

import labkit
from conftest import ROOT
from labkit.models import MLPStack

pytestmark = pytest.mark.launch

NPROC = labkit.default_nproc("cpu")
RANKS = 1 << (NPROC.bit_length() - 1)            # lessons 11 and 12: a power of two


@pytest.fixture
def scripts(workdir):
    """The lessons' scripts, as the notebooks write them, in a fresh folder."""
    shutil.copytree(ROOT / "notebooks" / "scripts", workdir / "scripts")
    return workdir


def launch(script: str, nproc: int, args: list[str], name: str):
    return labkit.launch(f"scripts/{script}", nproc=nproc, device="cpu", args=args, name=name, quiet=True,
                         timeout_s=300)


def planned(model, world_size: int, strategy: str, **kw):
    return labkit.plan_table(model, world_size=world_size, strategy=strategy, per_rank=True, **kw).loc[strategy]


def same_sent(got, want) -> bool:
    return all(math.isclose(g, w, rel_tol=1e-9, abs_tol=1e-6) for g, w in zip(got, want))


# -- lesson 06: memory per rank under DDP and FSDP, at each world size it measures -----------------
DIM_06, DEPTH_06, BATCH_06 = 256, 4, 16          # 06's smoke mode


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_lesson_06_memory_per_rank_is_the_planners(scripts, strategy):
    model = MLPStack(dim=DIM_06, depth=DEPTH_06)
    for world_size in sorted({1, NPROC}):
        args = ["--synthetic", "--train-size", str(4 * BATCH_06 * world_size), "--test-size", "64",
                "--epochs", "1", "--log-every", "2", "--workers", "0", "--dim", str(DIM_06),
                "--depth", str(DEPTH_06), "--batch-size", str(BATCH_06), "--strategy", strategy]
        run = launch("06_fsdp.py", world_size, args, f"{strategy}-{world_size}")
        held = run.metrics().dropna(subset=["param_bytes"]).set_index("rank").sort_index()
        want = planned(model, world_size, strategy.upper(), optimizer="AdamW")
        assert list(held["param_bytes"]) == list(want["params"]), (strategy, world_size)
        assert list(held["grad_bytes"]) == list(want["grads"]), (strategy, world_size)
        assert list(held["optim_bytes"]) == list(want["optimizer"] + want["steps"]), (strategy, world_size)


# -- lessons 11 and 12: the strategy map -------------------------------------------------------------
DIM_11, DEPTH_11, BATCH_11 = 256, 4, 128         # 11's and 12's smoke mode
ARGS_11 = ["--dim", str(DIM_11), "--depth", str(DEPTH_11), "--batch-size", str(BATCH_11), "--steps", "3"]
MAP = {   # the planner's name: (script, ranks, its arguments), as lessons 11 and 12 launch them
    "one process": ("11_tp.py", 1, ["--strategy", "none"]),
    "DDP": ("11_tp.py", RANKS, ["--strategy", "ddp"]),
    "FSDP": ("11_tp.py", RANKS, ["--strategy", "fsdp"]),
    "TP": ("11_tp.py", RANKS, ["--strategy", "tp"]),
    "PP": ("12_pp.py", RANKS, ["--microbatches", "8", "--schedule", "1f1b", "--split", "manual"]),
    "FSDP x TP": ("11_tp.py", RANKS, ["--strategy", "fsdp+tp", "--tp", "2"]),
}


@pytest.mark.parametrize("strategy", list(MAP))
def test_lessons_11_and_12_strategy_map_is_the_planners(scripts, strategy):
    script, nproc, extra = MAP[strategy]
    run = launch(script, nproc, ARGS_11 + extra, strategy.replace(" ", "-"))
    got = labkit.measured_cost(run).sort_index()
    want = planned(MLPStack(dim=DIM_11, depth=DEPTH_11, in_features=DIM_11), nproc, strategy,
                   optimizer="SGD momentum", batch_size=BATCH_11, tp=2)
    assert list(got["param_bytes"]) == list(want["params"]), (got, want)
    assert list(got["state_bytes"]) == list(want["total"]), (got, want)
    assert same_sent(got["sent_bytes"], want["sent"]), (got, want)


# -- lesson 13: ZeRO's table ---------------------------------------------------------------------------
DIM_13, DEPTH_13 = 64, 2                          # 13's smoke mode
STAGES = {"ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3"}


def test_lesson_13_zero_table_is_the_planners(scripts):
    run = launch("13_zero.py", NPROC, ["--dim", str(DIM_13), "--depth", str(DEPTH_13), "--steps", "4",
                                       "--log-every", "4", "--strategies", ",".join(STAGES)], f"zero-{NPROC}")
    df = run.metrics()
    held = df.dropna(subset=["param_bytes"]).set_index(["strategy", "rank"]).sort_index()
    sent = df.dropna(subset=["sent_bytes"]).set_index(["strategy", "rank"]).sort_index()
    model = MLPStack(dim=DIM_13, depth=DEPTH_13, in_features=DIM_13)
    for strategy, name in STAGES.items():
        want = planned(model, NPROC, name, optimizer="AdamW")
        mine = held.loc[strategy]
        assert list(mine["param_bytes"]) == list(want["params"]), (name, mine, want)
        assert list(mine["grad_bytes"]) == list(want["grads"]), (name, mine, want)
        assert list(mine["optim_bytes"]) == list(want["optimizer"]), (name, mine, want)  # the lesson leaves steps out
        assert same_sent(sent.loc[strategy, "sent_bytes"], want["sent"]), (name, sent.loc[strategy], want)
