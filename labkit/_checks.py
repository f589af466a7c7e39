"""The exercises' checks: run (or read) the learner's launch and say, in words, what is right and wrong.

Each ``check_*`` takes the exercise's script (it launches it, showing every rank's output) or
a finished Run, and returns a Feedback (``_feedback.py``). It never raises for a mistake in
the learner's code: a TODO not done yet, an exception in a rank or a wrong number all become
findings. Each check reads what the exercise's script logs outside its TODO regions.

Used by the notebooks in ``exercises/`` and ``solutions/``::

    labkit.check_ddp("scripts/ex02_ddp.py")
"""

from __future__ import annotations

from labkit import _hardware
from labkit._errors import NoMetricsError
from labkit._feedback import Feedback, attempt

__all__ = ["check_hello", "check_training_loop", "check_ddp"]


def _ranks(minimum: int = 2) -> dict:
    """Launch options for a check: every GPU when there are ``minimum`` or more, else CPU ranks."""
    gpus = _hardware.gpu_count()
    if gpus >= minimum:
        return {"nproc": min(gpus, 8 if not _hardware.is_smoke() else minimum), "device": "auto"}
    return {"nproc": minimum, "device": "cpu"}


def _metrics(feedback: Feedback, run, needed: list[str]):
    """The run's metrics if every rank logged the ``needed`` columns; else a finding and None."""
    try:
        df = run.metrics()
    except NoMetricsError:
        feedback.fail("the script logged no metrics: keep the metrics.log(...) lines of the skeleton.")
        return None
    missing = [c for c in needed if c not in df.columns]
    if missing:
        feedback.fail(f"the script never logged {', '.join(missing)}: keep the skeleton's "
                      f"metrics.log(...) lines (and fill in the TODO that logs the window).")
        return None
    silent = sorted(set(range(run.nproc)) - set(df["rank"]))
    if silent:
        feedback.fail(f"rank(s) {silent} logged nothing: did they stop early?")
        return None
    return df


def _last(df, column: str):
    """{rank: last logged value of column}."""
    return df.dropna(subset=[column]).groupby("rank")[column].last().to_dict()


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
                    + ": read RANK from the environment (int(os.environ['RANK'])).")
    wrong = {r: v for r, v in sizes.items() if v != world}
    feedback.expect(not wrong, f"every rank knows the world size ({world})",
                    f"torchrun started {world} ranks but rank(s) "
                    + ", ".join(f"{r} think there are {v}" for r, v in wrong.items())
                    + ": read WORLD_SIZE from the environment.")
    expected = world * (world - 1) / 2
    wrong = {r: v for r, v in sums.items() if v != expected}
    if not wrong:
        feedback.ok(f"every rank holds the sum of the ranks, {expected:.0f} = "
                    f"{world}·({world}−1)/2")
    elif all(sums[r] == r for r in sums):
        feedback.fail("each rank's sum is its own rank number: call dist.all_reduce on the tensor, "
                      "and read the result from that same tensor (it works in place).")
    elif all(v == world - 1 for v in sums.values()):
        feedback.fail(f"every rank holds {world - 1}, the largest rank, not the sum: the reduction "
                      f"should add (the default, ReduceOp.SUM), not take the maximum.")
    else:
        feedback.fail("the sums are wrong: " + ", ".join(f"rank {r} holds {v:g}" for r, v in wrong.items())
                      + f"; every rank should hold {expected:.0f}.")
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
                      "loss=..., samples=...).")
        return feedback
    windows = df.dropna(subset=["loss"])
    per_window = 4 * 32
    bad_samples = sorted(set(windows["samples"].dropna()) - {per_window})
    feedback.expect(not bad_samples and windows["samples"].notna().all(),
                    f"each window logs the {per_window} samples it processed (4 steps × batch 32)",
                    f"a window logged samples={bad_samples or 'nothing'}; it processed "
                    f"log_every × batch_size = {per_window}.")
    counts = windows.groupby("rank").size()
    feedback.expect(counts.min() >= 20, f"{counts.min()} windows per rank: enough to time honestly",
                    f"only {counts.min()} windows on a rank: log one every --log-every steps.")
    best_rank = max(lrs, key=lambda r: lrs[r])  # the larger rate trains further in 3 epochs
    curve = windows[windows["rank"] == best_rank]["loss"].to_numpy()
    first, last = curve[:3].mean(), curve[-3:].mean()
    feedback.expect(last < first - 0.2, f"the loss falls ({first:.2f} → {last:.2f} at lr {lrs[best_rank]:g})",
                    f"at lr {lrs[best_rank]:g} the loss went from {first:.2f} to {last:.2f}: clear the "
                    f"old gradients (optimizer.zero_grad) before every loss.backward().")
    evals = df.dropna(subset=["bn_changed"])
    feedback.expect(not evals["bn_changed"].astype(bool).any(),
                    "testing leaves BatchNorm's running statistics alone (model.eval())",
                    "testing changed BatchNorm's running statistics: call model.eval() before it.")
    feedback.expect(evals["training_after_eval"].astype(bool).all(),
                    "the model is back in training mode after testing",
                    "the model stayed in evaluation mode after testing: call model.train() after it.")
    accs = _last(df, "test_acc")
    winner = LRS_01[max(accs, key=lambda r: accs[r])]
    best = _last(df, "best_lr")
    scores = ", ".join(f"lr {LRS_01[r]:g}: {accs[r]:.1%}" for r in sorted(accs))
    feedback.expect(all(v == winner for v in best.values()),
                    f"every rank names lr {winner:g} as the winner ({scores})",
                    "the ranks name " + ", ".join(f"rank {r}: {v:g}" for r, v in best.items())
                    + f" but lr {winner:g} won: gather every rank's result (dist.all_gather_object) "
                      "and take the best on every rank.")
    return feedback


# -- 02: DDP -----------------------------------------------------------------------------------
def check_ddp(target="scripts/ex02_ddp.py", *, timeout: float = 300) -> Feedback:
    """Exercise 02-ddp: each rank its own share of the data, a new order each epoch, weights
    kept equal by DDP, one test accuracy for all, and rank 0 alone printing."""
    feedback, run = attempt("02-ddp", target, timeout=timeout, name="check-02-ddp", **_ranks(2))
    if run is None:
        return feedback
    df = _metrics(feedback, run, ["first_batch", "test_acc", "weights_fingerprint"])
    if df is None:
        return feedback
    starts = df.dropna(subset=["first_batch"]).pivot_table(
        index="epoch", columns="rank", values="first_batch", aggfunc="first")
    shared = (starts.nunique(axis=1) < starts.shape[1]).any()
    feedback.expect(not shared, "each rank starts every epoch with samples of its own",
                    "rank 1 saw the same samples as rank 0: is the DistributedSampler in place, "
                    "and passed to the DataLoader as sampler=?")
    epoch_steps = df.dropna(subset=["first_batch"]).groupby("epoch")["step"].first()
    if len(epoch_steps) > 1:
        expected = 1024 // (32 * run.nproc)
        measured = int(epoch_steps.iloc[1] - epoch_steps.iloc[0])
        feedback.expect(measured == expected,
                        f"an epoch takes {measured} steps: 1024 images / (32 per rank × {run.nproc} ranks)",
                        f"an epoch took {measured} steps; with {run.nproc} ranks sharing 1024 images "
                        f"32 at a time it takes {expected}: does each rank get only its share?")
    if len(starts) > 1:
        repeats = (starts.nunique(axis=0) < len(starts)).any()
        feedback.expect(not repeats, "every epoch has a new order",
                        "each epoch starts with the same samples on a rank: call "
                        "sampler.set_epoch(epoch) at the start of every epoch.")
    weights = _last(df, "weights_fingerprint")
    feedback.expect(len(set(weights.values())) == 1, "all ranks end with the same weights (DDP)",
                    "the ranks ended with different weights: wrap the model in "
                    "DistributedDataParallel, so that every step averages the gradients.")
    accs = df.dropna(subset=["test_acc"]).pivot_table(index="epoch", columns="rank", values="test_acc")
    feedback.expect((accs.nunique(axis=1) == 1).all(), "every rank reports the same test accuracy",
                    "the ranks report different test accuracies: dist.all_reduce the counts "
                    "before dividing, so that each rank gets the whole test set's accuracy.")
    printed = {r: run.output(r).count("test accuracy") for r in range(run.nproc)}
    feedback.expect(printed[0] > 0 and all(n == 0 for r, n in printed.items() if r),
                    "only rank 0 prints the epoch summary",
                    "rank 0 printed no epoch summary" if printed[0] == 0 else
                    f"rank(s) {[r for r, n in printed.items() if r and n]} printed the epoch summary "
                    f"too: print only where rank == 0.")
    return feedback



# ==============================================================================================
# Exercises 05 (checkpointing) and 06 (FSDP)
# ==============================================================================================
__all__ += ["check_resume", "check_fsdp"]

#: Exercise 05's fault drill: 8 steps an epoch, a checkpoint every 6 steps, the last rank
#: crashing at step 14, so that the job resumes mid-epoch from step 12 and redoes 13 and 14.
DRILL_05 = {"epochs": 3, "batch_size": 16, "steps_per_epoch": 8, "ckpt_every": 6, "crash_at": 14}


def _walk(obj, path=""):
    """(path, leaf) for every leaf of nested dicts, lists and tuples, in a fixed order."""
    if isinstance(obj, dict):
        for key in obj:
            yield from _walk(obj[key], f"{path}/{key}")
    elif isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            yield from _walk(item, f"{path}/{i}")
    else:
        yield path, obj


def _wrapper_keys(state) -> list[str]:
    """Keys that start with DDP's ``module.`` anywhere in a loaded checkpoint."""
    found, stack = [], [state]
    while stack:
        obj = stack.pop()
        if isinstance(obj, dict):
            found += [k for k in obj if isinstance(k, str) and k.startswith("module.")]
            stack += list(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack += list(obj)
    return found


def _float_tensors(state) -> dict:
    """{path: tensor} of the floating-point tensors in a loaded checkpoint: weights, optimizer state."""
    import torch

    return {path: leaf for path, leaf in _walk(state)
            if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()}


def _differences(a: dict, b: dict, *, exact: bool) -> list[str]:
    """Paths at which two {path: tensor} dicts differ (exactly, or within a GPU's rounding)."""
    import torch

    differ = sorted(set(a) ^ set(b))
    for path in sorted(set(a) & set(b)):
        x, y = a[path], b[path]
        same = x.shape == y.shape and x.dtype == y.dtype and (
            torch.equal(x, y) if exact else torch.allclose(x, y, rtol=1e-4, atol=1e-6))
        if not same:
            differ.append(path)
    return differ


def _load_latest(folder):
    """(path, state, error) of the newest checkpoint in ``folder``, loaded as a resume loads it."""
    import warnings

    import torch

    from labkit import checkpoint

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a torn file is skipped; the caller says what is missing
        path = checkpoint.latest(folder)
    if path is None:
        return None, None, None
    try:
        return path, torch.load(path, map_location="cpu", weights_only=True), None
    except Exception as err:  # noqa: BLE001 - whatever it is, the learner needs to hear it
        return path, None, str(err).strip().splitlines()[0][:200]


def _on(ranks, world_size: int) -> str:
    """'rank 1', 'ranks 1, 3' or 'every rank'."""
    ranks = sorted(ranks)
    if len(ranks) == world_size > 1:
        return "every rank"
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _losses(df):
    """Each rank's loss per step; a step done twice (before and after a restart): the later one."""
    return df.dropna(subset=["loss"]).groupby(["rank", "step"])["loss"].last()


def _resume_pieces(feedback: Feedback, saved: dict, after: dict, step: int) -> list[str]:
    """One finding per piece of state: is it, right after the resume, what was saved at ``step``?

    ``saved`` and ``after``: {rank: the fingerprint row the skeleton logged} when saving and
    right after resuming. Returns the short fixes for the pieces that did not come back.
    """
    fixes = []
    ranks = [r for r in sorted(after) if r in saved]
    if not ranks:
        return fixes

    def differ(*columns):
        return [r for r in ranks if any(after[r][c] != saved[r][c] for c in columns)]

    def on(wrong):
        return _on(wrong, len(ranks))

    wrong = differ("weights_fp")
    if not feedback.expect(not wrong, f"after the restart every rank holds exactly the weights saved at "
                                      f"step {step}",
                           f"after the restart the weights on {on(wrong)} are not those saved at step "
                           f"{step}: save model.module.state_dict() and load it back into model.module on "
                           f"every rank."):
        fixes.append("restore the model's weights on every rank")
    wrong = differ("momentum_fp")
    empty = " (it starts empty)" if any(after[r]["momentum_fp"] == 0 for r in wrong) else ""
    if not feedback.expect(not wrong, "the optimizer's momentum came back as it was",
                           f"the optimizer's momentum on {on(wrong)} is not what it was at step {step}"
                           f"{empty}: save optimizer.state_dict() and restore it with "
                           f"optimizer.load_state_dict(...); without it, SGD's next steps point elsewhere."):
        fixes.append("save and restore the optimizer's state (its momentum) too")
    wrong = differ("rng_fp")
    borrowed = [r for r in wrong if r != 0 and 0 in saved and after[r]["rng_fp"] == saved[0]["rng_fp"]]
    if not wrong:
        feedback.ok("each rank's random stream goes on where it was, so the random flips repeat")
    elif borrowed:
        feedback.fail(f"{on(borrowed)} went on with rank 0's random stream, not its own: each rank draws "
                      f"its own flips, so gather every rank's checkpoint.rng_state() on rank 0 "
                      f"(dist.gather_object) and restore state['rng'][rank] on each rank.")
        fixes.append("restore each rank's own RNG state")
    else:
        feedback.fail(f"the random stream on {on(wrong)} does not go on where it was at step {step}: "
                      f"save every rank's checkpoint.rng_state() and restore it with "
                      f"checkpoint.set_rng_state(...), or the random flips differ.")
        fixes.append("save and restore every rank's RNG state")
    wrong = differ("epoch", "batch_in_epoch")
    if not wrong:
        where = saved[ranks[0]]
        feedback.ok(f"the sampler goes on at epoch {where['epoch']:.0f}, batch "
                    f"{where['batch_in_epoch']:.0f}, where the run was at step {step}")
    else:
        was, now = saved[wrong[0]], after[wrong[0]]
        feedback.fail(f"after the restart {on(wrong)} started at epoch {now['epoch']:.0f}, batch "
                      f"{now['batch_in_epoch']:.0f}, but at step {step} the run was at epoch "
                      f"{was['epoch']:.0f}, batch {was['batch_in_epoch']:.0f}: save epoch and "
                      f"batch_in_epoch, and restore both (the loop sets the sampler from them), or the "
                      f"run trains on other batches than it would have.")
        fixes.append("save and restore the sampler's epoch and position")
    return fixes


def check_resume(target="scripts/ex05_resume.py", *, timeout: float = 300,
                 ckpt_dir="checkpoints/check-05") -> Feedback:
    """Exercise 05-resume: a checkpoint with the whole training state, and a resume after a
    crash that ends bit-identical (on CPU) to a run that was never interrupted.

    Launches the script twice on 2 ranks (every GPU, if there are two or more), each time with
    a fresh checkpoint folder under ``ckpt_dir``: first from start to finish, then with the last
    rank crashing at step 14 and ``max_restarts=1``. Compares what each rank logged right after
    resuming with what it logged when the checkpoint was saved, piece by piece; then every
    step's loss, and the final checkpoints of both runs.

    Args:
        target: the exercise's script (a finished Run will not do: the check needs two launches).
        timeout: seconds each launch may take.
        ckpt_dir: where the two runs' checkpoint folders go (emptied first).

    Returns:
        a Feedback; a mistake in the script is a finding, never an exception.

    Example (exercises/05_checkpointing.ipynb)::

        labkit.check_resume("scripts/ex05_resume.py")
    """
    import shutil
    from pathlib import Path

    from labkit._run import Run

    if isinstance(target, Run):
        feedback = Feedback("05-resume")
        feedback.fail("check_resume launches your script itself, twice (once whole, once with a crash): "
                      "pass the script's path, e.g. 'scripts/ex05_resume.py'.")
        return feedback
    ranks, drill = _ranks(2), DRILL_05
    last = ranks["nproc"] - 1
    args = ["--epochs", str(drill["epochs"]), "--batch-size", str(drill["batch_size"]),
            "--train-size", str(drill["steps_per_epoch"] * drill["batch_size"] * ranks["nproc"]),
            "--ckpt-every", str(drill["ckpt_every"])]
    folders = {name: Path(ckpt_dir) / name for name in ("whole", "drill")}
    for folder in folders.values():
        shutil.rmtree(folder, ignore_errors=True)  # the script resumes from whatever it finds

    # 1. The uninterrupted run, and the checkpoint it leaves.
    feedback, whole = attempt("05-resume", target, timeout=timeout, name="check-05-uninterrupted",
                              args=args + ["--ckpt-dir", str(folders["whole"])], **ranks)
    if whole is None or _metrics(feedback, whole, ["loss", "weights_fp"]) is None:
        return feedback
    path, reference, error = _load_latest(folders["whole"])
    if path is None:
        feedback.fail(f"the run left no checkpoint in {folders['whole']}: in save_checkpoint, rank 0 writes "
                      f"one with checkpoint.save_atomic(state, checkpoint.step_path(args.ckpt_dir, step)).")
        return feedback
    if error is not None:
        feedback.fail(f"{path.name} does not load with weights_only=True ({error}): save only tensors, "
                      f"numbers, strings and plain lists and dicts; checkpoint.rng_state() gives the RNG "
                      f"states in that form.")
        return feedback
    wrapped = _wrapper_keys(reference)
    feedback.expect(not wrapped, f"the checkpoint ({path.name}) loads with weights_only=True, and its weights' "
                                 f"names have no 'module.' prefix, so they load into a plain model",
                    f"{path.name} names the weights {wrapped[0] if wrapped else ''!r} and so on: that is the "
                    f"DDP wrapper's state_dict. Save the unwrapped model, model.module.state_dict(), so "
                    f"that the weights load into a plain model.")

    # 2. The fault drill: the last rank crashes; torchrun restarts the job once.
    crash_at = drill["crash_at"]
    resume_at = (crash_at - 1) // drill["ckpt_every"] * drill["ckpt_every"]
    second, run = attempt("05-resume", target, timeout=timeout, name="check-05-fault-drill",
                          max_restarts=1, **ranks,
                          args=args + ["--ckpt-dir", str(folders["drill"]), "--crash-at-step",
                                       str(crash_at), "--crash-rank", str(last)])
    feedback.items += second.items
    feedback.run, feedback.failure = second.run, second.failure
    if run is None:
        return feedback
    df = _metrics(feedback, run, ["loss", "weights_fp"])
    if df is None:
        return feedback
    if 1 not in set(df["restart"]):
        feedback.fail(f"the job never restarted: keep the skeleton's fault drill (rank {last} raises at "
                      f"--crash-at-step in the first attempt).")
        return feedback
    first, again = df[df["restart"] == 0], df[df["restart"] == 1]
    resumed = again.dropna(subset=["resumed_from"]) if "resumed_from" in again else again.iloc[:0]
    fixes = []
    if resumed.empty:
        feedback.fail(f"after the crash at step {crash_at} the restarted job began again at step 0: find the "
                      f"newest checkpoint with checkpoint.latest(args.ckpt_dir), load it, and set step, epoch "
                      f"and batch_in_epoch from it.")
        fixes.append("resume from checkpoint.latest(args.ckpt_dir)")
    else:
        steps = sorted({int(s) for s in resumed["resumed_from"]})
        feedback.expect(steps == [resume_at],
                        f"rank {last} crashed at step {crash_at}; torchrun restarted the job, and every rank "
                        f"resumed at step {resume_at}, the newest checkpoint",
                        f"after the crash at step {crash_at} the job resumed at step "
                        f"{', '.join(map(str, steps))}, but the newest checkpoint before the crash was step "
                        f"{resume_at}: load checkpoint.latest(args.ckpt_dir), and save the step the run has "
                        f"reached.")
        saves = first.dropna(subset=["saved"]) if "saved" in first else first.iloc[:0]
        saved = {int(r["rank"]): r for _, r in saves[saves["step"] == steps[0]].iterrows()}
        after = {int(r["rank"]): r for _, r in resumed.groupby("rank").head(1).iterrows()}
        if saved:
            fixes += _resume_pieces(feedback, saved, after, steps[0])

    # 3. Every loss the drill logged, before the crash and after it (the steps done twice both
    #    times), against the uninterrupted run's; then the final checkpoints.
    exact = run.info.get("device") == "cpu"
    tolerance = 0.0 if exact else 1e-5
    how = "bit for bit" if exact else f"within {tolerance:g} (GPU kernels may round differently)"
    expected = _losses(whole.metrics())
    logged = df.dropna(subset=["loss"])
    keys = list(zip(logged["rank"], logged["step"]))
    gap = abs(logged["loss"].to_numpy() - expected.reindex(keys).to_numpy())
    leave = {int(step) for (_, step), g in zip(keys, gap) if not g <= tolerance}  # NaN: an extra step
    leave |= {int(step) for (rank, step) in expected.index if (rank, step) not in set(keys)}  # a missing one
    twice = set(first.dropna(subset=["loss"])["step"]) & set(again.dropna(subset=["loss"])["step"])
    steps = expected.index.get_level_values("step").nunique()
    if not feedback.expect(not leave, f"the drill's losses equal the uninterrupted run's, {how}: all {steps} "
                                      f"steps on every rank, and the {len(twice)} steps done twice, both times",
                           f"after the restart the losses leave the uninterrupted run's from step "
                           f"{min(leave) if leave else 0} on: "
                           + (fixes[0] if fixes else "some piece of state did not come back; compare what "
                              "you save with everything the loop changes") + "."):
        return feedback
    _, final, _ = _load_latest(folders["drill"])
    if final is not None:
        # Tensors of numbers only: Python's and NumPy's RNGs start from a random seed in each run.
        a, b = _float_tensors(reference), _float_tensors(final)
        differ = _differences(a, b, exact=exact)
        feedback.expect(a and not differ, f"both runs end with the same final checkpoint: all {len(a)} "
                                          f"tensors of weights and optimizer state are equal, {how}",
                        f"the final checkpoints differ at {', '.join(differ[:4]) or 'every tensor'}: both runs "
                        f"should end in the same state.")
    return feedback


# -- 06: FSDP ------------------------------------------------------------------------------------
def _shard_rows(rows: int, world_size: int, rank: int) -> int:
    """Rows of a ``rows``-row tensor that FSDP2 gives ``rank``: torch.chunk's split of dim 0."""
    per_rank = -(-rows // world_size)
    return max(0, min(per_rank, rows - rank * per_rank))


def _fsdp_bytes(dim: int, depth: int, world_size: int, rank: int, *, units: str | None = None,
                root: bool = True) -> dict:
    """What ``rank`` holds of exercise 06's MLPStack after one AdamW step, exactly.

    A parameter is sharded when an FSDP unit holds it: the root (``root``), or its block
    (``units[i] == "1"``); otherwise the rank holds it whole. AdamW keeps two moments shaped
    like the parameter and a 4-byte float32 step counter per parameter tensor.
    """
    import torch

    from labkit.models import MLPStack

    units = "1" * depth if units is None else units
    with torch.device("meta"):
        plain = MLPStack(dim=dim, depth=depth, in_features=dim)
    params = tensors = 0
    for name, p in plain.named_parameters():
        parts = name.split(".")
        sharded = root or (parts[0] == "blocks" and units[int(parts[1])] == "1")
        rows = p.shape[0]
        mine = _shard_rows(rows, world_size, rank) if sharded else rows
        params += mine * (p.numel() // rows) * p.element_size()
        tensors += 1
    return {"params": params, "grads": params, "optimizer": 2 * params + 4 * tensors, "tensors": tensors}


def _mlp_weights(dim: int, depth: int) -> tuple[int, int, int]:
    """Bytes of exercise 06's whole MLPStack, of its root's own weights (stem, head), of one block."""
    import torch

    from labkit.memory import tensor_bytes
    from labkit.models import MLPStack

    with torch.device("meta"):
        plain = MLPStack(dim=dim, depth=depth, in_features=dim)
    whole = tensor_bytes(plain.parameters())
    block = max(tensor_bytes(b.parameters()) for b in plain.blocks)
    return whole, whole - sum(tensor_bytes(b.parameters()) for b in plain.blocks), block


def _name_the_order(feedback: Feedback, script) -> None:
    """A rank failed inside fully_shard: say that the order matters (the root comes last)."""
    import os
    import re

    failure = feedback.failure
    if failure is None or failure.exc_type in ("", "NotImplementedError"):
        return
    frame = r'File "(?P<file>[^"]+)", line (?P<line>\d+)[^\n]*\n[ \t]*(?P<code>[^\n]*)'
    frames = [m for m in re.finditer(frame, failure.traceback or "")
              if os.path.abspath(m["file"]) == os.path.abspath(os.fspath(script))]
    if frames and "fully_shard" in frames[-1]["code"]:
        feedback.fail(f"fully_shard failed on line {frames[-1]['line']}. The order matters: fully_shard "
                      f"each block first, then the model. Once the root has taken every parameter, a "
                      f"block can no longer become a unit of its own.")


def check_fsdp(target="scripts/ex06_fsdp.py", *, timeout: float = 300) -> Feedback:
    """Exercise 06-fsdp: every block and the root are FSDP units, at most the root and one block
    are whole at once, and each rank's bytes after the first step are predicted exactly and
    measured exactly (2 ranks; every GPU, if there are two or more).

    The truth it compares with is worked out here from the model's shapes, the world size and
    the units the script logged (FSDP2 splits dim 0 as torch.chunk does; AdamW adds two moments
    and a 4-byte step counter per tensor), and is tested against what FSDP really holds.

    Args:
        target: the exercise's script, or a finished Run of it.
        timeout: seconds the launch may take.

    Returns:
        a Feedback; a mistake in the script is a finding, never an exception.

    Example (exercises/06_fsdp.ipynb)::

        labkit.check_fsdp("scripts/ex06_fsdp.py")
    """
    feedback, run = attempt("06-fsdp", target, timeout=timeout, name="check-06-fsdp", **_ranks(2))
    if run is None:
        if feedback.failure is not None:  # the target was a script, and a rank raised
            _name_the_order(feedback, target)
        return feedback
    names = ("params", "grads", "optim")
    columns = ["dim", "depth", "block_units", "root_unit", "gathered_bytes",
               *(f"predicted_{n}" for n in names), *(f"measured_{n}" for n in names)]
    df = _metrics(feedback, run, columns)
    if df is None:
        return feedback

    def first(column):
        return df.dropna(subset=[column]).groupby("rank")[column].first().to_dict()

    world = run.nproc
    silent = sorted({r for c in columns for r in range(world) if r not in first(c)})
    if silent:
        feedback.fail(f"{_on(silent, world)} did not log all the check reads (did the run stop early?): "
                      f"keep the skeleton's metrics.log(...) lines.")
        return feedback
    dim, depth = int(first("dim")[0]), int(first("depth")[0])
    units, root = str(first("block_units")[0]), bool(first("root_unit")[0])
    whole, root_bytes, block_bytes = _mlp_weights(dim, depth)

    # The units, and what is whole at once.
    missing = [i for i, u in enumerate(units) if u != "1"]
    feedback.expect(not missing, f"each of the {depth} blocks is an FSDP unit of its own",
                    "no block is an FSDP unit of its own: call fully_shard(block) for each block in "
                    "model.blocks, before the root." if len(missing) == depth else
                    f"block(s) {missing} are not FSDP units of their own: call fully_shard(block) for each "
                    f"block in model.blocks, before the root.")
    feedback.expect(root, "the model itself is an FSDP unit too: the root, which shards the stem and the head",
                    "the model itself is not an FSDP unit, so the stem and the head stay whole on every rank "
                    "and nothing averages their gradients: call fully_shard(model) after the blocks.")
    gathered, limit = int(max(first("gathered_bytes").values())), root_bytes + block_bytes
    if gathered <= limit:
        feedback.ok(f"at most the root and one block were whole at once: {gathered:,} of the model's "
                    f"{whole:,} bytes of weights")
    elif len(missing) == depth and not root:
        feedback.fail(f"nothing is sharded: every rank holds all {gathered:,} bytes of weights, all the time.")
    elif len(missing) == depth:
        feedback.fail(f"the whole model ({gathered:,} bytes of weights) was whole at once: with only the root "
                      f"wrapped, FSDP gathers every weight when the forward pass starts. With each block a "
                      f"unit of its own, only the root and one block ({limit:,} bytes) are whole at a time.")
    elif not root:
        feedback.fail(f"{gathered:,} bytes of weights were whole at once, more than the root and one block "
                      f"({limit:,}): without fully_shard(model), each block is an FSDP root of its own, and "
                      f"a root keeps its weights gathered after its forward. Shard the root last.")
    else:
        feedback.fail(f"{gathered:,} bytes of weights were whole at once, more than the root and one block "
                      f"({limit:,}): shard every block, and leave reshard_after_forward at its default "
                      f"(True), so that each block frees its gathered weights after its forward.")

    # The prediction, against what FSDP done right holds.
    predicted = {r: tuple(int(first(f"predicted_{n}")[r]) for n in names) for r in range(world)}
    truth = {r: _fsdp_bytes(dim, depth, world, r) for r in range(world)}
    tensors = truth[0]["tensors"]
    wrong = [r for r in range(world)
             if predicted[r] != (truth[r]["params"], truth[r]["grads"], truth[r]["optimizer"])]
    if not wrong:
        t = truth[0]
        share = (f"exactly 1/{world}" if t["params"] * world == whole
                 else f"about 1/{world} (some tensors' rows do not divide by {world})")
        feedback.ok(f"your prediction is exact on every rank: rank 0 holds {t['params']:,} bytes of parameters "
                    f"({share} of the model's {whole:,}), {t['grads']:,} of gradients and {t['optimizer']:,} "
                    f"of AdamW state")
    else:
        feedback.fail(_misprediction(wrong[0], predicted[wrong[0]], truth[wrong[0]], whole, world, tensors))

    # The measurement, against what this rank really holds (with the units it has).
    measured = {r: tuple(int(first(f"measured_{n}")[r]) for n in names) for r in range(world)}
    held = {r: _fsdp_bytes(dim, depth, world, r, units=units, root=root) for r in range(world)}
    wrong = [r for r in range(world)
             if measured[r] != (held[r]["params"], held[r]["grads"], held[r]["optimizer"])]
    if not wrong:
        h = held[0]
        feedback.ok(f"your measurement is exact: rank 0 holds {h['params']:,} bytes of parameters, "
                    f"{h['grads']:,} of gradients and {h['optimizer']:,} of AdamW state")
    else:
        r = wrong[0]
        (params, grads, optim), h = measured[r], held[r]
        if params == whole and h["params"] != whole:
            feedback.fail(f"you measured {params:,} bytes of parameters on rank {r}, the whole model's: count "
                          f"each DTensor's local shard (p.to_local()), as memory.model_bytes(model, optimizer) "
                          f"does. Rank {r} holds {h['params']:,}.")
        elif optim == 0:
            feedback.fail("you measured no optimizer state: pass the optimizer too, "
                          "memory.model_bytes(model, optimizer).")
        elif grads == 0:
            feedback.fail("you measured no gradients: measure where the TODO is, after optimizer.step() and "
                          "before the next zero_grad(set_to_none=True) frees them.")
        else:
            feedback.fail(f"rank {r} holds {h['params']:,} / {h['grads']:,} / {h['optimizer']:,} bytes of "
                          f"parameters / gradients / optimizer state, but you measured {params:,} / "
                          f"{grads:,} / {optim:,}: count the local shards, memory.model_bytes(model, optimizer).")
    return feedback


def _misprediction(rank: int, predicted: tuple, truth: dict, whole: int, world: int, tensors: int) -> str:
    """What is wrong with the first wrong number of one rank's prediction, and why."""
    params, grads, optim = predicted
    if params != truth["params"]:
        if params == whole:
            return (f"you predicted the whole model's {whole:,} bytes of parameters on rank {rank}: under FSDP "
                    f"each rank holds only its shard, about 1/{world} of every tensor's rows.")
        if params * world == whole:
            return (f"rank {rank} holds {truth['params']:,} bytes of parameters, not 1/{world} of the model "
                    f"({params:,}): FSDP cuts each tensor's rows like torch.chunk, ceil(rows / {world}) to a "
                    f"rank, so the last rank(s) get fewer, or none.")
        return (f"you predicted {params:,} bytes of parameters on rank {rank}; it holds {truth['params']:,}: "
                f"its dim-0 shard of every parameter, ceil(rows / {world}) rows of each (fewer on the last "
                f"ranks), at 4 bytes a float32.")
    if grads != truth["grads"]:
        return (f"you predicted {grads:,} bytes of gradients on rank {rank}; it holds {truth['grads']:,}: after "
                f"the reduce-scatter each rank keeps only its own shard's gradient, as many bytes as its "
                f"parameters.")
    if optim == 2 * truth["params"]:
        return (f"your AdamW prediction is {4 * tensors} bytes short: besides its two moments, AdamW keeps a "
                f"4-byte step counter for each of the {tensors} parameter tensors, on every rank.")
    if optim in (truth["params"], truth["params"] + 4 * tensors):
        return (f"AdamW keeps two moments per weight (exp_avg and exp_avg_sq), each the size of the shard: "
                f"rank {rank} holds {truth['optimizer']:,} bytes of optimizer state, not {optim:,}.")
    return (f"you predicted {optim:,} bytes of optimizer state on rank {rank}; it holds {truth['optimizer']:,}: "
            f"two moments the size of its shard, and a 4-byte step counter per parameter tensor.")


# ==============================================================================================
# Exercises 03 (SyncBatchNorm) and 04 (gradient accumulation)
# ==============================================================================================
__all__ += ["check_syncbn", "check_accumulation"]


def _saved(feedback: Feedback, run, stem: str):
    """{rank: what the rank saved as ``<run folder>/<stem>_rank<R>.pt``}; else a finding and None."""
    import torch

    found, missing = {}, []
    for rank in range(run.nproc):
        path = run.run_dir / f"{stem}_rank{rank}.pt"
        if not path.is_file():
            missing.append(rank)
            continue
        try:
            found[rank] = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - whatever it is, the learner needs to hear it
            feedback.fail(f"{path.name} does not load ({str(err).strip().splitlines()[0][:200]}): keep the "
                          f"skeleton's torch.save(...) line as it is.")
            return None
    if missing:
        feedback.fail(f"{_on(missing, run.nproc)} saved nothing in the run folder ({stem}_rank<R>.pt): keep "
                      f"the skeleton's torch.save(...) at the end, and the default of --out.")
        return None
    return found


def _config(df, columns: list[str]) -> dict:
    """The settings the skeleton logged at step 0 (rank 0's line)."""
    row = df.dropna(subset=columns)
    row = row[row["rank"] == 0].iloc[0]
    return {c: row[c] for c in columns}


def _gap(got, want) -> float:
    """Largest difference, relative to the largest value wanted (and absolute below 1)."""
    want = want.double()
    return float((got.double() - want).abs().max() / max(1.0, float(want.abs().max())))


def _near(got, want, rtol: float = 1e-3) -> bool:
    """Close enough to name a mistake by what it computed (not the pass/fail tolerance)."""
    import torch

    return got.shape == want.shape and bool(torch.allclose(got.double(), want.double(), rtol=rtol, atol=1e-4))


# -- 03: SyncBatchNorm from one differentiable all-reduce ---------------------------------------
#: Exercise 03's tolerance on every comparison (lesson 03's): float32 sums added in another order.
TOL_03 = 1e-4
MOMENTUM_03, EPS_03 = 0.1, 1e-5
_KEYS_03 = ("output", "input_grad", "weight_grad", "bias_grad", "running_mean", "running_var")


def _syncbn_reference(seed: int, sizes: list[int], channels: int, size: int, steps: int):
    """What ``nn.BatchNorm2d`` computes on the global batch (every rank's samples together), in float64.

    The data are drawn exactly as exercise 03's skeleton draws them: rank r from seed + 1 + r,
    its inputs and then its upstream gradient at each step. Returns (weight, bias, steps), each
    step a dict: "x", "output", "input_grad" (lists, one tensor per rank), "weight_grad",
    "bias_grad", "running_mean", "running_var" (after the step).
    """
    import torch
    from torch import nn

    init = torch.Generator().manual_seed(seed)
    weight = 0.5 + torch.rand(channels, generator=init)
    bias = torch.rand(channels, generator=init) - 0.5
    bn = nn.BatchNorm2d(channels, eps=EPS_03, momentum=MOMENTUM_03).double()
    with torch.no_grad():
        bn.weight.copy_(weight)
        bn.bias.copy_(bias)
    data = [torch.Generator().manual_seed(seed + 1 + r) for r in range(len(sizes))]
    found = []
    for _ in range(steps):
        xs, grads = [], []
        for r, n in enumerate(sizes):
            shape = (n, channels, size, size)
            xs.append(torch.randn(shape, generator=data[r]) * (1 + r) + 2 * r)
            grads.append(torch.randn(shape, generator=data[r]))
        x = torch.cat(xs).double().requires_grad_()
        bn.zero_grad(set_to_none=True)
        y = bn(x)
        y.backward(torch.cat(grads).double())
        found.append({"x": [t.double() for t in xs], "output": list(y.detach().split(sizes)),
                      "input_grad": list(x.grad.split(sizes)), "weight_grad": bn.weight.grad.clone(),
                      "bias_grad": bn.bias.grad.clone(), "running_mean": bn.running_mean.clone(),
                      "running_var": bn.running_var.clone()})
    return weight.double(), bias.double(), found


def _stats_used(x, y, weight, bias, eps: float = EPS_03):
    """The per-channel (mean, variance, fit residual) a layer normalised ``x`` with, read from its output.

    Fits y = a·x + c per channel; BatchNorm's y = weight·(x − mean)/√(var + eps) + bias gives
    a = weight/√(var + eps) and c = bias − a·mean.
    """
    xs, ys = x.double().transpose(0, 1).flatten(1), y.double().transpose(0, 1).flatten(1)
    xc = xs - xs.mean(1, keepdim=True)
    slope = (xc * (ys - ys.mean(1, keepdim=True))).sum(1) / (xc * xc).sum(1)
    offset = ys.mean(1) - slope * xs.mean(1)
    residual = float((ys - (slope[:, None] * xs + offset[:, None])).abs().max())
    return (bias - offset) / slope, (weight / slope) ** 2 - eps, residual


def _explain_output(xs: list, ys: list, weight, bias) -> str:
    """Why a first step's outputs differ from BatchNorm's on the global batch: the statistics used, named."""
    import torch

    dims = (0, 2, 3)
    counts = [x[:, 0].numel() for x in xs]
    n, world = sum(counts), len(xs)
    whole = torch.cat(xs)
    mean, var = whole.mean(dims), whole.var(dims, unbiased=False)
    local = [(x.mean(dims), x.var(dims, unbiased=False)) for x in xs]
    plain_mean = torch.stack([m for m, _ in local]).mean(0)
    plain_var = torch.stack([v for _, v in local]).mean(0)
    within = sum(c * v for c, (_, v) in zip(counts, local)) / n
    sizes = " and ".join(str(len(x)) for x in xs) if world == 2 else "different numbers of"
    used = [_stats_used(x, y, weight, bias) for x, y in zip(xs, ys)]
    scale = max(1.0, float(whole.abs().max()))
    if max(residual for _, _, residual in used) > 1e-3 * scale:
        return ("the outputs are not the inputs normalised per channel: compute one mean and one variance per "
                "channel, over the batch and the pixels (dimensions 0, 2 and 3), then (x − mean) / √(var + eps) "
                "· weight + bias.")
    if all(_near(m, lm) and _near(v, lv) for (m, v, _), (lm, lv) in zip(used, local)):
        return ("each rank normalised its slice with its own mean and variance, as plain BatchNorm does: add up "
                "Σx, Σx² and the count over the ranks (one all-reduce) before you compute them.")
    if all(_near(m, plain_mean) for m, _, _ in used):
        also = (" (and the variance as the plain average of the ranks' variances)"
                if all(_near(v, plain_var) for _, v, _ in used) else "")
        return (f"you took the mean as the plain average of the ranks' means{also}. The ranks hold {sizes} "
                f"samples, so a rank's mean does not count as much as another's: all-reduce the sums and the "
                f"count, and divide the global Σx by the global n.")
    if all(_near(m, mean) for m, _, _ in used):
        if all(_near(v, plain_var) or _near(v, within) for _, v, _ in used):
            return ("the mean is right, but the variance is an average of the ranks' variances: that misses how "
                    "far the ranks' means are from each other. Use the global Σx² / n − mean².")
        if all(_near(v, var * n / (n - 1)) for _, v, _ in used):
            return (f"you normalised with the unbiased variance (÷ n − 1). BatchNorm normalises with the biased "
                    f"one, Σx² / n − mean², and keeps the unbiased one (× n/(n − 1), n = {n}, the global count) "
                    f"only for running_var.")
        return "the mean is right, but the variance is not: Σx² / n − mean², with the global sums and count."
    plain = [_stats_used(x, y, torch.ones_like(weight), torch.zeros_like(bias)) for x, y in zip(xs, ys)]
    if all(_near(m, mean) and _near(v, var) for m, v, _ in plain):
        return "the statistics are right, but the output lacks weight and bias: return x̂ · weight + bias."
    return ("the outputs differ from BatchNorm's on the global batch, and so does the mean they were "
            "normalised with: the global mean is the global Σx over the global n.")


def _explain_running(got_mean, got_var, xs, momentum: float = MOMENTUM_03) -> str:
    """Why the running statistics after the first step (from 0 and 1) are not BatchNorm's."""
    import torch

    dims = (0, 2, 3)
    whole = torch.cat(xs)
    n = whole[:, 0].numel()
    mean, var = whole.mean(dims), whole.var(dims, unbiased=False)
    unbiased = var * n / (n - 1)
    if _near(got_mean, torch.zeros_like(mean)) and _near(got_var, torch.ones_like(var)):
        return ("running_mean and running_var never changed: update them in training mode, "
                "running = (1 − momentum) · running + momentum · batch statistic, or eval() normalises "
                "with 0 and 1.")
    if _near(got_mean, (1 - momentum) * mean):
        return ("the running statistics moved by 1 − momentum, not momentum: momentum is the weight of the "
                "new batch, running = (1 − momentum) · running + momentum · batch (running.lerp_(new, momentum)).")
    if _near(got_mean, mean) and (_near(got_var, var) or _near(got_var, unbiased)):
        return ("the running statistics are the batch's own, with no momentum: running = (1 − momentum) · "
                "running + momentum · batch statistic.")
    if _near(got_mean, momentum * mean) and _near(got_var, (1 - momentum) + momentum * var):
        return (f"running_var holds the biased variance (÷ n). BatchNorm keeps the unbiased one there, "
                f"var · n/(n − 1) with n = {n}, the global count, while it normalises with the biased one.")
    return ("the running statistics after the first step are not BatchNorm's: running_mean should be "
            "momentum · the global mean, and running_var (1 − momentum) + momentum · the global unbiased "
            "variance.")


def check_syncbn(target="scripts/ex03_syncbn.py", *, timeout: float = 180) -> Feedback:
    """Exercise 03-syncbn: a synchronised BatchNorm built from one differentiable all-reduce computes
    what ``nn.BatchNorm2d`` computes on the whole global batch, in forward and backward.

    Launches the script on 2 ranks (every GPU, if there are two or more), which hold different
    numbers of samples on purpose. The script saves what its layer computed at each step; the
    check draws the same seeded data itself, runs ``nn.BatchNorm2d`` (float64) on every rank's
    samples together, and compares: the outputs, the input gradients, the weight and bias
    gradients added over the ranks, and the running statistics. A mismatch is named by the
    statistics the outputs were normalised with (read back from them).

    Args:
        target: the exercise's script, or a finished Run of it.
        timeout: seconds the launch may take.

    Returns:
        a Feedback; a mistake in the script is a finding, never an exception.

    Example (exercises/03_syncbn.ipynb)::

        labkit.check_syncbn("scripts/ex03_syncbn.py")
    """
    feedback, run = attempt("03-syncbn", target, timeout=timeout, name="check-03-syncbn", **_ranks(2))
    if run is None:
        return feedback
    columns = ["samples", "channels", "size", "steps", "seed"]
    df = _metrics(feedback, run, columns)
    saved = None if df is None else _saved(feedback, run, "ex03")
    if saved is None:
        return feedback
    sizes = df.dropna(subset=["channels"]).groupby("rank")["samples"].first().astype(int).tolist()
    setting = {c: int(v) for c, v in _config(df, columns).items()}
    steps = setting["steps"]
    weight, bias, want = _syncbn_reference(setting["seed"], sizes, setting["channels"], setting["size"], steps)
    world, total = run.nproc, sum(sizes)
    broken = [r for r in range(world) if len(saved[r]) != steps or any(
        set(s) != set(_KEYS_03) or s["output"] is None or s["output"].shape != w["output"][r].shape
        for s, w in zip(saved[r], want))]
    if broken:
        feedback.fail(f"{_on(broken, world)} saved something else than the skeleton saves (an output of the "
                      f"input's shape at each of the {steps} steps): keep the skeleton's loop as it is.")
        return feedback

    def worst(key, per_rank=True):
        """(largest gap, step) over the steps (and ranks) for one saved quantity; inf where it is missing."""
        gaps = []
        for s in range(steps):
            for r in range(world):
                got = saved[r][s][key]
                wanted = want[s][key][r] if per_rank else want[s][key]
                gaps.append((float("inf") if got is None or got.shape != wanted.shape else _gap(got, wanted), s + 1))
        return max(gaps)

    shards = " and ".join(map(str, sizes)) if world == 2 else ", ".join(map(str, sizes))
    gap, step = worst("output")
    outputs_right = gap <= TOL_03
    if outputs_right:
        feedback.ok(f"the ranks hold {shards} samples ({total} together, uneven on purpose), and every rank's "
                    f"outputs equal nn.BatchNorm2d's on all {total} at once, at each of the {steps} steps "
                    f"(largest gap {gap:.1e}; tolerance {TOL_03:g})")
    elif step == 1:
        feedback.fail(_explain_output(want[0]["x"], [saved[r][0]["output"] for r in range(world)], weight, bias))
    else:
        feedback.fail(f"the outputs are right at the first step but not at step {step} (gap {gap:.1e}): each step "
                      f"must use that step's statistics only.")

    if outputs_right:
        gap, step = worst("input_grad")
        missing = any(saved[r][0]["input_grad"] is None for r in range(world))
        if gap <= TOL_03:
            feedback.ok(f"so are the input gradients (largest gap {gap:.1e}): the gradient flows back through the "
                        f"all-reduce to every rank's inputs")
        elif missing:
            feedback.fail("no gradient reached the inputs: do not detach x or compute the output under "
                          "torch.no_grad(); only the running statistics' update belongs there.")
        else:
            feedback.fail(f"the outputs are right, but the input gradients are not (off by up to {gap:.1e}): the "
                          f"gradient does not travel back through the all-reduce. Every rank's loss depends on every "
                          f"rank's inputs, so AllReduceSum.backward must all-reduce grad_output too; a plain "
                          f"dist.all_reduce in forward is invisible to autograd.")
        shares = []
        for s in range(steps):
            parts = [saved[r][s][k] for r in range(world) for k in ("weight_grad", "bias_grad")]
            if any(p is None for p in parts):
                shares.append(float("inf"))
                continue
            got = [sum(saved[r][s][k].double() for r in range(world)) for k in ("weight_grad", "bias_grad")]
            shares.append(max(_gap(got[0], want[s]["weight_grad"]), _gap(got[1], want[s]["bias_grad"])))
        feedback.expect(max(shares) <= TOL_03,
                        f"the weight and bias gradients, added over the ranks as DDP would, equal BatchNorm's "
                        f"(largest gap {max(shares):.1e})",
                        "the weight and bias gradients, added over the ranks, are not BatchNorm's: the output is "
                        "x̂ · weight + bias, with weight and bias the layer's own parameters.")

    gap_mean, step_mean = worst("running_mean", per_rank=False)
    gap_var, step_var = worst("running_var", per_rank=False)
    if max(gap_mean, gap_var) <= TOL_03:
        feedback.ok(f"running_mean and running_var follow BatchNorm's on every rank: momentum {MOMENTUM_03:g}, "
                    f"the unbiased global variance (largest gap {max(gap_mean, gap_var):.1e})")
    elif min(step_mean, step_var) == 1 and any(saved[r][0][k] is None for r in range(world)
                                               for k in ("running_mean", "running_var")):
        feedback.fail("the layer has no running statistics any more: keep the buffers of nn.BatchNorm2d and "
                      "update them in place.")
    else:
        first = {r: (saved[r][0]["running_mean"], saved[r][0]["running_var"]) for r in range(world)}
        step = min(s for s, g in ((step_mean, gap_mean), (step_var, gap_var)) if g > TOL_03)
        right_first = all(_gap(m, want[0]["running_mean"]) <= TOL_03 and _gap(v, want[0]["running_var"]) <= TOL_03
                          for m, v in first.values())
        if right_first:
            feedback.fail(f"the running statistics are right after the first step, not after step {step}: keep "
                          f"(1 − momentum) of the old value each time, running.lerp_(new, momentum).")
        elif not outputs_right:
            feedback.fail("the running statistics are not BatchNorm's either: they follow from the global mean "
                          "and variance, momentum · mean into running_mean and the unbiased variance into "
                          "running_var.")
        else:
            feedback.fail(_explain_running(*first[0], want[0]["x"]))
    return feedback


# -- 04: gradient accumulation under DDP -------------------------------------------------------
def _accumulation_reference(seed: int, world_size: int, k: int, batch_size: int, dim: int, steps: int,
                            lr: float) -> dict:
    """One process, one big batch per optimizer step (every rank's k micro-batches together), plain SGD.

    The model and data are made exactly as exercise 04's skeleton makes them: the model from
    ``torch.manual_seed(seed)``, rank r's micro-batches from seed + 1 + r. Returns "grads" (the
    flat gradient of each step), "weights" (after the last step), and the first step's gradient
    as three mistakes would compute it: "unscaled" (k times), "local" (each rank's own, never
    all-reduced) and "last_only" (only the last micro-batch's, divided by k).
    """
    import torch
    import torch.nn.functional as F

    from labkit.models import MLPStack

    torch.manual_seed(seed)
    model = MLPStack(dim=dim, depth=1, in_features=dim)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    data = [torch.Generator().manual_seed(seed + 1 + r) for r in range(world_size)]

    def gradient(x, y, scale=1.0):
        optimizer.zero_grad(set_to_none=True)
        (F.cross_entropy(model(x), y) * scale).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    found = {"grads": []}
    for step in range(steps):
        micro = [[(torch.randn(batch_size, dim, generator=gen), torch.randint(0, 10, (batch_size,), generator=gen))
                  for _ in range(k)] for gen in data]
        mine = [(torch.cat([x for x, _ in m]), torch.cat([y for _, y in m])) for m in micro]
        if step == 0:
            found["local"] = [gradient(x, y) for x, y in mine]
            found["last_only"] = sum(gradient(*m[-1], scale=1 / k) for m in micro) / world_size
        grad = gradient(torch.cat([x for x, _ in mine]), torch.cat([y for _, y in mine]))
        if step == 0:
            found["unscaled"] = k * grad
        found["grads"].append(grad)
        optimizer.step()
    found["weights"] = torch.cat([p.detach().flatten() for p in model.parameters()])
    return found


def _explain_gradient(used: dict, reference: dict, k: int) -> str:
    """Why the gradients the first optimizer.step() used ({rank: flat tensor}) are not one big batch's."""
    import torch

    if any(torch.isnan(g).any() for g in used.values()):
        return ("some parameters had no gradient when optimizer.step() ran (.grad was None): clear the gradients "
                "only after the step, never between the last backward() and optimizer.step().")
    if all(_near(g, reference["unscaled"]) for g in used.values()):
        return (f"the gradient is {k}× too large: with the loss not divided by k, the {k} micro-batch gradients add "
                f"up to the sum of {k} means, not the mean of the effective batch. Call (loss / k).backward().")
    if all(_near(g, reference["local"][r]) for r, g in used.items()):
        return ("each rank stepped with its own gradient, never averaged with the other ranks': with no_sync on "
                "the last micro-step too, DDP never all-reduces. Run the last micro-step outside model.no_sync().")
    if all(_near(g, reference["last_only"]) for g in used.values()):
        return (f"only the last micro-batch's gradient (÷ {k}) reached optimizer.step(): zero_grad inside the "
                f"micro-step loop clears what the earlier micro-steps added. Clear the gradients once per optimizer "
                f"step, after optimizer.step().")
    want = reference["grads"][0]
    gap = max(_gap(g, want) for g in used.values())
    return (f"the gradient of the first optimizer step differs from one big batch's by up to {gap:.1e} of the "
            f"largest gradient: add up the k micro-steps' gradients of (loss / k), all-reduced once, after the last.")


def check_accumulation(target="scripts/ex04_accumulation.py", *, timeout: float = 180) -> Feedback:
    """Exercise 04-accumulation: k micro-steps under DDP make one optimizer step whose gradient is
    that of one batch k × world size times larger, with one all-reduce of the gradients per step.

    Launches the script on 2 ranks (every GPU, if there are two or more). A hook in the skeleton
    records the gradient each ``optimizer.step()`` call uses; a DDP communication hook counts the
    bytes all-reduced. The check builds the same model and draws the same seeded data itself,
    takes each optimizer step on one big batch (every rank's k micro-batches together) in one
    process, and compares: the calls to ``optimizer.step()``, the all-reduced bytes against the
    gradients' bytes, the gradient of every step, and the final weights on every rank.

    Args:
        target: the exercise's script, or a finished Run of it.
        timeout: seconds the launch may take.

    Returns:
        a Feedback; a mistake in the script is a finding, never an exception.

    Example (exercises/04_accumulation.ipynb)::

        labkit.check_accumulation("scripts/ex04_accumulation.py")
    """
    feedback, run = attempt("04-accumulation", target, timeout=timeout, name="check-04-accumulation",
                            **_ranks(2))
    if run is None:
        return feedback
    columns = ["accum_steps", "batch_size", "dim", "steps", "lr", "seed"]
    df = _metrics(feedback, run, [*columns, "step_calls", "allreduced_bytes", "param_bytes"])
    saved = None if df is None else _saved(feedback, run, "ex04")
    if saved is None:
        return feedback
    setting = _config(df, columns)
    k, steps, world = int(setting["accum_steps"]), int(setting["steps"]), run.nproc
    per_step = df.dropna(subset=["step_calls"])
    if sorted(per_step["step"].unique()) != list(range(1, steps + 1)) or len(per_step) != steps * world:
        feedback.fail(f"the skeleton logs one line per optimizer step, {steps} on each rank; it logged "
                      f"{len(per_step)} in all: keep its loop and metrics.log(...) as they are.")
        return feedback
    reference = _accumulation_reference(int(setting["seed"]), world, k, int(setting["batch_size"]),
                                        int(setting["dim"]), steps, float(setting["lr"]))
    effective = world * k * int(setting["batch_size"])
    tolerance = 1e-5 if run.info.get("device") == "cpu" else 1e-4  # lesson 04's (GPU kernels round otherwise)

    # 1. One optimizer.step() per optimizer step.
    calls = sorted(set(per_step["step_calls"].astype(int)))
    if calls == [1]:
        feedback.ok(f"optimizer.step() ran once per optimizer step, after all {k} micro-steps")
    elif calls == [0]:
        feedback.fail(f"optimizer.step() was never called: call it once per optimizer step, after the last of "
                      f"the {k} micro-steps.")
    elif calls == [k]:
        feedback.fail(f"optimizer.step() ran {k} times per optimizer step, once per micro-step: the point is one "
                      f"step with the gradient of all {k} micro-batches. Step once, after the last micro-step.")
    else:
        feedback.fail(f"optimizer.step() ran {', '.join(map(str, calls))} times in an optimizer step; once, after "
                      f"the last of the {k} micro-steps, is right.")

    # 2. One all-reduce of every gradient per optimizer step, counted by the DDP hook.
    param_bytes = int(per_step["param_bytes"].iloc[0])
    reduced = sorted(set(per_step["allreduced_bytes"].astype(int)))
    if reduced == [param_bytes]:
        feedback.ok(f"DDP all-reduced every gradient once per optimizer step ({param_bytes:,} bytes, counted by a "
                    f"communication hook): no_sync kept the other {k - 1} micro-steps local")
    elif reduced == [k * param_bytes]:
        feedback.fail(f"DDP all-reduced every gradient {k} times per optimizer step ({k} × {param_bytes:,} bytes). "
                      f"Correct but wasteful: the result is the same, but {k - 1} of the {k} all-reduces carry "
                      f"partial sums that the next micro-step changes again. Wrap every micro-step but the last, "
                      f"forward and backward, in model.no_sync().")
    elif reduced == [0]:
        feedback.fail("DDP never all-reduced a gradient (0 bytes counted): no_sync on the last micro-step too, so "
                      "the ranks never average their gradients, and their weights drift apart. Run the last "
                      "micro-step outside model.no_sync().")
    else:
        shown = ", ".join(f"{b / param_bytes:g}×" for b in reduced)
        feedback.fail(f"DDP all-reduced {shown} the gradients' {param_bytes:,} bytes in an optimizer step; once is "
                      f"right: model.no_sync() on every micro-step but the last.")

    # 3. The gradient each optimizer.step() used, against one big batch's (comparable when it steps once).
    if calls == [1]:
        used = [{r: saved[r]["used"][s] for r in range(world)} for s in range(steps)]
        gaps = [max(_gap(g, reference["grads"][s]) if g.shape == reference["grads"][s].shape else float("inf")
                    for g in used[s].values()) for s in range(steps)]
        wrong = [s for s, g in enumerate(gaps) if not g <= tolerance]
        if not wrong:
            feedback.ok(f"the gradient of every optimizer step, on every rank, is that of one batch of {world} × "
                        f"{k} × {setting['batch_size']:.0f} = {effective} samples in one process (largest gap "
                        f"{max(gaps):.1e} of the largest gradient; tolerance {tolerance:g})")
        elif wrong[0] == 0:
            feedback.fail(_explain_gradient(used[0], reference, k))
        else:
            s = wrong[0]
            leftover = all(_near(used[s][r] - used[s - 1][r], reference["grads"][s]) for r in range(world))
            first = "the first optimizer step is" if s == 1 else f"the first {s} optimizer steps are"
            feedback.fail(f"{first} right, but from step {s + 1} on the gradient "
                          + ("still holds the previous step's: clear the gradients after every optimizer.step() "
                             "(optimizer.zero_grad(set_to_none=True))." if leftover else
                             f"differs from one big batch's (by {gaps[s]:.1e}): start every optimizer step from "
                             f"cleared gradients."))

    # 4. The weights: the same on every rank, and one process's on the big batches.
    weights = {r: saved[r]["weights"] for r in range(world)}
    spread = max(_gap(w, weights[0]) for w in weights.values())
    gap = max(_gap(w, reference["weights"]) for w in weights.values())
    if spread > tolerance:
        feedback.fail(f"the ranks ended with different weights (up to {spread:.1e} apart): every optimizer step must "
                      f"average the gradients over the ranks, so that every rank takes the same step.")
    else:
        feedback.expect(gap <= tolerance,
                        f"after {steps} optimizer steps every rank holds the weights one process reaches with plain "
                        f"SGD on one batch of {effective} per step (largest gap {gap:.1e})",
                        f"after {steps} optimizer steps the weights differ from those one process reaches with one "
                        f"batch of {effective} per step (by up to {gap:.1e} of the largest weight).")
    return feedback
