"""Exercise 09-nodes: a training script that is right on one node and wrong on two.

On one node ``RANK`` equals ``LOCAL_RANK`` and ``WORLD_SIZE`` equals ``LOCAL_WORLD_SIZE``, so a
script that mixes them up runs well there. The check launches the learner's script on two nodes
(two torchrun agents on this machine, lesson 09), each with half of labkit's ranks, where every
mix-up shows: a rank that does not know its place, a GPU its node does not have, two ranks
reading the same samples, a job that prints and saves once per node instead of once.

With one rank per node (the default 2 CPU ranks), ``LOCAL_RANK`` is 0 everywhere and ``RANK``
equals ``GROUP_RANK``: a rank taken from the node's number, or two ranks of a node on one GPU,
cannot show, and the findings say so. ``LABKIT_RANKS=4`` runs two ranks per node, where they do.
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
    "seed=0); and main = rank == 0, so that one process of the job prints and saves.",
]

#: Two nodes, each with half of the ranks a launch uses by default (at least one).
NODES = 2


def _two_nodes() -> dict:
    """Launch options: two nodes of ``default_nproc // 2`` ranks each (one each at the default 2
    CPU ranks, two at ``LABKIT_RANKS=4``); GPUs where every rank can have its own."""
    from labkit._launch.plan import default_nproc

    device = "auto" if _hardware.gpu_count() >= NODES else "cpu"
    return {"nproc": max(1, default_nproc(device) // NODES), "nnodes": NODES, "device": device}


def _one_per_node(per_node: int) -> str:
    """What one rank per node cannot show, said next to the finding it limits."""
    if per_node > 1:
        return ""
    return (" (with one rank per node, LOCAL_RANK is 0 and RANK equals GROUP_RANK everywhere, so "
            "this run cannot tell them apart; LABKIT_RANKS=4 runs two ranks per node, where it can)")


@check
def check_nodes(target="scripts/ex09_nodes.py", *, timeout_s: float = 300) -> Feedback:
    """Exercise 09-nodes: each rank knows its place in the whole job, uses a GPU of its own
    node, reads its own share of the data, and the job prints and saves once.

    Launches the script on two nodes (``labkit.launch(..., nnodes=2)``), each with half of
    ``labkit.default_nproc()`` ranks (one each by default, two at ``LABKIT_RANKS=4``), and
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
    _knows_its_place(feedback, df, run.nproc)
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
                      f"num_replicas was fewer than the ranks of the whole job. The world size is "
                      f"WORLD_SIZE (LOCAL_WORLD_SIZE counts the ranks of one node, GROUP_WORLD_SIZE "
                      f"the nodes).", hint=1)


def _knows_its_place(feedback: Feedback, df, per_node: int) -> None:
    """The script's rank and world size are torchrun's RANK and WORLD_SIZE (labkit stamps those
    on every metrics line, whatever the script computed)."""
    told = df.dropna(subset=["rank_used"]).groupby("rank")[["rank_used", "world_size_used", "world_size"]].first()
    wrong = {rank: int(used) for rank, used in told["rank_used"].items() if int(used) != rank}
    if wrong:
        rank, used = next(iter(wrong.items()))
        node, local = divmod(rank, per_node)
        feedback.stop(f"rank {rank}, rank {local} of node {node}, took {used} for its rank: torchrun "
                      f"said RANK={rank}. LOCAL_RANK starts again at 0 on every node, and GROUP_RANK "
                      f"numbers the nodes, not the ranks; the place in the whole job is RANK "
                      f"(GROUP_RANK × LOCAL_WORLD_SIZE + LOCAL_RANK).", hint=1)
    feedback.ok("each rank knows its place in the whole job (RANK)" + _one_per_node(per_node))
    world = int(told["world_size"].iloc[0])
    used = sorted({int(w) for w in told["world_size_used"]})
    feedback.require(used == [world], f"each rank knows that the job has {world} ranks (WORLD_SIZE)",
                     f"the script took {used[0]} for the world size, but the job has {world} ranks on "
                     f"{NODES} nodes: LOCAL_WORLD_SIZE counts the ranks of one node, GROUP_WORLD_SIZE "
                     f"the nodes. Read WORLD_SIZE.", hint=1)


def _a_gpu_of_its_node(feedback: Feedback, df, per_node: int) -> None:
    """The GPU index is the rank's place on its node: each node has GPUs 0 .. per_node - 1, one
    for each of its ranks (LOCAL_RANK = RANK mod LOCAL_WORLD_SIZE, ranks numbered node by node)."""
    gpus = df.dropna(subset=["gpu"]).groupby("rank")["gpu"].first().astype(int)
    beyond = {rank: gpu for rank, gpu in gpus.items() if gpu >= per_node}
    first = next(iter(beyond.items()), None)
    if not feedback.expect(not beyond, "each rank picks a GPU its node has",
                           f"rank {first[0]} would use cuda:{first[1]}, but its node has {per_node} "
                           f"GPU(s), numbered from 0: use LOCAL_RANK for the GPU." if first else "", hint=2):
        return
    shared = {rank: gpu for rank, gpu in gpus.items() if gpu != rank % per_node}
    first = next(iter(shared.items()), None)
    feedback.expect(not shared, "each rank picks a GPU of its own node (cuda:LOCAL_RANK)"
                    + _one_per_node(per_node),
                    f"rank {first[0]}, rank {first[0] % per_node} of its node, would use cuda:{first[1]}, "
                    f"the GPU of another rank of that node: two ranks on one GPU. Use LOCAL_RANK for "
                    f"the GPU." if first else "", hint=2)


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
        feedback.fail("no rank printed the epoch's loss or saved the weights: `main` must be True on "
                      "one process of the job, rank 0, and the skeleton's `if main:` block kept as it is.",
                      hint=3)
        return
    others = sorted(set(savers + printed) - {0})
    feedback.expect(savers == [0] and printed == [0] and not others,
                    "the job prints and saves once, on rank 0",
                    f"{_on(others or [0], run.world_size)} printed or saved too: once per node is "
                    f"{NODES} times per job here, and {NODES} ranks writing one file race. `main` is "
                    f"True where RANK is 0." if others else
                    "rank 0 must both print the epoch's loss and save the weights.", hint=3)
