"""Exercise 09-nodes: a training script that is right on one node and wrong on two.

On one node ``RANK`` equals ``LOCAL_RANK`` and ``WORLD_SIZE`` equals ``LOCAL_WORLD_SIZE``, so a
script that mixes them up runs well there. The check launches the learner's script on two nodes
of one rank each (two torchrun agents on this machine, lesson 09), where every mix-up shows: a
rank that does not know its place, a GPU its node does not have, two ranks reading the same
samples, a job that prints and saves once per node instead of once.
"""

from __future__ import annotations

from labkit import _hardware
from labkit._course.checks._common import _metrics, _on
from labkit._course.attempt import launched
from labkit._course.feedback import Feedback, check

EXERCISE = "09-nodes"

HINTS = [
    "torchrun tells every rank two places: LOCAL_RANK among the ranks of its node (of "
    "LOCAL_WORLD_SIZE), and RANK among all the ranks of the job (of WORLD_SIZE). On one node "
    "they are equal; on two they are not. For each TODO, ask: is it about this node, or about "
    "the whole job?",
    "About the whole job: the DistributedSampler's rank= and num_replicas=, the average of the "
    "loss, and who prints and saves (once per job). About this node: the GPU, since every node "
    "numbers its GPUs from 0.",
    "rank = int(os.environ['RANK']) and world_size = int(os.environ['WORLD_SIZE']); gpu = "
    "local_rank; DistributedSampler(data.train, num_replicas=world_size, rank=rank, shuffle=True, "
    "seed=0); and print and save under `if rank == 0:`.",
]

#: Two nodes of one rank each: the smallest job in which a node is not the whole job.
NODES = 2


def _two_nodes() -> dict:
    """Launch options: one GPU per node where every node can have one, else one CPU rank each."""
    return {"nproc": 1, "nnodes": NODES, "device": "auto" if _hardware.gpu_count() >= NODES else "cpu"}


@check
def check_nodes(target="scripts/ex09_nodes.py", *, timeout_s: float = 300) -> Feedback:
    """Exercise 09-nodes: each rank knows its place in the whole job, uses a GPU of its own
    node, reads its own share of the data, and the job prints and saves once.

    Launches the script on two nodes of one rank each (``labkit.launch(..., nnodes=2)``) and
    reads what the ranks logged and printed.

    Args:
        target: the exercise's script, or a finished Run of it.
        timeout_s: seconds the launch may take.

    Returns:
        a Feedback; a mistake in the script is a finding, never an exception.

    Example (exercises/09_multinode.ipynb)::

        labkit.check_nodes("scripts/ex09_nodes.py")
    """
    feedback, run = launched(EXERCISE, target, timeout_s=timeout_s, name="check-09-nodes",
                             explain=_explain_failure, **_two_nodes())
    df = _metrics(feedback, run, ["rank_used", "world_size_used", "gpu", "first_batch", "batches"])
    _knows_its_place(feedback, df)
    _a_gpu_of_its_node(feedback, df, run.nproc)
    _its_own_share(feedback, df)
    _once_per_job(feedback, df, run)
    return feedback


def _explain_failure(feedback: Feedback, target) -> None:
    """The launch failed: say what the usual mix-ups of node and job make ranks crash on."""
    message = feedback.failure.message if feedback.failure is not None else ""
    if "invalid device ordinal" in message:
        feedback.fail("a rank asked for a GPU that its node does not have: every node numbers its "
                      "GPUs from 0, so the GPU is cuda:LOCAL_RANK, not cuda:RANK.", hint=2)
    elif "Invalid rank" in message and "interval" in message:
        feedback.fail(f"the DistributedSampler refused its numbers ({message.strip()}): its "
                      f"num_replicas was the ranks of one node, not of the whole job. The world "
                      f"size is WORLD_SIZE (LOCAL_WORLD_SIZE counts one node).", hint=1)


def _knows_its_place(feedback: Feedback, df) -> None:
    """The script's rank and world size are torchrun's RANK and WORLD_SIZE (labkit stamps those
    on every metrics line, whatever the script computed)."""
    told = df.dropna(subset=["rank_used"]).groupby("rank")[["rank_used", "world_size_used", "world_size"]].first()
    wrong = {rank: int(used) for rank, used in told["rank_used"].items() if int(used) != rank}
    if wrong:
        rank, used = next(iter(wrong.items()))
        feedback.stop(f"rank {rank}, on the second node, took {used} for its rank: torchrun said "
                      f"RANK={rank}. LOCAL_RANK starts again at 0 on every node; the place in the whole "
                      f"job is RANK.", hint=1)
    feedback.ok("each rank knows its place in the whole job (RANK)")
    world = int(told["world_size"].iloc[0])
    used = sorted({int(w) for w in told["world_size_used"]})
    feedback.require(used == [world], f"each rank knows that the job has {world} ranks (WORLD_SIZE)",
                     f"the script took {used[0]} for the world size, but the job has {world} ranks on "
                     f"{NODES} nodes: {used[0]} is LOCAL_WORLD_SIZE, the ranks of one node. Read "
                     f"WORLD_SIZE.", hint=1)


def _a_gpu_of_its_node(feedback: Feedback, df, per_node: int) -> None:
    """The GPU index is the rank's place on its node: each node has GPUs 0 .. per_node - 1."""
    gpus = df.dropna(subset=["gpu"]).groupby("rank")["gpu"].first().astype(int)
    beyond = {rank: gpu for rank, gpu in gpus.items() if gpu >= per_node}
    first = next(iter(beyond.items()), None)
    feedback.expect(not beyond, "each rank picks a GPU of its own node (cuda:LOCAL_RANK)",
                    f"rank {first[0]} would use cuda:{first[1]}, but its node has {per_node} GPU(s), "
                    f"numbered from 0: use LOCAL_RANK for the GPU." if first else "", hint=2)


def _its_own_share(feedback: Feedback, df) -> None:
    """The DistributedSampler shards over the whole job: other samples on each rank, and an
    epoch of half the batches."""
    starts = df.dropna(subset=["first_batch"]).pivot_table(
        index="epoch", columns="rank", values="first_batch", aggfunc="first")
    batches = df.dropna(subset=["batches"]).groupby("rank")["batches"].first().astype(int)
    shared = bool((starts.nunique(axis=1) < starts.shape[1]).any())
    feedback.expect(not shared, f"each rank reads its own share of the data ({batches.iloc[0]} "
                                f"batches an epoch)",
                    f"the ranks on the two nodes started an epoch with the same samples, and each "
                    f"read {batches.iloc[0]} batches an epoch: the sampler shares the data out over "
                    f"the whole job, so it needs num_replicas=WORLD_SIZE and rank=RANK.", hint=2)


def _once_per_job(feedback: Feedback, df, run) -> None:
    """Rank 0 alone prints the epoch's loss and saves the weights."""
    savers = sorted(int(r) for r in df.dropna(subset=["saved"])["rank"].unique()) if "saved" in df else []
    printed = [r for r in range(run.world_size) if "loss" in run.output(r).lower()]
    if not savers and not printed:
        feedback.fail("no rank printed the epoch's loss or saved the weights: keep the skeleton's "
                      "print and save, under `if rank == 0:`.", hint=3)
        return
    others = sorted(set(savers + printed) - {0})
    feedback.expect(savers == [0] and printed == [0] and not others,
                    "the job prints and saves once, on rank 0",
                    f"{_on(others or [0], run.world_size)} printed or saved too: once per node is "
                    f"{NODES} times per job here, and {NODES} ranks writing one file race. Print and "
                    f"save where RANK is 0." if others else
                    "rank 0 must both print the epoch's loss and save the weights.", hint=3)
