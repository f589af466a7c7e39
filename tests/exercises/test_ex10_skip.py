"""Exercise 10-skip: each common mistake gets the message that names it (real 3-rank launches)."""

from __future__ import annotations

import pytest

import labkit
from mistakes import Mistake, each_named_by

NOTEBOOK = "10_faults.ipynb"

MISTAKES = {
    # the flags are never exchanged: the rank with the bad batch skips alone, and the run hangs
    "no-all-reduce": Mistake("        dist.all_reduce(bad)  # every rank now holds every rank's flag\n", "",
                             "had a bad batch at step 5 and skipped that step alone", hint=1),
    # the flags are exchanged, but nobody skips: the NaN goes into every rank's sum
    "no-skip": Mistake("            continue\n        ### END SOLUTION", "        ### END SOLUTION",
                       "yet every rank went on with the step: its NaN went into the sum", hint=2),
    # every rank sets index 0 (not its own): rank 0 names the wrong rank
    "own-index-forgotten": Mistake("bad[rank] = 0.0 if", "bad[0] = 0.0 if",
                                   "rank 0 should print, for step 6, a line like 'step 6: skipped on "
                                   "every rank, a bad batch on rank 2'; it named rank(s) [0]", hint=3,
                                   still_right=("every all_reduce gave the right sum",)),
    # every rank reports the skipped step
    "every-rank-prints": Mistake("            if rank == 0:\n                ranks =",
                                 "            if True:\n                ranks =",
                                 "printed the skipped steps too: print only where rank == 0", hint=3),
}

test_each_mistake_gets_the_message_that_names_it = each_named_by(labkit.check_skip, NOTEBOOK, MISTAKES)


@pytest.mark.parametrize("line, found", [
    ("step 6: skipped on every rank, a bad batch on rank 2", (6, [2])),   # the solution's line
    ("step 6: skipped on ranks [1, 3]", (6, [1, 3])),                     # a list, printed as it is
    ("step 6: skipped on rank tensor([[2]])", (6, [2])),                  # bad.nonzero(), printed as it is
    ("step 6: bad batch on rank 2, skipped", (6, [2])),                   # another order
    ("Step 6 skipped: ranks 1 and 3", (6, [1, 3])),
    ("step 6: bad batch on rank 2 (loss nan), skipped at step 6", (6, [2])),  # no number after the ranks
    ("step 4: loss 2.1", None),                                          # not about a skipped step
])
def test_rank_0s_skipped_step_is_read_however_the_ranks_are_printed(line, found):
    from labkit._course.checks.ex10_skip import said_skipped

    assert said_skipped(line) == found
