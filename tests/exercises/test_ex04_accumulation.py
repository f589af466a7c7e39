"""Exercise 04-accumulation: each common mistake gets the message that names it (real launches on 2 ranks, or LABKIT_RANKS)."""

from __future__ import annotations

import labkit
from mistakes import Mistake, each_named_by

NOTEBOOK = "04_accumulation.ipynb"

_MICRO = "with nullcontext() if last else model.no_sync():"
_GRADIENT = "the gradient of every optimizer step, on every rank, is that of one batch"

MISTAKES = {
    "loss-not-scaled": Mistake("loss = F.cross_entropy(model(x), y) / k", "loss = F.cross_entropy(model(x), y)",
                               "the gradient is 4× too large",
                               ("DDP all-reduced every gradient once per optimizer step",)),
    "no-no-sync": Mistake(_MICRO, "with nullcontext():", "Correct but wasteful", (_GRADIENT,), hint=2),
    "no-sync-on-the-last-micro-step-too": Mistake(_MICRO, "with model.no_sync():", "DDP never all-reduced a gradient",
                                                  ("optimizer.step() ran once per optimizer step",)),
    "step-every-micro-step": Mistake("            loss.backward()  # adds into .grad\n    optimizer.step()\n",
                                     "            loss.backward()  # adds into .grad\n        optimizer.step()\n",
                                     "optimizer.step() ran 4 times per optimizer step"),
    "zero-grad-inside-the-loop": Mistake(
        "        last = i == k - 1\n", "        last = i == k - 1\n        optimizer.zero_grad(set_to_none=True)\n",
        "zero_grad inside the micro-step loop clears what the earlier micro-steps added",
        ("optimizer.step() ran once per optimizer step",)),
    "gradients-never-cleared": Mistake(
        "    optimizer.zero_grad(set_to_none=True)  # the next optimizer step starts from nothing\n", "",
        "the first optimizer step is right, but from step 2 on the gradient still holds the previous step's"),
}


test_each_mistake_gets_the_message_that_names_it = each_named_by(labkit.check_accumulation, NOTEBOOK, MISTAKES)
