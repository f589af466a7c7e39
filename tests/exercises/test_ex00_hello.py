"""Exercise 00-hello: each common mistake gets the message that names it (real 3-rank launches)."""

from __future__ import annotations

import labkit
from mistakes import Mistake, each_named_by

NOTEBOOK = "00_setup.ipynb"

MISTAKES = {
    "no-all-reduce": Mistake("dist.all_reduce(value)\n", "", "each rank's sum is its own rank number", hint=3),
    "max-instead-of-sum": Mistake("dist.all_reduce(value)", "dist.all_reduce(value, op=dist.ReduceOp.MAX)",
                                  "not the sum"),
    "world-size-from-gpus": Mistake('world_size = int(os.environ["WORLD_SIZE"])',
                                    "world_size = max(1, torch.cuda.device_count())", "read WORLD_SIZE"),
}


test_each_mistake_gets_the_message_that_names_it = each_named_by(labkit.check_hello, NOTEBOOK, MISTAKES)
