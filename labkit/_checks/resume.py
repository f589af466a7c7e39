"""Exercise 05: a fault drill; the resumed run must end where the uninterrupted one does."""

from __future__ import annotations

from labkit._feedback import Feedback, attempt
from labkit._checks._common import _metrics, _on, _ranks

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
                           f"every rank.", hint=3):
        fixes.append("restore the model's weights on every rank")
    wrong = differ("momentum_fp")
    empty = " (it starts empty)" if any(after[r]["momentum_fp"] == 0 for r in wrong) else ""
    if not feedback.expect(not wrong, "the optimizer's momentum came back as it was",
                           f"the optimizer's momentum on {on(wrong)} is not what it was at step {step}"
                           f"{empty}: save optimizer.state_dict() and restore it with "
                           f"optimizer.load_state_dict(...); without it, SGD's next steps point elsewhere.", hint=1):
        fixes.append("save and restore the optimizer's state (its momentum) too")
    wrong = differ("rng_fp")
    borrowed = [r for r in wrong if r != 0 and 0 in saved and after[r]["rng_fp"] == saved[0]["rng_fp"]]
    if not wrong:
        feedback.ok("each rank's random stream goes on where it was, so the random flips repeat")
    elif borrowed:
        feedback.fail(f"{on(borrowed)} went on with rank 0's random stream, not its own: each rank draws "
                      f"its own flips, so gather every rank's checkpoint.rng_state() on rank 0 "
                      f"(dist.gather_object) and restore state['rng'][rank] on each rank.", hint=2)
        fixes.append("restore each rank's own RNG state")
    else:
        feedback.fail(f"the random stream on {on(wrong)} does not go on where it was at step {step}: "
                      f"save every rank's checkpoint.rng_state() and restore it with "
                      f"checkpoint.set_rng_state(...), or the random flips differ.", hint=2)
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
                      f"run trains on other batches than it would have.", hint=1)
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
                      f"one with checkpoint.save_atomic(state, checkpoint.step_path(args.ckpt_dir, step)).", hint=2)
        return feedback
    if error is not None:
        feedback.fail(f"{path.name} does not load with weights_only=True ({error}): save only tensors, "
                      f"numbers, strings and plain lists and dicts; checkpoint.rng_state() gives the RNG "
                      f"states in that form.", hint=1)
        return feedback
    wrapped = _wrapper_keys(reference)
    feedback.expect(not wrapped, f"the checkpoint ({path.name}) loads with weights_only=True, and its weights' "
                                 f"names have no 'module.' prefix, so they load into a plain model",
                    f"{path.name} names the weights {wrapped[0] if wrapped else ''!r} and so on: that is the "
                    f"DDP wrapper's state_dict. Save the unwrapped model, model.module.state_dict(), so "
                    f"that the weights load into a plain model.", hint=1)

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
                      f"and batch_in_epoch from it.", hint=3)
        fixes.append("resume from checkpoint.latest(args.ckpt_dir)")
    else:
        steps = sorted({int(s) for s in resumed["resumed_from"]})
        feedback.expect(steps == [resume_at],
                        f"rank {last} crashed at step {crash_at}; torchrun restarted the job, and every rank "
                        f"resumed at step {resume_at}, the newest checkpoint",
                        f"after the crash at step {crash_at} the job resumed at step "
                        f"{', '.join(map(str, steps))}, but the newest checkpoint before the crash was step "
                        f"{resume_at}: load checkpoint.latest(args.ckpt_dir), and save the step the run has "
                        f"reached.", hint=3)
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
                              "you save with everything the loop changes") + ".", hint=3):
        return feedback
    _, final, _ = _load_latest(folders["drill"])
    if final is not None:
        # Tensors of numbers only: Python's and NumPy's RNGs start from a random seed in each run.
        a, b = _float_tensors(reference), _float_tensors(final)
        differ = _differences(a, b, exact=exact)
        feedback.expect(a and not differ, f"both runs end with the same final checkpoint: all {len(a)} "
                                          f"tensors of weights and optimizer state are equal, {how}",
                        f"the final checkpoints differ at {', '.join(differ[:4]) or 'every tensor'}: both runs "
                        f"should end in the same state.", hint=1)
    return feedback
