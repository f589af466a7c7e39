"""Exercise 09-nodes: each mix-up of a node's numbers with the job's gets the message that names
it (real launches on two nodes of one rank each)."""

from __future__ import annotations

import labkit
from mistakes import Mistake, each_named_by

NOTEBOOK = "09_multinode.ipynb"

MISTAKES = {
    "rank-is-local-rank": Mistake('rank = int(os.environ["RANK"])\n', "rank = local_rank\n",
                                  "took 0 for its rank: torchrun said RANK=1", hint=1),
    "world-is-local-world": Mistake('world_size = int(os.environ["WORLD_SIZE"])\n',
                                    "world_size = local_world_size\n",
                                    "its num_replicas was the ranks of one node", hint=1),
    "gpu-is-rank": Mistake("gpu = local_rank\n", "gpu = rank\n", "would use cuda:1, but its node has 1 GPU",
                           still_right=("each rank knows its place in the whole job",), hint=2),
    "sampler-per-node": Mistake("num_replicas=world_size, rank=rank,",
                                "num_replicas=local_world_size, rank=local_rank,",
                                "the ranks on the two nodes started an epoch with the same samples",
                                still_right=("each rank picks a GPU of its own node",), hint=2),
    "once-per-node": Mistake("    if rank == 0:\n", "    if local_rank == 0:\n",
                             "rank 1 printed or saved too: once per node", hint=3),
}


test_each_mistake_gets_the_message_that_names_it = each_named_by(labkit.check_nodes, NOTEBOOK, MISTAKES)
