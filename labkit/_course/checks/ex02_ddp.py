"""Exercise 02-ddp: make a one-device training script data-parallel with DDP.

The model for a check module (see ``labkit._course.feedback`` for ``@check`` and the stop signal):
the exercise's id, its hints and its constants first; then the public check, which launches
the script and runs the phases in order; then the phases, one function each. A phase after
whose finding nothing more can be judged ends the check with ``feedback.stop(text)`` or
``feedback.require(condition, right, wrong)`` (as ``_metrics`` here, ``_windows`` in exercise 01,
``_losses`` in exercise 05).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from labkit._course.checks._common import _config, _last, _metrics, _on, _ranks
from labkit._course.attempt import launched
from labkit._course.feedback import Feedback, check

EXERCISE = "02-ddp"

HINTS = [
    "Start like lesson 00: the three numbers from the environment, the device from "
    "LOCAL_RANK, then dist.init_process_group with 'nccl' on GPUs and 'gloo' on CPUs.",
    "DistributedSampler(data.train, num_replicas=world_size, rank=rank, shuffle=True, seed=0, "
    "drop_last=True) gives each rank its own share; pass it as sampler= to the DataLoader "
    "(and then no shuffle=). Call sampler.set_epoch(epoch) at the top of every epoch.",
    "Move the model to its device first, then DDP(model, device_ids=[local_rank]) on a GPU "
    "(device_ids=None on the CPU). In evaluate(), dist.all_reduce(counts) before dividing. "
    "Print only where rank == 0, and end with dist.destroy_process_group().",
]

#: The settings the skeleton logs at step 0.
SETTINGS = ["train_size", "batch_size"]


@check
def check_ddp(target="scripts/ex02_ddp.py", *, timeout_s: float = 300) -> Feedback:
    """Exercise 02-ddp: each rank its own share of the data, a new order each epoch, weights
    kept equal by DDP, one test accuracy for all, and rank 0 alone printing.

    Launches the script on 2 ranks, or ``LABKIT_RANKS`` (every GPU, if there are two or more),
    and reads what they logged and printed.

    Args:
        target: the exercise's script, or a finished Run of it.
        timeout_s: seconds the launch may take.

    Returns:
        a Feedback; a mistake in the script is a finding, never an exception.

    Example (exercises/02_ddp.ipynb)::

        labkit.check_ddp("scripts/ex02_ddp.py")
    """
    feedback, run = launched(EXERCISE, target, timeout_s=timeout_s, name="check-02-ddp", explain=_name_gpu_device_ids,
                             **_ranks(2))
    df = _metrics(feedback, run, ["first_batch", "test_acc", "weights_fingerprint", *SETTINGS])  # or stops
    _each_rank_its_share(feedback, df, _config(df, SETTINGS), run.nproc)
    _one_model(feedback, df)
    _rank_0_prints(feedback, run)
    _leaves_the_group(feedback, target)
    return feedback


def _name_gpu_device_ids(feedback: Feedback, target) -> None:
    """The launch failed: if DDP refused device_ids on a CPU rank, say what to pass there."""
    if feedback.failure is not None and "device_ids" in (feedback.failure.message or ""):
        feedback.fail("on CPU ranks, DDP takes device_ids=None: device_ids=[local_rank] names a GPU. "
                      "Pass [local_rank] only when device.type == 'cuda'.", hint=3)


def _each_rank_its_share(feedback: Feedback, df, setting: dict, world: int) -> None:
    """The DistributedSampler: samples of its own on each rank, a share of the data set per
    epoch, and a new order every epoch."""
    starts = df.dropna(subset=["first_batch"]).pivot_table(
        index="epoch", columns="rank", values="first_batch", aggfunc="first")
    shared = (starts.nunique(axis=1) < starts.shape[1]).any()
    like_0 = [r for r in starts.columns if r != 0 and (starts[r] == starts[0]).any()]
    feedback.expect(not shared, "each rank starts every epoch with samples of its own",
                    f"{_on(like_0, world) if like_0 else 'two ranks'} saw the same samples as "
                    f"{'rank 0' if like_0 else 'each other'}: is the DistributedSampler in place, "
                    "and passed to the DataLoader as sampler=?", hint=2)
    epoch_steps = df.dropna(subset=["first_batch"]).groupby("epoch")["step"].first()
    if len(epoch_steps) > 1:
        images, batch = int(setting["train_size"]), int(setting["batch_size"])
        expected = images // (batch * world)
        # A rank's share is images / world, rounded down or up (the sampler's drop_last), and its last
        # short batch is dropped or kept (the loader's): when world does not divide, each is right.
        share = {images // world, -(-images // world)}
        right = {n // batch for n in share} | {-(-n // batch) for n in share}
        measured = int(epoch_steps.iloc[1] - epoch_steps.iloc[0])
        feedback.expect(measured in right,
                        f"an epoch takes {measured} steps: {images} images / ({batch} per rank × {world} ranks)",
                        f"an epoch took {measured} steps; with {world} ranks sharing {images} images "
                        f"{batch} at a time it takes {expected}: does each rank get only its share?", hint=2)
    if len(starts) > 1:
        repeats = (starts.nunique(axis=0) < len(starts)).any()
        feedback.expect(not repeats, "every epoch has a new order",
                        "each epoch starts with the same samples on a rank: call "
                        "sampler.set_epoch(epoch) at the start of every epoch, and keep the "
                        "sampler's shuffle=True (its default).", hint=2)


def _one_model(feedback: Feedback, df) -> None:
    """DDP keeps the weights equal, and the test accuracy is the whole test set's on every rank."""
    weights = _last(df, "weights_fingerprint")
    feedback.expect(len(set(weights.values())) == 1, "all ranks end with the same weights (DDP)",
                    "the ranks ended with different weights: wrap the model in "
                    "DistributedDataParallel, so that every step averages the gradients.", hint=3)
    accs = df.dropna(subset=["test_acc"]).pivot_table(index="epoch", columns="rank", values="test_acc")
    feedback.expect((accs.nunique(axis=1) == 1).all(), "every rank reports the same test accuracy",
                    "the ranks report different test accuracies: dist.all_reduce the counts "
                    "before dividing, so that each rank gets the whole test set's accuracy.", hint=3)


def _rank_0_prints(feedback: Feedback, run) -> None:
    """An epoch summary is a printed line that names the accuracy ("epoch 0: test accuracy 41.2%")."""
    printed = {r: run.output(r).lower().count("accuracy") for r in range(run.nproc)}
    feedback.expect(printed[0] > 0 and all(n == 0 for r, n in printed.items() if r),
                    "only rank 0 prints the epoch summary",
                    "rank 0 printed no epoch summary: print a line with the test accuracy, "
                    "such as 'epoch 0: test accuracy 41.2%', where rank == 0" if printed[0] == 0 else
                    f"{_on([r for r, n in printed.items() if r and n], run.nproc)} printed the epoch "
                    f"summary too: print only where rank == 0.", hint=3)


def _leaves_the_group(feedback: Feedback, target) -> None:
    """The script ends with dist.destroy_process_group() (read from its text; a Run has none)."""
    source = _source(target)
    if source is not None:
        feedback.expect(re.search(r"^[^#\n]*\bdestroy_process_group\(", source, re.M),
                        "the script ends by leaving the process group (dist.destroy_process_group())",
                        "the script never calls dist.destroy_process_group(): end with it, so that each "
                        "rank leaves the group cleanly, after its last collective has finished (without it, "
                        "NCCL warns at exit that pending operations may not be done).",
                        hint=3)


def _source(target) -> str | None:
    """The text of the learner's script, or None when the target is a finished Run."""
    try:
        return Path(os.fspath(target)).read_text(encoding="utf-8")
    except (TypeError, OSError):
        return None
