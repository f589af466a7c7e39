"""Exercise 01-loop: each common mistake gets the message that names it (real launches on 2 ranks, or LABKIT_RANKS)."""

from __future__ import annotations

import labkit
from mistakes import Mistake, each_named_by

NOTEBOOK = "01_single_device.ipynb"

MISTAKES = {
    "one-rate-for-all": Mistake("lr = args.lrs[rank]", "lr = args.lrs[0]", "pick args.lrs[rank]"),
    "no-zero-grad": Mistake("        optimizer.zero_grad(set_to_none=True)\n", "", "clear the old gradients"),
    "no-eval-mode": Mistake("    model.eval()\n", "", "call model.eval() before", hint=2),
    "no-train-mode-after": Mistake("    model.train()\n", "", "call model.train() after"),
    "winner-not-gathered": Mistake("best_accuracy, best_lr = max(results)", "best_accuracy, best_lr = accuracy, lr",
                                   "dist.all_gather_object"),
}


test_each_mistake_gets_the_message_that_names_it = each_named_by(labkit.check_training_loop, NOTEBOOK, MISTAKES)
