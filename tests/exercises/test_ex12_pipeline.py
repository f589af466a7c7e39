"""Exercise 12-pipeline: each common mistake gets the message that names it (real 2-rank launches)."""

from __future__ import annotations

import pytest

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
    # Each micro-batch's backward right after its forward, on both stages: the same numbers and
    # sends, but no stage ever holds more than one micro-batch. The task asks for GPipe's order.
    "one-micro-batch-at-a-time": Mistake(
        "            for xm in x.chunk(m):  # every forward first: GPipe\n"
        "                out = run_stage(xm)\n"
        "                dist.send(out.detach(), dst=1)  # the activations, to the next stage\n"
        "                outputs.append(out)\n"
        "            for out in outputs:  # then every backward\n"
        "                grad = torch.empty_like(out)\n"
        "                dist.recv(grad, src=1)  # the gradient of this output, from stage 1\n"
        "                out.backward(grad)  # carries it back through this stage's layers\n"
        "        else:\n"
        "            inputs = []\n"
        "            for ym in y.chunk(m):\n"
        "                h = torch.empty(len(ym), args.dim)\n"
        "                dist.recv(h, src=0)\n"
        "                h.requires_grad_()  # its gradient is what stage 0 needs\n"
        "                losses.append(F.cross_entropy(run_stage(h), ym) / m)  # the mean over micro-batches\n"
        "                inputs.append(h)\n"
        "            for h, loss in zip(inputs, losses):\n"
        "                loss.backward()\n"
        "                dist.send(h.grad, dst=0)  # back to the previous stage\n",
        "            for xm in x.chunk(m):\n"
        "                out = run_stage(xm)\n"
        "                dist.send(out.detach(), dst=1)\n"
        "                grad = torch.empty_like(out)\n"
        "                dist.recv(grad, src=1)\n"
        "                out.backward(grad)\n"
        "        else:\n"
        "            for ym in y.chunk(m):\n"
        "                h = torch.empty(len(ym), args.dim)\n"
        "                dist.recv(h, src=0)\n"
        "                h.requires_grad_()\n"
        "                losses.append(F.cross_entropy(run_stage(h), ym) / m)\n"
        "                losses[-1].backward()\n"
        "                dist.send(h.grad, dst=0)\n",
        "stage 0 held at most 1 micro-batch at once, not 4", (_SENDS, "every weight of both stages ends"),
        hint=1),
    "no-requires-grad": Mistake("h.requires_grad_()  # its gradient is what stage 0 needs", "pass",
                                "stage 1 had no gradient to send back (h.grad was None)", hint=2),
}


test_each_mistake_gets_the_message_that_names_it = each_named_by(labkit.check_pipeline, NOTEBOOK, MISTAKES)


@pytest.mark.parametrize("held, words", [
    ({0: 4, 1: 4}, "each stage held all 4 micro-batches at once"),                # GPipe
    ({0: 2, 1: 1}, "stage 0 held at most 2 micro-batches at once, not 4"),        # 1F1B on two stages
    ({0: 4, 1: 1}, "stage 1 held at most 1 micro-batch at once, not 4"),
    ({0: 8, 1: 4}, "stage 0 held 8 micro-batches at once, more than the 4 a step has"),
])
def test_gpipe_order_is_read_from_what_each_stage_held(held, words):
    import pandas as pd

    from labkit._course.checks.ex12_pipeline import _gpipe_order
    from labkit._course.feedback import Feedback

    rows = [{"rank": r, "step": s, "held": n if s == 2 else min(n, 1)} for r, n in held.items() for s in (1, 2)]
    rows += [{"rank": r, "step": 0, "held": None} for r in held]   # step 0 logs the settings only
    feedback = Feedback("12-pipeline")
    _gpipe_order(feedback, pd.DataFrame(rows), {"microbatches": 4})
    assert any(words in text for text in feedback.messages("ok") + feedback.messages("fail")), str(feedback)
    assert (feedback.status == "failed") == (held != {0: 4, 1: 4})
