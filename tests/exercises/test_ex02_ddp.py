"""Exercise 02-ddp: each common mistake gets the message that names it (real launches on 2 ranks, or LABKIT_RANKS)."""

from __future__ import annotations

import pytest

import labkit
from mistakes import Mistake, each_named_by

NOTEBOOK = "02_ddp.ipynb"

MISTAKES = {
    "no-sampler-in-loader": Mistake("batch_size=args.batch_size, sampler=sampler, drop_last=True",
                                    "batch_size=args.batch_size, shuffle=True, drop_last=True",
                                    "saw the same samples as rank 0: is the DistributedSampler in place",
                                    hint=2),
    "no-set-epoch": Mistake("    sampler.set_epoch(epoch)\n", "    pass\n", "sampler.set_epoch(epoch)", hint=2),
    "no-ddp-wrap": Mistake('model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)\n', "",
                           "wrap the model in DistributedDataParallel", hint=3),
    "accuracy-not-reduced": Mistake("    dist.all_reduce(counts)\n", "    pass\n", "dist.all_reduce the counts"),
    "every-rank-prints": Mistake("    if rank == 0:\n", "    if True:\n", "print only where rank == 0"),
    "sampler-not-shuffled": Mistake("rank=rank, shuffle=True,", "rank=rank, shuffle=False,",
                                    "keep the sampler's shuffle=True"),
    "no-destroy": Mistake("dist.destroy_process_group()\n", "", "never calls dist.destroy_process_group()",
                          hint=3),
    "gpu-device-ids-on-cpu": Mistake('device_ids=[local_rank] if device.type == "cuda" else None',
                                     "device_ids=[local_rank]", "DDP takes device_ids=None"),
}


test_each_mistake_gets_the_message_that_names_it = each_named_by(labkit.check_ddp, NOTEBOOK, MISTAKES)


@pytest.mark.parametrize("world, steps, right", [
    (2, 16, True),    # 1024 images, 32 a batch: 512 a rank, 16 steps
    (3, 10, True),    # 341 or 342 a rank: 10 full batches (a loader with drop_last=True)
    (3, 11, True),    # ... and the short last batch kept (the DataLoader's default)
    (3, 32, False),   # every rank read the whole data set
    (2, 32, False),
])
def test_an_epochs_steps_are_a_ranks_share_rounded_either_way(world, steps, right):
    """When the ranks do not divide the data set, a sampler and loader that round either way are
    right; an epoch over the whole data set on every rank is not."""
    import pandas as pd

    from labkit._course.checks.ex02_ddp import _each_rank_its_share
    from labkit._course.feedback import Feedback

    rows = [{"rank": r, "epoch": e, "step": 1 + e * steps, "first_batch": 10 * r + e}
            for r in range(world) for e in range(2)]
    feedback = Feedback("02-ddp")
    _each_rank_its_share(feedback, pd.DataFrame(rows), {"train_size": 1024, "batch_size": 32}, world)
    assert feedback.passed == right, feedback
