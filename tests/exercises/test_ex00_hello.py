"""Exercise 00-hello: each common mistake gets the message that names it (real 3-rank launches)."""

from __future__ import annotations

import pytest

import labkit
from mistakes import Mistake, assert_named

NOTEBOOK = "00_setup.ipynb"

MISTAKES = {
    "no-all-reduce": Mistake("dist.all_reduce(value)\n", "", "each rank's sum is its own rank number", hint=3),
    "max-instead-of-sum": Mistake("dist.all_reduce(value)", "dist.all_reduce(value, op=dist.ReduceOp.MAX)",
                                  "not the sum"),
    "world-size-from-gpus": Mistake('world_size = int(os.environ["WORLD_SIZE"])',
                                    "world_size = max(1, torch.cuda.device_count())", "read WORLD_SIZE"),
}


@pytest.mark.launch
@pytest.mark.solutions
@pytest.mark.parametrize("mistake", MISTAKES)
def test_each_mistake_gets_the_message_that_names_it(mistake, workdir):
    assert_named(labkit.check_hello, NOTEBOOK, MISTAKES[mistake], workdir)
