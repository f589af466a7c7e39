"""Exercises 00 to 02: the first collective, a correct training loop, DDP."""

from __future__ import annotations

import os
import re
from pathlib import Path

from labkit._feedback import Feedback, attempt
from labkit._checks._common import _last, _metrics, _on, _ranks


# -- 00: the first collective ---------------------------------------------------------------
def check_hello(target="scripts/ex00_hello.py", *, timeout: float = 180) -> Feedback:
    """Exercise 00-hello: every rank knows its rank and the world size, and holds the sum of the ranks.

    Launches on 3 CPU ranks, so that a number written for 2 ranks shows up.
    """
    feedback, run = attempt("00-hello", target, nproc=3, device="cpu", timeout=timeout,
                            name="check-00-hello")
    if run is None:
        return feedback
    df = _metrics(feedback, run, ["my_rank", "my_world_size", "rank_sum"])
    if df is None:
        return feedback
    world = run.nproc
    ranks, sizes, sums = _last(df, "my_rank"), _last(df, "my_world_size"), _last(df, "rank_sum")
    wrong = {r: v for r, v in ranks.items() if v != r}
    feedback.expect(not wrong, f"each of the {world} ranks knows its own rank",
                    "rank(s) " + ", ".join(f"{r} say they are rank {v}" for r, v in wrong.items())
                    + ": read RANK from the environment (int(os.environ['RANK'])).", hint=1)
    wrong = {r: v for r, v in sizes.items() if v != world}
    feedback.expect(not wrong, f"every rank knows the world size ({world})",
                    f"torchrun started {world} ranks but rank(s) "
                    + ", ".join(f"{r} think there are {v}" for r, v in wrong.items())
                    + ": read WORLD_SIZE from the environment.", hint=1)
    expected = world * (world - 1) / 2
    wrong = {r: v for r, v in sums.items() if v != expected}
    if not wrong:
        feedback.ok(f"every rank holds the sum of the ranks, {expected:.0f} = "
                    f"{world}·({world}−1)/2")
    elif all(sums[r] == r for r in sums):
        feedback.fail("each rank's sum is its own rank number: call dist.all_reduce on the tensor, "
                      "and read the result from that same tensor (it works in place).", hint=3)
    elif all(v == world - 1 for v in sums.values()):
        feedback.fail(f"every rank holds {world - 1}, the largest rank, not the sum: the reduction "
                      f"should add (the default, ReduceOp.SUM), not take the maximum.", hint=2)
    else:
        feedback.fail("the sums are wrong: " + ", ".join(f"rank {r} holds {v:g}" for r, v in wrong.items())
                      + f"; every rank should hold {expected:.0f}.", hint=2)
    return feedback


# -- 01: a correct loop, an honest window, a learning-rate search ---------------------------
LRS_01 = (0.01, 0.05)


def check_training_loop(target="scripts/ex01_loop.py", *, timeout: float = 300) -> Feedback:
    """Exercise 01-loop: a correct training step, evaluation that changes nothing, honest
    logging windows, and every rank agreeing on the best learning rate (2 CPU ranks)."""
    feedback, run = attempt("01-loop", target, nproc=2, device="cpu", timeout=timeout,
                            args=["--lrs", *map(str, LRS_01)], name="check-01-loop")
    if run is None:
        return feedback
    df = _metrics(feedback, run, ["lr", "test_acc", "best_lr"])
    if df is None:
        return feedback
    lrs = _last(df, "lr")
    feedback.expect(all(lrs[r] == LRS_01[r] for r in lrs),
                    "each rank trains with its own learning rate",
                    "rank(s) " + ", ".join(f"{r} trained with lr {lrs[r]:g}" for r in lrs
                                           if lrs[r] != LRS_01[r])
                    + f" (--lrs {' '.join(map(str, LRS_01))}): pick args.lrs[rank].")
    if "loss" not in df.columns or "samples" not in df.columns:
        feedback.fail("no window was logged: every --log-every steps, metrics.log(step, "
                      "loss=..., samples=...).", hint=3)
        return feedback
    windows = df.dropna(subset=["loss"])
    per_window = 4 * 32
    bad_samples = sorted(set(windows["samples"].dropna()) - {per_window})
    feedback.expect(not bad_samples and windows["samples"].notna().all(),
                    f"each window logs the {per_window} samples it processed (4 steps × batch 32)",
                    f"a window logged samples={bad_samples or 'nothing'}; it processed "
                    f"log_every × batch_size = {per_window}.", hint=3)
    counts = windows.groupby("rank").size()
    feedback.expect(counts.min() >= 20, f"{counts.min()} windows per rank: enough to time honestly",
                    f"only {counts.min()} windows on a rank: log one every --log-every steps.", hint=3)
    best_rank = max(lrs, key=lambda r: lrs[r])  # the larger rate trains further in 3 epochs
    curve = windows[windows["rank"] == best_rank]["loss"].to_numpy()
    first, last = curve[:3].mean(), curve[-3:].mean()
    feedback.expect(last < first - 0.2, f"the loss falls ({first:.2f} → {last:.2f} at lr {lrs[best_rank]:g})",
                    f"at lr {lrs[best_rank]:g} the loss went from {first:.2f} to {last:.2f}: does every "
                    f"step clear the old gradients (optimizer.zero_grad) before loss.backward(), "
                    f"and call optimizer.step() after it?", hint=1)
    evals = df.dropna(subset=["bn_changed"])
    feedback.expect(not evals["bn_changed"].astype(bool).any(),
                    "testing leaves BatchNorm's running statistics alone (model.eval())",
                    "testing changed BatchNorm's running statistics: call model.eval() before it.", hint=2)
    feedback.expect(evals["training_after_eval"].astype(bool).all(),
                    "the model is back in training mode after testing",
                    "the model stayed in evaluation mode after testing: call model.train() after it.", hint=2)
    accs = _last(df, "test_acc")
    winner = LRS_01[max(accs, key=lambda r: accs[r])]
    best = _last(df, "best_lr")
    scores = ", ".join(f"lr {LRS_01[r]:g}: {accs[r]:.1%}" for r in sorted(accs))
    feedback.expect(all(v == winner for v in best.values()),
                    f"every rank names lr {winner:g} as the winner ({scores})",
                    "the ranks name " + ", ".join(f"rank {r}: {v:g}" for r, v in best.items())
                    + f" but lr {winner:g} won: gather every rank's result (dist.all_gather_object) "
                      "and take the best on every rank.", hint=3)
    return feedback


# -- 02: DDP -----------------------------------------------------------------------------------
def check_ddp(target="scripts/ex02_ddp.py", *, timeout: float = 300) -> Feedback:
    """Exercise 02-ddp: each rank its own share of the data, a new order each epoch, weights
    kept equal by DDP, one test accuracy for all, and rank 0 alone printing."""
    feedback, run = attempt("02-ddp", target, timeout=timeout, name="check-02-ddp", **_ranks(2))
    if run is None:
        if feedback.failure is not None and "device_ids" in (feedback.failure.message or ""):
            feedback.fail("on CPU ranks, DDP takes device_ids=None: device_ids=[local_rank] names a GPU. "
                          "Pass [local_rank] only when device.type == 'cuda'.", hint=3)
        return feedback
    df = _metrics(feedback, run, ["first_batch", "test_acc", "weights_fingerprint"])
    if df is None:
        return feedback
    starts = df.dropna(subset=["first_batch"]).pivot_table(
        index="epoch", columns="rank", values="first_batch", aggfunc="first")
    shared = (starts.nunique(axis=1) < starts.shape[1]).any()
    feedback.expect(not shared, "each rank starts every epoch with samples of its own",
                    "rank 1 saw the same samples as rank 0: is the DistributedSampler in place, "
                    "and passed to the DataLoader as sampler=?", hint=2)
    epoch_steps = df.dropna(subset=["first_batch"]).groupby("epoch")["step"].first()
    if len(epoch_steps) > 1:
        expected = 1024 // (32 * run.nproc)
        measured = int(epoch_steps.iloc[1] - epoch_steps.iloc[0])
        feedback.expect(measured == expected,
                        f"an epoch takes {measured} steps: 1024 images / (32 per rank × {run.nproc} ranks)",
                        f"an epoch took {measured} steps; with {run.nproc} ranks sharing 1024 images "
                        f"32 at a time it takes {expected}: does each rank get only its share?", hint=2)
    if len(starts) > 1:
        repeats = (starts.nunique(axis=0) < len(starts)).any()
        feedback.expect(not repeats, "every epoch has a new order",
                        "each epoch starts with the same samples on a rank: call "
                        "sampler.set_epoch(epoch) at the start of every epoch, and keep the "
                        "sampler's shuffle=True (its default).", hint=2)
    weights = _last(df, "weights_fingerprint")
    feedback.expect(len(set(weights.values())) == 1, "all ranks end with the same weights (DDP)",
                    "the ranks ended with different weights: wrap the model in "
                    "DistributedDataParallel, so that every step averages the gradients.", hint=3)
    accs = df.dropna(subset=["test_acc"]).pivot_table(index="epoch", columns="rank", values="test_acc")
    feedback.expect((accs.nunique(axis=1) == 1).all(), "every rank reports the same test accuracy",
                    "the ranks report different test accuracies: dist.all_reduce the counts "
                    "before dividing, so that each rank gets the whole test set's accuracy.", hint=3)
    # An epoch summary is a printed line that names the accuracy ("epoch 0: test accuracy 41.2%").
    printed = {r: run.output(r).lower().count("accuracy") for r in range(run.nproc)}
    feedback.expect(printed[0] > 0 and all(n == 0 for r, n in printed.items() if r),
                    "only rank 0 prints the epoch summary",
                    "rank 0 printed no epoch summary: print a line with the test accuracy, "
                    "such as 'epoch 0: test accuracy 41.2%', where rank == 0" if printed[0] == 0 else
                    f"{_on([r for r, n in printed.items() if r and n], run.nproc)} printed the epoch "
                    f"summary too: print only where rank == 0.", hint=3)
    source = _source(target)
    if source is not None:
        feedback.expect(re.search(r"^[^#\n]*\bdestroy_process_group\(", source, re.M),
                        "the script ends by leaving the process group (dist.destroy_process_group())",
                        "the script never calls dist.destroy_process_group(): end with it, so that each "
                        "rank leaves the group cleanly, after its last collective has finished (without it, "
                        "NCCL warns at exit that pending operations may not be done).",
                        hint=3)
    return feedback


def _source(target) -> str | None:
    """The text of the learner's script, or None when the target is a finished Run."""
    try:
        return Path(os.fspath(target)).read_text(encoding="utf-8")
    except (TypeError, OSError):
        return None
