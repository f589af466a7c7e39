"""Exercise 01-loop: a correct training loop, an honest logging window, and a learning-rate search.

CPU ranks that share no gradients (2, or ``LABKIT_RANKS``): each trains with its own learning
rate from ``--lrs``, and at the end one collective tells every rank which rate won. The check
reads the script's settings from what its skeleton logs at step 0.
"""

from __future__ import annotations

import math

from labkit import _hardware
from labkit._course.checks._common import _config, _last, _metrics
from labkit._course.attempt import launched
from labkit._course.feedback import Feedback, check

EXERCISE = "01-loop"

HINTS = [
    "Gradients add up in .grad until something clears them. Clear them once per step, "
    "before loss.backward(), with optimizer.zero_grad(set_to_none=True).",
    "BatchNorm updates its running statistics on every forward pass in training mode. "
    "Testing must not: model.eval() before the test loop, model.train() after it, and "
    "torch.no_grad() around it so that no graph is built.",
    "A window is --log-every steps: log its mean loss, (window_loss / args.log_every).item(), "
    "and its samples, args.log_every * args.batch_size. To compare the ranks: results = "
    "[None] * world_size; dist.all_gather_object(results, (accuracy, lr)); then max(results).",
]

#: The settings the skeleton logs at step 0 (its argparse defaults, unless the check passes others).
SETTINGS = ["lrs", "epochs", "batch_size", "log_every", "train_size"]
#: The rates the skeleton's default --lrs spans; with more than 2 ranks the check passes one per rank
#: between them (spaced evenly on a log scale), so that the largest still trains the loss down.
RATES = (0.01, 0.05)


def _lrs_for(world: int) -> list[str]:
    """Script arguments giving ``world`` ranks a rate each: none for 2 (the skeleton's default)."""
    if world == 2:
        return []
    low, high = RATES
    return ["--lrs", *(f"{low * (high / low) ** (i / (world - 1)):.4g}" for i in range(world))]


@check
def check_training_loop(target="scripts/ex01_loop.py", *, timeout_s: float = 300) -> Feedback:
    """Exercise 01-loop: a correct training step, evaluation that changes nothing, honest
    logging windows, and every rank agreeing on the best learning rate (2 CPU ranks, or
    ``LABKIT_RANKS``, each with a rate of its own).

    Example (exercises/01_single_device.ipynb)::

        labkit.check_training_loop("scripts/ex01_loop.py")
    """
    world = max(2, _hardware.cpu_ranks())
    feedback, run = launched(EXERCISE, target, nproc=world, device="cpu", args=_lrs_for(world), timeout_s=timeout_s,
                             name="check-01-loop")
    df = _metrics(feedback, run, ["lr", "test_acc", "best_lr", *SETTINGS])
    setting = _config(df, SETTINGS)
    rates = [float(lr) for lr in str(setting["lrs"]).split()]
    _own_rates(feedback, _last(df, "lr"), rates, setting["lrs"])
    _windows(feedback, df, setting)
    _evaluation(feedback, df)
    _winner(feedback, df, rates)
    return feedback


def _own_rates(feedback: Feedback, lrs: dict, rates: list[float], given: str) -> None:
    """Rank r trains with the r-th rate of --lrs."""
    feedback.expect(all(lrs[r] == rates[r] for r in lrs),
                    "each rank trains with its own learning rate",
                    "rank(s) " + ", ".join(f"{r} trained with lr {lrs[r]:g}" for r in lrs if lrs[r] != rates[r])
                    + f" (--lrs {given}): pick args.lrs[rank].")


def _windows(feedback: Feedback, df, setting: dict) -> None:
    """Every --log-every steps a window: its samples, enough of them, and a loss that falls."""
    if "loss" not in df.columns or "samples" not in df.columns:
        feedback.stop("no window was logged: every --log-every steps, metrics.log(step, "
                      "loss=..., samples=...).", hint=3)
    windows = df.dropna(subset=["loss"])
    log_every, batch_size = int(setting["log_every"]), int(setting["batch_size"])
    per_window = log_every * batch_size
    bad_samples = sorted(set(windows["samples"].dropna()) - {per_window})
    feedback.expect(not bad_samples and windows["samples"].notna().all(),
                    f"each window logs the {per_window} samples it processed ({log_every} steps × batch "
                    f"{batch_size})",
                    f"a window logged samples={bad_samples or 'nothing'}; it processed "
                    f"log_every × batch_size = {per_window}.", hint=3)
    from labkit.data import CLASSES   # CIFAR-10's, the synthetic set's too

    first_loss = windows.groupby("rank")["loss"].first()
    start = math.log(len(CLASSES))   # an untrained model's cross-entropy: about ln 10
    feedback.expect(bool((first_loss < 1.5 * start).all()),
                    f"each window logs its mean loss (the first: {first_loss.max():.2f}, near ln {len(CLASSES)} = "
                    f"{start:.2f} for an untrained model)",
                    f"rank {first_loss.idxmax()}'s first window logged a loss of {first_loss.max():.2f}, where an "
                    f"untrained model's mean loss is near ln {len(CLASSES)} = {start:.2f}: log the window's mean, "
                    f"window_loss / log_every, not its sum.", hint=3)
    steps = int(setting["epochs"]) * (int(setting["train_size"]) // batch_size)  # the loader drops the last
    counts = windows.groupby("rank").size()
    feedback.expect(counts.min() >= steps // log_every, f"{counts.min()} windows per rank: enough to time honestly",
                    f"only {counts.min()} windows on a rank: log one every --log-every steps.", hint=3)
    lrs = _last(df, "lr")
    best_rank = max(lrs, key=lambda r: lrs[r])  # the larger rate trains further in 3 epochs
    curve = windows[windows["rank"] == best_rank]["loss"].to_numpy()
    first, last = curve[:3].mean(), curve[-3:].mean()
    feedback.expect(last < first - 0.2, f"the loss falls ({first:.2f} → {last:.2f} at lr {lrs[best_rank]:g})",
                    f"at lr {lrs[best_rank]:g} the loss went from {first:.2f} to {last:.2f}: does every "
                    f"step clear the old gradients (optimizer.zero_grad) before loss.backward(), "
                    f"and call optimizer.step() after it?", hint=1)


def _evaluation(feedback: Feedback, df) -> None:
    """Testing leaves BatchNorm's running statistics alone, and training mode comes back."""
    evals = df.dropna(subset=["bn_changed"])
    feedback.expect(not evals["bn_changed"].astype(bool).any(),
                    "testing leaves BatchNorm's running statistics alone (model.eval())",
                    "testing changed BatchNorm's running statistics: call model.eval() before it.", hint=2)
    feedback.expect(evals["training_after_eval"].astype(bool).all(),
                    "the model is back in training mode after testing",
                    "the model stayed in evaluation mode after testing: call model.train() after it.", hint=2)


def _winner(feedback: Feedback, df, rates: list[float]) -> None:
    """Every rank names the rate with the best test accuracy, found with one collective."""
    accs = _last(df, "test_acc")
    top = max(accs.values())
    winners = [rates[r] for r in sorted(accs) if accs[r] == top]   # a tie has several: any of them won
    best = _last(df, "best_lr")
    named = set(best.values())
    scores = ", ".join(f"lr {rates[r]:g}: {accs[r]:.1%}" for r in sorted(accs))
    won = " or ".join(f"lr {w:g}" for w in winners) + (" (a tie)" if len(winners) > 1 else "")
    feedback.expect(len(named) == 1 and named <= set(winners),
                    f"every rank names lr {min(named or winners):g} as the winner ({scores})",
                    "the ranks name " + ", ".join(f"rank {r}: {v:g}" for r, v in best.items())
                    + f" but {won} won: gather every rank's result (dist.all_gather_object) "
                      "and take the best on every rank.", hint=3)
