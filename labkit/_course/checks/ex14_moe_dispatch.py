"""Exercise 14-moe-dispatch: the dispatch and combine of a mixture of experts over all-to-all,
proved against one process, its all-to-alls counted and weighed."""

from __future__ import annotations

from labkit._course.checks._common import _metrics, _on, _ranks
from labkit._course.attempt import launched
from labkit._course.feedback import Feedback, check

EXERCISE = "14-moe-dispatch"

HINTS = [
    "Dispatch takes two all-to-alls. First the counts: a rank cannot receive rows before it knows "
    "how many each other rank will send it, so every rank sends each other rank the counts of the "
    "rows for that rank's experts (dist.all_to_all_single on the tensor counts). Then the rows, "
    "with AllToAll.apply(rows, send, receive), so that autograd can send their gradients back.",
    "received_counts = torch.empty_like(counts); dist.all_to_all_single(received_counts, counts); "
    "receive = received_counts.view(world_size, -1).sum(dim=1).tolist() (the rows from each rank); "
    "received = AllToAll.apply(rows, send, receive).",
    "Combine: back = AllToAll.apply(done, receive, send), the same exchange the other way; the rows "
    "come back in the order they left, sorted by expert, so add each, weighted by the router, to "
    "the token it came from: torch.zeros_like(x).index_add(0, token, back * row_weight[:, None]).",
]

#: How far the expert-parallel layer may be from one process, relative to the largest value:
#: the same sums in another order (CPU), or GPU kernels that round differently.
TOLERANCE = {"cpu": 1e-5, "cuda": 1e-3}
#: A gap this small, where the output is otherwise wrong, names what the learner's layer computed.
NAMED = 1e-4
GAPS = ["output_gap", "grad_gap", "unweighted_gap", "total_gap"]
COLLECTIVES = ["forward_sent", "backward_sent"]


@check
def check_moe_dispatch(target="scripts/ex14_moe.py", *, timeout_s: float = 300) -> Feedback:
    """Exercise 14-moe-dispatch: the learner's dispatch and combine move every kept row to its
    expert's rank and back, the layer's output and every gradient equal one process's within a
    stated tolerance, and the all-to-alls are the five a layer needs, carrying exactly the rows
    the routing asks for (2 ranks: GPUs when there are two or more, else CPU ranks).

    The script computes one process's layer itself, with every expert, on every rank's tokens,
    and logs how far the learner's layer is from it, and two gaps that name a mistake: from
    the output without the router's weights, and from the sum of all its tokens' outputs.

    Args:
        target: the exercise's script, or a finished Run of it.
        timeout_s: seconds the launch may take.

    Returns:
        a Feedback; a mistake in the script is a finding, never an exception.

    Example (exercises/14_long_context_experts.ipynb)::

        labkit.check_moe_dispatch("scripts/ex14_moe.py")
    """
    feedback, run = launched(EXERCISE, target, timeout_s=timeout_s, name="check-14-moe-dispatch",
                             explain=_explain_the_crash, **_ranks(2))
    rows = _read(feedback, run)
    numbers_right = _same_numbers(feedback, rows, str(run.info.get("device", "cpu")))
    _all_to_alls(feedback, rows, numbers_right)
    return feedback


def _explain_the_crash(feedback: Feedback, target) -> None:
    """The run stopped: a rank that received another number of rows than was sent to it (gloo aborts
    it, "Received data size doesn't match expected size") means the split sizes were not exchanged."""
    failure = feedback.failure
    if failure is None:
        return
    said = "\n".join((failure.message, failure.traceback, failure.output_tail)).lower()
    if failure.says_mismatch or "split sizes" in said or "doesn't match expected size" in said:
        feedback.fail("the ranks disagreed on how many rows go where: each rank must learn from the others "
                      "how many rows it will receive, an all-to-all of the counts, before the rows move "
                      "(receive is what the others send, not what this rank sends).", hint=1)


def _read(feedback: Feedback, run) -> dict:
    """{rank: {column: value}} of what every rank logged; stops naming the ranks that left one out."""
    df = _metrics(feedback, run, ["dim", "experts", "count_0", *GAPS, *COLLECTIVES])
    rows = {int(rank): {c: group[c].dropna().iloc[0] for c in group.columns if group[c].notna().any()}
            for rank, group in df.groupby("rank")}
    silent = sorted(r for r in range(run.nproc) if any(c not in rows.get(r, {}) for c in [*GAPS, *COLLECTIVES]))
    if silent:
        feedback.stop(f"{_on(silent, run.nproc)} did not log all the check reads (did the run stop early?): keep "
                      f"the skeleton's metrics.log(...) lines.")
    return rows


def _same_numbers(feedback: Feedback, rows: dict, device: str) -> bool:
    """The layer's output and gradients against one process's, on every rank; when they differ, what
    the layer computed instead. True when they are equal."""
    tolerance = TOLERANCE.get(device, TOLERANCE["cuda"])
    worst = max(rows, key=lambda r: max(float(rows[r]["output_gap"]), float(rows[r]["grad_gap"])))
    output, grad = float(rows[worst]["output_gap"]), float(rows[worst]["grad_gap"])
    if output <= tolerance:
        feedback.ok(f"every rank's output equals one process's, within {output:.1e} of the largest value "
                    f"(tolerance {tolerance:g}: the same sums, added in another order)")
    elif all(float(r["unweighted_gap"]) <= NAMED for r in rows.values()):
        feedback.fail("the outputs are the experts' outputs added up without the router's weights: multiply "
                      "each row that comes back by its row_weight before adding it to its token.", hint=3)
        return False
    elif all(float(r["total_gap"]) <= NAMED for r in rows.values()):
        feedback.fail("every row came back, weighted, but was added to the wrong token: the rows travel sorted "
                      "by expert, so add row i to token[i], the token it came from (index_add).", hint=3)
        return False
    else:
        feedback.fail(f"on {_on([worst], len(rows))} the output differs from one process's by {output:.1e} of the "
                      f"largest value, far more than rounding ({tolerance:g}): does each row reach its expert's "
                      f"rank, and come back to the token it left?", hint=1)
        return False
    return feedback.expect(
        grad <= tolerance,
        f"every gradient (the tokens', the router's, each expert's) equals one process's, within {grad:.1e}",
        f"the output is right, but on {_on([worst], len(rows))} a gradient differs from one process's by "
        f"{grad:.1e}: send the rows with AllToAll.apply, both ways, so that autograd can send each row's "
        f"gradient back where the row came from (dist.all_to_all_single alone is not a step it can go back "
        f"through).", hint=1)


def _all_to_alls(feedback: Feedback, rows: dict, numbers_right: bool) -> None:
    """Three all-to-alls in forward (counts, rows out, rows back) and two in backward (the rows' gradients,
    both ways), each carrying exactly the rows the routing kept, by what every rank logged."""
    world = len(rows)
    experts, dim = int(rows[0]["experts"]), int(rows[0]["dim"])
    per_rank = experts // world
    count = {r: [int(rows[r].get(f"count_{e}", 0)) for e in range(experts)] for r in rows}
    forward = {r: int(rows[r].get("forward_all_to_all", 0)) for r in rows}
    backward = {r: int(rows[r].get("backward_all_to_all", 0)) for r in rows}
    if any(n != 3 for n in forward.values()):
        made = sorted(set(forward.values()))
        other = sorted({k[len("forward_"):] for r in rows for k, n in rows[r].items()
                        if k.startswith("forward_") and k not in ("forward_all_to_all", "forward_sent") and n})
        if made == [2] and other:
            feedback.fail(f"forward made 2 all-to-alls and exchanged the counts with {', '.join(other)}: that "
                          f"works, but every rank then receives every rank's counts, where an all-to-all sends "
                          f"each rank only those meant for it, as the task asks. Send them with "
                          f"dist.all_to_all_single(received_counts, counts).", hint=1)
        elif made == [2]:
            feedback.fail("forward made 2 all-to-alls where 3 are needed: the counts were never exchanged, so no "
                          "rank knows how many rows it will receive. Send them first: "
                          "dist.all_to_all_single(received_counts, counts).", hint=1)
        else:
            feedback.fail(f"forward made {', '.join(map(str, made))} all-to-all(s) on the ranks; a mixture of experts "
                          f"needs 3: the counts, the rows out to the experts, the outputs back.", hint=1)
        return
    if any(n != 2 for n in backward.values()):
        feedback.fail(f"backward made {sorted(set(backward.values()))} all-to-all(s) where 2 are needed: one of the "
                      f"row exchanges went round autograd (dist.all_to_all_single instead of AllToAll.apply), so "
                      f"its rows' gradients never went back.", hint=1)
        return
    wrong = []
    for r in rows:
        out = sum(n for e, n in enumerate(count[r]) if e // per_rank != r)             # rows to other ranks
        came = sum(count[s][e] for s in rows if s != r for e in range(r * per_rank, (r + 1) * per_rank))
        row_bytes = (out + came) * dim * 4
        want = (experts - per_rank) * 8 + row_bytes, row_bytes
        got = float(rows[r]["forward_sent"]), float(rows[r]["backward_sent"])
        if any(abs(g - w) > 1e-6 * max(1.0, w) for g, w in zip(got, want)):
            wrong.append((r, got, want))
    if wrong:
        r, got, want = wrong[0]
        feedback.fail(f"rank {r}'s all-to-alls sent {got[0]:,.0f} bytes in forward and {got[1]:,.0f} in backward; the "
                      f"rows it kept and received make {want[0]:,.0f} and {want[1]:,.0f}: send the rows sorted by "
                      f"expert (rows = x[token]) with the sizes the counts give.", hint=2)
    elif numbers_right:
        feedback.ok(f"5 all-to-alls per step (the counts, the rows out and back, and their gradients back and "
                    f"out), carrying exactly the rows each rank kept and received: "
                    f"{float(rows[0]['forward_sent']):,.0f} bytes in forward and "
                    f"{float(rows[0]['backward_sent']):,.0f} in backward on rank 0")
