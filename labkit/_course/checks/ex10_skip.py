"""Exercise 10-skip: a rank with a bad batch must not skip the step alone (lesson 10).

The script meets, now and then, a batch whose loss is NaN on one rank. Its first try skips the
step on that rank only, and the ranks' all_reduces pair wrongly, then hang. The learner makes
every rank learn which ranks have a bad batch, in a collective all of them call every step, and
skip together. The check launches 3 ranks (``LABKIT_RANKS`` when that asks for more) with bad
batches on two of them (ranks 0 and 2 with ``--seed 1``; at 4 ranks rank 3 too), so that an
answer written for "rank 1" or for one bad rank shows up.
"""

from __future__ import annotations

import re

from labkit import _hardware
from labkit._course.checks._common import _metrics, _on
from labkit._course.attempt import launched
from labkit._course.feedback import Feedback, check

EXERCISE = "10-skip"

HINTS = [
    "A bad batch on one rank must not change which collectives that rank calls. Every rank has "
    "to learn, in a collective that all of them call at every step, whether some rank's batch is "
    "bad; then they all skip, or none does.",
    "bad = torch.zeros(world_size); set bad[rank] = 1.0 when this rank's loss is not finite "
    "(math.isfinite); dist.all_reduce(bad) adds up the flags: afterwards bad[r] is 1 exactly where "
    "rank r had a bad batch, on every rank.",
    "After the all_reduce: if bad.any(), rank 0 prints f'step {step}: skipped on every rank, a bad "
    "batch on rank {ranks}' with the ranks from bad.nonzero(), and every rank continues to the next "
    "step. The gradients' sum then never meets a NaN, and every rank calls the same collectives.",
]

#: Three ranks at least, and a seed with bad batches on two of them (ranks 0 and 2), at different
#: steps (4 ranks add one on rank 3, at step 0).
NPROC, ARGS = 3, ["--seed", "1"]
#: Seconds without a line from any rank after which the run counts as hung.
HANG_S = 8


@check
def check_skip(target="scripts/ex10_skip.py", *, timeout_s: float = 180) -> Feedback:
    """Exercise 10-skip: every rank skips a step where some rank's batch is bad, and only those
    steps; every sum is right; rank 0 says which ranks had the bad batch.

    Launches on 3 CPU ranks (or ``LABKIT_RANKS``, when more) with bad batches on ranks 0 and 2; a
    hang is stopped after
    ``HANG_S`` seconds of silence and named.

    Args:
        target: the exercise's script, or a finished Run of it.
        timeout_s: seconds the launch may take.

    Returns:
        a Feedback; a mistake in the script is a finding, never an exception.

    Example (exercises/10_faults.ipynb)::

        labkit.check_skip("scripts/ex10_skip.py")
    """
    feedback, run = launched(EXERCISE, target, nproc=max(NPROC, _hardware.cpu_ranks()), device="cpu",
                             args=ARGS, timeout_s=timeout_s,
                             hang_timeout_s=HANG_S, name="check-10-skip", explain=_skipped_alone)
    df = _metrics(feedback, run, ["bad_batch", "trained"])
    bad = _bad_batches(df)
    _skipped_together(feedback, df, bad, run.nproc)
    _sums(feedback, df)
    _rank_0_names_them(feedback, run, bad)
    return feedback


def _bad_batches(df) -> dict[int, list[int]]:
    """{step: the ranks whose batch was bad there}, from the flags the skeleton logs."""
    flagged = df[df["bad_batch"] == 1]
    return {int(step): sorted(int(r) for r in part["rank"]) for step, part in flagged.groupby("step")}


def _skipped_alone(feedback: Feedback, target) -> None:
    """The run hung: name the rank that ran ahead, and the bad batch it skipped alone."""
    run = feedback.run
    if run is None or not run.info.get("hung"):
        return
    try:
        df = run.metrics()
    except Exception:  # noqa: BLE001 - nothing logged: the findings already made say why
        return
    if "bad_batch" not in df.columns or "trained" not in df.columns:
        return
    for step, ranks in sorted(_bad_batches(df).items()):
        done = df[(df["step"] == step) & (df["trained"] == 1)]["rank"]
        alone = sorted(set(ranks) - set(done))
        if alone and set(done):
            feedback.fail(f"{_on(alone, run.nproc)} had a bad batch at step {step} and skipped that step "
                          f"alone: the other ranks called step {step}'s all_reduce without it, the "
                          f"collectives paired wrongly from there on, and the run hung. Decide together, "
                          f"in a collective every rank calls every step, before anyone skips.", hint=1)
            return


def _skipped_together(feedback: Feedback, df, bad: dict, world: int) -> None:
    """A step with a bad batch anywhere: no rank went on with it. Any other step: every rank did."""
    summed = df[df["trained"] == 1] if "trained" in df.columns else df.iloc[0:0]
    went_on = {int(step): set(int(r) for r in part["rank"]) for step, part in summed.groupby("step")}
    for step, ranks in sorted(bad.items()):
        if went_on.get(step):
            nan = " (nan)" if summed[summed["step"] == step]["reduced"].isna().any() else ""
            feedback.stop(f"step {step}: {_on(ranks, world)} had a bad batch, yet "
                          f"{_on(sorted(went_on[step]), world)} went on with the step: its NaN went into "
                          f"the sum of the gradients{nan}. Skip such a step on every rank.", hint=2)
    steps = sorted(set(df["step"]))
    missed = [s for s in steps if s not in bad and went_on.get(s) != set(range(world))]
    feedback.require(not missed, f"every rank skipped step(s) {', '.join(map(str, sorted(bad))) or 'none'} "
                                 f"together, the ones with a bad batch, and only those",
                     f"step(s) {', '.join(map(str, missed))} had no bad batch on any rank, yet not every rank "
                     f"trained on it: skip only when some rank's batch is bad.", hint=2)


def _sums(feedback: Feedback, df) -> None:
    """Every all_reduce gave the sum of every rank's gradient at the same step."""
    rows = df[df["trained"] == 1]
    right = (rows["reduced"] - rows["expected"]).abs() <= 1e-6 * rows["expected"].abs().clip(lower=1)
    wrong = rows[~right]  # a NaN is never right
    if wrong.empty:
        feedback.ok(f"every all_reduce gave the right sum ({len(rows)} sums checked)")
        return
    first = wrong.iloc[0]
    feedback.fail(f"rank {int(first['rank'])}'s sum at step {int(first['step'])} is {first['reduced']:g}, not "
                  f"{first['expected']:g}: the ranks' all_reduces paired up wrongly, as when one rank "
                  f"skips a collective the others call.", hint=1)


_STEP = re.compile(r"\bstep (\d+)\b", re.IGNORECASE)
#: the numbers right after a "rank(s)": "rank 2", "ranks 1 and 3", "rank [2]", "rank tensor([[2]])"
_RANKS = re.compile(r"\branks?\b((?:[\s\d,\[\]()]|and|tensor)*)", re.IGNORECASE)


def said_skipped(line: str) -> tuple[int, list[int]] | None:
    """(step, ranks) from a line of rank 0's that reports a skipped step, else None. The ranks are
    the numbers after the line's last "rank" that has any, however they were printed."""
    step = _STEP.search(line)
    if not step or "skip" not in line.lower():
        return None
    named = [m[1] for m in _RANKS.finditer(line) if re.search(r"\d", m[1])]
    return int(step[1]), sorted(int(n) for n in re.findall(r"\d+", named[-1])) if named else []


def _rank_0_names_them(feedback: Feedback, run, bad: dict) -> None:
    """Rank 0 prints one line for each skipped step, naming the ranks with the bad batch."""
    said = {}
    for line in run.output(0).splitlines():
        found = said_skipped(line)
        if found:
            said[found[0]] = found[1]
    others = [r for r in range(1, run.nproc) if "skipped" in run.output(r)]
    wrong = {step: said.get(step) for step, ranks in bad.items() if said.get(step) != ranks}
    if wrong:
        step = min(wrong)
        feedback.fail(f"rank 0 should print, for step {step}, a line like 'step {step}: skipped on every "
                      f"rank, a bad batch on rank {', '.join(map(str, bad[step]))}'"
                      + ("" if wrong[step] is None else f"; it named rank(s) {wrong[step]}")
                      + ": take the ranks from the all-reduced flags (bad.nonzero()).", hint=3)
    else:
        feedback.ok("rank 0 says, for each skipped step, which ranks had the bad batch")
    feedback.expect(not others, "only rank 0 reports the skipped steps",
                    f"{_on(others, run.nproc)} printed the skipped steps too: print only where rank == 0.",
                    hint=3)
