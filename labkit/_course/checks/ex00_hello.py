"""Exercise 00-hello: the first collective. Every rank knows who it is and holds the sum of the ranks."""

from __future__ import annotations

from labkit import _hardware
from labkit._course.checks._common import _last, _metrics
from labkit._course.attempt import launched
from labkit._course.feedback import Feedback, check

EXERCISE = "00-hello"

HINTS = [
    "torchrun puts three numbers in every process's environment: RANK, LOCAL_RANK and "
    "WORLD_SIZE. os.environ gives strings, so convert them with int().",
    "dist.init_process_group(backend) connects the ranks. Then make a one-element tensor "
    "holding float(rank), on the rank's device, and pass it to dist.all_reduce.",
    "all_reduce works in place: after dist.all_reduce(value), value holds the sum on every "
    "rank. rank_sum = value.item().",
]

#: Three ranks at least, so that a number written for two shows up (LABKIT_RANKS, when it asks for more).
NPROC = 3
#: A script with no collective (the all_reduce forgotten) may leave while a peer is still connecting
#: to it inside init_process_group, and gloo then fails that peer ("Connection closed by peer"):
#: PyTorch's own barrier at the end of init_process_group lets the check see the mistake instead.
ENV = {"TORCH_DIST_INIT_BARRIER": "1"}


@check
def check_hello(target="scripts/ex00_hello.py", *, timeout_s: float = 180) -> Feedback:
    """Exercise 00-hello: every rank knows its rank and the world size, and holds the sum of the ranks.

    Launches on 3 CPU ranks, so that a number written for 2 ranks shows up (on ``LABKIT_RANKS``
    when it asks for more: ``make test-scale`` runs it on 4).

    Example (exercises/00_setup.ipynb)::

        labkit.check_hello("scripts/ex00_hello.py")
    """
    nproc = max(NPROC, _hardware.cpu_ranks())
    feedback, run = launched(EXERCISE, target, nproc=nproc, device="cpu", env=ENV, timeout_s=timeout_s,
                             name="check-00-hello")
    df = _metrics(feedback, run, ["my_rank", "my_world_size", "rank_sum"])
    _who_is_who(feedback, run.nproc, _last(df, "my_rank"), _last(df, "my_world_size"))
    _the_sum(feedback, run.nproc, _last(df, "rank_sum"))
    return feedback


def _who_is_who(feedback: Feedback, world: int, ranks: dict, sizes: dict) -> None:
    """Each rank read its rank and the world size from torchrun's environment."""
    wrong = {r: v for r, v in ranks.items() if v != r}
    feedback.expect(not wrong, f"each of the {world} ranks knows its own rank",
                    "rank(s) " + ", ".join(f"{r} say they are rank {v}" for r, v in wrong.items())
                    + ": read RANK from the environment (int(os.environ['RANK'])).", hint=1)
    wrong = {r: v for r, v in sizes.items() if v != world}
    feedback.expect(not wrong, f"every rank knows the world size ({world})",
                    f"torchrun started {world} ranks but rank(s) "
                    + ", ".join(f"{r} think there are {v}" for r, v in wrong.items())
                    + ": read WORLD_SIZE from the environment.", hint=1)


def _the_sum(feedback: Feedback, world: int, sums: dict) -> None:
    """Every rank holds 0 + 1 + ... + (world − 1); a wrong sum is named by what it is instead."""
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
