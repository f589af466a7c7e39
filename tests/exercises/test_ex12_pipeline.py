"""Exercise 12-pipeline: each common mistake gets the message that names it (real 2-rank launches)."""

from __future__ import annotations

import labkit
from mistakes import Mistake, each_named_by

NOTEBOOK = "12_pipeline_parallel.ipynb"

_LOSS = "losses.append(F.cross_entropy(run_stage(h), ym) / m)  # the mean over micro-batches"
_BACKWARD = "out.backward(grad)  # carries it back through this stage's layers"
_SEND_BACK = "dist.send(h.grad, dst=0)  # back to the previous stage"
_SENDS = "each stage sent 4 tensors a step"

MISTAKES = {
    "loss-not-averaged": Mistake(_LOSS, "losses.append(F.cross_entropy(run_stage(h), ym))",
                                 "the micro-batches' losses were added up, not averaged", (_SENDS,), hint=2),
    # Stage 0 ends its backward on its own, without the gradient stage 1 sent: only stage 0 goes wrong.
    "backward-without-the-gradient": Mistake(_BACKWARD, "out.sum().backward()",
                                             "stage 0's backward must carry the gradient stage 1 sent back",
                                             (_SENDS,), hint=2),
    # Stage 1 never answers: stage 0 waits in recv for ever.
    "no-gradient-sent-back": Mistake(_SEND_BACK, "pass", "the stages waited for each other for ever", hint=1),
    "no-requires-grad": Mistake("h.requires_grad_()  # its gradient is what stage 0 needs", "pass",
                                "stage 1 had no gradient to send back (h.grad was None)", hint=2),
}


test_each_mistake_gets_the_message_that_names_it = each_named_by(labkit.check_pipeline, NOTEBOOK, MISTAKES)
