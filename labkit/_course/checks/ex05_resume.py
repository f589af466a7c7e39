"""Exercise 05-resume: a fault drill; the resumed run must end where the uninterrupted one does."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from labkit._course.checks._common import _metrics, _on, _ranks
from labkit._course.checks._saved import _differences, _float_tensors, _load_latest, _wrapper_keys
from labkit._course.attempt import launched
from labkit._course.feedback import Feedback, check

EXERCISE = "05-resume"

HINTS = [
    "A checkpoint must hold everything the loop changes: the weights (of model.module, so that "
    "the names carry no 'module.' prefix), the optimizer's state (SGD's momentum), step, epoch "
    "and batch_in_epoch, and the RNG state of every rank (each rank draws its own random flips).",
    "The ranks' RNG states differ, so collect them first: rngs = [None] * world_size on rank 0 "
    "(None on the others), then dist.gather_object(checkpoint.rng_state(), rngs, dst=0). Rank 0 "
    "alone writes, with checkpoint.save_atomic(state, checkpoint.step_path(args.ckpt_dir, step)); "
    "then dist.barrier() on every rank.",
    "To resume: path = checkpoint.latest(args.ckpt_dir); if it is not None, state = torch.load(path, "
    "map_location=device, weights_only=True); model.module.load_state_dict(state['model']); "
    "optimizer.load_state_dict(state['optimizer']); checkpoint.set_rng_state(state['rng'][rank]); "
    "step, epoch, batch_in_epoch = state['step'], state['epoch'], state['batch_in_epoch'].",
]

#: The check's fault drill: 8 steps an epoch, a checkpoint every 6 steps, the last rank
#: crashing at step 14, so that the job resumes mid-epoch from step 12 and redoes 13 and 14.
DRILL = {"epochs": 3, "batch_size": 16, "steps_per_epoch": 8, "ckpt_every": 6, "crash_at": 14}


def _losses_by_step(df):
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


@dataclass
class _Drill:
    """The check's two launches of the script: the same options, each its own checkpoint folder."""

    target: object
    timeout_s: float
    ranks: dict  # _ranks(2): nproc and device
    ckpt_dir: Path

    @property
    def crashing_rank(self) -> int:
        return self.ranks["nproc"] - 1

    def folder(self, name: str) -> Path:
        return self.ckpt_dir / name

    def launch(self, feedback, folder: str, *extra: str, **options):
        """``launched`` with the drill's sizes and the checkpoint folder ``folder`` (emptied first:
        the script resumes from whatever it finds)."""
        shutil.rmtree(self.folder(folder), ignore_errors=True)
        args = ["--epochs", str(DRILL["epochs"]), "--batch-size", str(DRILL["batch_size"]),
                "--train-size", str(DRILL["steps_per_epoch"] * DRILL["batch_size"] * self.ranks["nproc"]),
                "--ckpt-every", str(DRILL["ckpt_every"]), "--ckpt-dir", str(self.folder(folder)), *extra]
        return launched(feedback, self.target, timeout_s=self.timeout_s, args=args, **self.ranks, **options)


@check
def check_resume(target="scripts/ex05_resume.py", *, timeout_s: float = 300,
                 ckpt_dir="checkpoints/check-05") -> Feedback:
    """Exercise 05-resume: a checkpoint with the whole training state, and a resume after a
    crash that ends bit-identical (on CPU) to a run that was never interrupted.

    Launches the script twice on 2 ranks, or ``LABKIT_RANKS`` (every GPU, if there are two or
    more), each time with a fresh checkpoint folder under ``ckpt_dir``: first from start to finish, then with the last
    rank crashing at step 14 and ``max_restarts=1``. Compares what each rank logged right after
    resuming with what it logged when the checkpoint was saved, piece by piece; then every
    step's loss, and the final checkpoints of both runs.

    Args:
        target: the exercise's script (a finished Run will not do: the check needs two launches).
        timeout_s: seconds each launch may take.
        ckpt_dir: where the two runs' checkpoint folders go (emptied first).

    Returns:
        a Feedback; a mistake in the script is a finding, never an exception.

    Example (exercises/05_checkpointing.ipynb)::

        labkit.check_resume("scripts/ex05_resume.py")
    """
    from labkit._results.run import Run

    if isinstance(target, Run):
        Feedback(EXERCISE).stop("check_resume launches your script itself, twice (once whole, once with a "
                                "crash): pass the script's path, e.g. 'scripts/ex05_resume.py'.")
    drill = _Drill(target, timeout_s, _ranks(2), Path(ckpt_dir))
    feedback, whole, reference = _uninterrupted(drill)   # whole: that run's metrics
    _one_writer_everyone_waits(feedback, whole)
    run, df = _fault_drill(feedback, drill)
    fixes = _resumed(feedback, df, drill.crashing_rank)
    # Bit for bit on 2 CPU ranks only. GPU kernels may round differently; and over 3 ranks or more
    # the order of a gradient's sum matters: DDP lays its buckets out anew after the first step,
    # and the resumed run's first step (the uninterrupted run's 13th, say) still uses the first
    # layout, so its sum rounds in another order (4 ranks: a loss 1.5e-8 off, one step later).
    exact = run.info.get("device") == "cpu" and run.nproc <= 2
    _losses(feedback, whole, df, fixes, exact)
    _final_checkpoints(feedback, reference, drill.folder("drill"), exact)
    return feedback


def _uninterrupted(drill: _Drill):
    """The run from start to finish, and the checkpoint it leaves: (feedback, its metrics, checkpoint)."""
    feedback, run = drill.launch(EXERCISE, "whole", name="check-05-uninterrupted")
    whole = _metrics(feedback, run, ["loss", "weights_fp"])
    path, reference, error = _load_latest(drill.folder("whole"))
    if path is None:
        feedback.stop(f"the run left no checkpoint in {drill.folder('whole')}: in save_checkpoint, rank 0 writes "
                      f"one with checkpoint.save_atomic(state, checkpoint.step_path(args.ckpt_dir, step)).", hint=2)
    if error is not None:
        feedback.stop(f"{path.name} does not load with weights_only=True ({error}): save only tensors, "
                      f"numbers, strings and plain lists and dicts; checkpoint.rng_state() gives the RNG "
                      f"states in that form.", hint=1)
    wrapped = _wrapper_keys(reference)
    feedback.expect(not wrapped, f"the checkpoint ({path.name}) loads with weights_only=True, and its weights' "
                                 f"names have no 'module.' prefix, so they load into a plain model",
                    f"{path.name} names the weights {wrapped[0] if wrapped else ''!r} and so on: that is the "
                    f"DDP wrapper's state_dict. Save the unwrapped model, model.module.state_dict(), so "
                    f"that the weights load into a plain model.", hint=1)
    return feedback, whole, reference


def _one_writer_everyone_waits(feedback: Feedback, df) -> None:
    """At each save of the uninterrupted run: rank 0 alone wrote the file, and on every rank the
    file was complete when save_checkpoint returned (what the skeleton logs as wrote and complete)."""
    saves = df.dropna(subset=["saved"]) if "saved" in df else df.iloc[:0]
    if saves.empty or not {"wrote", "complete"} <= set(saves.columns):
        feedback.fail("the run logged no 'wrote' and 'complete' at its saves: keep the skeleton's "
                      "metrics.log(step, saved=1, wrote=..., complete=..., ...) after save_checkpoint.")
        return
    ranks = sorted({int(r) for r in saves["rank"]})
    steps = sorted({int(s) for s in saves["step"]})
    others = sorted({int(r) for r in saves[(saves["rank"] != 0) & (saves["wrote"] > 0)]["rank"]})
    unsafe = sorted({int(s) for s in saves[(saves["rank"] == 0) & (saves["wrote"] < 1)]["step"]})
    if others:
        feedback.fail(f"{_on(others, len(ranks))} wrote the checkpoint too: the ranks hold the same weights, "
                      f"so one file from rank 0 is the whole state; with {len(ranks)} writers the same file "
                      f"is written {len(ranks)} times (on a shared file system, all at once) for nothing. "
                      f"Write only under if rank == 0.", hint=2)
    elif unsafe:
        feedback.fail(f"at step {unsafe[0]} rank 0 put no file in place with checkpoint.save_atomic, yet the "
                      f"run left checkpoints: written with torch.save straight to its final name? A rank "
                      f"killed mid-write then leaves a half-written file that checkpoint.latest takes for "
                      f"the newest. Write it with checkpoint.save_atomic(state, path).", hint=2)
    else:
        feedback.ok(f"rank 0 alone wrote each of the {len(steps)} checkpoints (steps "
                    f"{', '.join(map(str, steps))}), atomically")
    early = saves[saves["complete"] < 1]
    if early.empty:
        feedback.ok("on every rank the file was complete when save_checkpoint returned")
        return
    first = early.sort_values("step").iloc[0]
    feedback.fail(f"at step {int(first['step'])}, rank {int(first['rank'])} came back from save_checkpoint "
                  f"before the file was there: it went on while rank 0 was still writing. A rank that "
                  f"reads the checkpoint then finds none, and if rank 0 dies mid-write, the others have "
                  f"trained past a save that never happened. End save_checkpoint with "
                  f"dist.barrier() on every rank, after rank 0's write.", hint=2)


def _fault_drill(feedback: Feedback, drill: _Drill):
    """The last rank crashes; torchrun restarts the job once: (run, its metrics)."""
    _, run = drill.launch(feedback, "drill", "--crash-at-step", str(DRILL["crash_at"]),
                          "--crash-rank", str(drill.crashing_rank), name="check-05-fault-drill", max_restarts=1)
    df = _metrics(feedback, run, ["loss", "weights_fp"])
    if 1 not in set(df["restart"]):
        feedback.stop(f"the job never restarted: keep the skeleton's fault drill (rank {drill.crashing_rank} "
                      f"raises at --crash-at-step in the first attempt).")
    return run, df


def _resumed(feedback: Feedback, df, crashing_rank: int) -> list[str]:
    """Where the restarted job resumed, and each piece of state it got back; returns the fixes."""
    crash_at = DRILL["crash_at"]
    resume_at = (crash_at - 1) // DRILL["ckpt_every"] * DRILL["ckpt_every"]
    first, again = df[df["restart"] == 0], df[df["restart"] == 1]
    resumed = again.dropna(subset=["resumed_from"]) if "resumed_from" in again else again.iloc[:0]
    if resumed.empty:
        feedback.fail(f"after the crash at step {crash_at} the restarted job began again at step 0: find the "
                      f"newest checkpoint with checkpoint.latest(args.ckpt_dir), load it, and set step, epoch "
                      f"and batch_in_epoch from it.", hint=3)
        return ["resume from checkpoint.latest(args.ckpt_dir)"]
    steps = sorted({int(s) for s in resumed["resumed_from"]})
    feedback.expect(steps == [resume_at],
                    f"rank {crashing_rank} crashed at step {crash_at}; torchrun restarted the job, and every rank "
                    f"resumed at step {resume_at}, the newest checkpoint",
                    f"after the crash at step {crash_at} the job resumed at step "
                    f"{', '.join(map(str, steps))}, but the newest checkpoint before the crash was step "
                    f"{resume_at}: load checkpoint.latest(args.ckpt_dir), and save the step the run has "
                    f"reached.", hint=3)
    saves = first.dropna(subset=["saved"]) if "saved" in first else first.iloc[:0]
    saved = {int(r["rank"]): r for _, r in saves[saves["step"] == steps[0]].iterrows()}
    after = {int(r["rank"]): r for _, r in resumed.groupby("rank").head(1).iterrows()}
    return _resume_pieces(feedback, saved, after, steps[0]) if saved else []


def _tolerance(exact: bool) -> float:
    """How far the drill may be from the uninterrupted run: nothing on CPU, a GPU kernel's rounding."""
    return 0.0 if exact else 1e-5


def _how(exact: bool) -> str:
    """The tolerance, in words."""
    return "bit for bit" if exact else (f"within {_tolerance(exact):g} (GPU kernels, and a sum over more "
                                        f"than 2 ranks in another order, may round differently)")


def _losses(feedback: Feedback, whole, df, fixes: list[str], exact: bool) -> None:  # whole: metrics
    """Every loss the drill logged, before the crash and after it (the steps done twice both
    times), against the uninterrupted run's; a difference ends the check, naming the first fix."""
    expected = _losses_by_step(whole)
    logged = df.dropna(subset=["loss"])
    keys = list(zip(logged["rank"], logged["step"]))
    gap = abs(logged["loss"].to_numpy() - expected.reindex(keys).to_numpy())
    leave = {int(step) for (_, step), g in zip(keys, gap) if not g <= _tolerance(exact)}  # NaN: an extra step
    leave |= {int(step) for (rank, step) in expected.index if (rank, step) not in set(keys)}  # a missing one
    first, again = df[df["restart"] == 0], df[df["restart"] == 1]
    twice = set(first.dropna(subset=["loss"])["step"]) & set(again.dropna(subset=["loss"])["step"])
    steps = expected.index.get_level_values("step").nunique()
    feedback.require(not leave, f"the drill's losses equal the uninterrupted run's, {_how(exact)}: all {steps} "
                                f"steps on every rank, and the {len(twice)} steps done twice, both times",
                     f"after the restart the losses leave the uninterrupted run's from step "
                     f"{min(leave) if leave else 0} on: "
                     + (fixes[0] if fixes else "some piece of state did not come back; compare what "
                        "you save with everything the loop changes") + ".", hint=3)


def _final_checkpoints(feedback: Feedback, reference, folder: Path, exact: bool) -> None:
    """Both runs end with the same checkpoint: every tensor of numbers (Python's and NumPy's RNGs
    start from a random seed in each run, so their states are left out)."""
    _, final, _ = _load_latest(folder)
    if final is None:
        return
    a, b = _float_tensors(reference), _float_tensors(final)
    differ = _differences(a, b, exact=exact)
    feedback.expect(a and not differ, f"both runs end with the same final checkpoint: all {len(a)} "
                                      f"tensors of weights and optimizer state are equal, {_how(exact)}",
                    f"the final checkpoints differ at {', '.join(differ[:4]) or 'every tensor'}: both runs "
                    f"should end in the same state.", hint=1)
