"""Exercise 09-nodes: each mix-up of a node's numbers with the job's gets the message that names
it (real launches on two nodes).

Most mix-ups show with one rank per node (the default 2 CPU ranks). A few do not: with one rank
per node ``LOCAL_RANK`` is 0 and ``RANK`` equals ``GROUP_RANK`` everywhere, so a rank taken from
the node's number, or every rank of a node on one GPU, looks right. Those are launched at
``LABKIT_RANKS=4``, two nodes of two ranks, where the check must name them; at one rank per node
the check must pass them *and say* what it could not see.
"""

from __future__ import annotations

import pytest

import labkit
from mistakes import Mistake, assert_named, each_named_by, wrong

NOTEBOOK = "09_multinode.ipynb"

# The words hold at one rank per node and at two (the first wrong rank differs between them).
MISTAKES = {
    "rank-is-local-rank": Mistake('rank = int(os.environ["RANK"])\n', "rank = local_rank\n",
                                  "took 0 for its rank: torchrun said RANK=", hint=1),
    "world-is-local-world": Mistake('world_size = int(os.environ["WORLD_SIZE"])\n',
                                    "world_size = local_world_size\n",
                                    "its num_replicas was fewer than the ranks of the whole job", hint=1),
    "gpu-is-rank": Mistake("gpu = local_rank\n", "gpu = rank\n", "but its node has",
                           still_right=("each rank knows its place in the whole job",), hint=2),
    "sampler-per-node": Mistake("num_replicas=world_size, rank=rank,",
                                "num_replicas=local_world_size, rank=local_rank,",
                                "the ranks on the two nodes started an epoch with the same samples",
                                still_right=("each rank picks a GPU of its own node",), hint=2),
    "once-per-node": Mistake("    main = rank == 0\n", "    main = local_rank == 0\n",
                             "printed or saved too: once per node", hint=3),
}

test_each_mistake_gets_the_message_that_names_it = each_named_by(labkit.check_nodes, NOTEBOOK, MISTAKES)

#: Mix-ups that one rank per node hides; at two ranks per node the check names each.
HIDDEN_AT_ONE_PER_NODE = {
    "rank-from-node-number": Mistake('rank = int(os.environ["RANK"])\n',
                                     'rank = int(os.environ["GROUP_RANK"]) + local_rank\n',
                                     "rank 2, rank 0 of node 1, took 1 for its rank: torchrun said RANK=2",
                                     hint=1),
    "world-is-nodes": Mistake('world_size = int(os.environ["WORLD_SIZE"])\n',
                              'world_size = int(os.environ["GROUP_WORLD_SIZE"])\n',
                              "its num_replicas was fewer than the ranks of the whole job", hint=1),
    "one-gpu-per-node": Mistake("gpu = local_rank\n", "gpu = 0\n",
                                "rank 1, rank 1 of its node, would use cuda:0, the GPU of another rank",
                                still_right=("each rank picks a GPU its node has",), hint=2),
}


@pytest.mark.launch
@pytest.mark.solutions
@pytest.mark.parametrize("mistake", list(HIDDEN_AT_ONE_PER_NODE))
def test_a_mix_up_one_rank_per_node_hides_is_named_at_two_per_node(mistake, workdir, monkeypatch):
    monkeypatch.setenv("LABKIT_RANKS", "4")  # two nodes of two ranks
    assert_named(labkit.check_nodes, NOTEBOOK, HIDDEN_AT_ONE_PER_NODE[mistake], workdir)


@pytest.mark.launch
@pytest.mark.solutions
def test_one_rank_per_node_passes_what_it_cannot_see_and_says_so(workdir, monkeypatch):
    monkeypatch.setenv("LABKIT_RANKS", "2")  # two nodes of one rank
    mistake = HIDDEN_AT_ONE_PER_NODE["rank-from-node-number"]
    (workdir / "scripts").mkdir(exist_ok=True)
    (workdir / "scripts" / "mine.py").write_text(wrong(NOTEBOOK, mistake.old, mistake.new))
    feedback = labkit.check_nodes("scripts/mine.py")
    assert feedback.passed, feedback
    said = [text for text in feedback.messages("ok") if "cannot tell them apart" in text]
    assert any("each rank knows its place in the whole job" in text for text in said), feedback
    assert any("LABKIT_RANKS=4" in text for text in said), feedback
