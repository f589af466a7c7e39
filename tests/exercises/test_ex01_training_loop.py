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
    "window-loss-summed": Mistake("loss=(window_loss / args.log_every).item()", "loss=window_loss.item()",
                                  "log the window's mean, window_loss / log_every, not its sum", hint=3),
    "winner-not-gathered": Mistake("best_accuracy, best_lr = max(results)", "best_accuracy, best_lr = accuracy, lr",
                                   "dist.all_gather_object"),
}


test_each_mistake_gets_the_message_that_names_it = each_named_by(labkit.check_training_loop, NOTEBOOK, MISTAKES)


def test_a_tie_for_the_best_accuracy_accepts_either_rate_if_every_rank_names_the_same():
    """The solution's max(results) takes the larger rate on a tie; any tied rate has won."""
    import pandas as pd

    from labkit._course.checks.ex01_training_loop import _winner
    from labkit._course.feedback import Feedback

    rates = [0.01, 0.05, 0.1]

    def named(*best):
        df = pd.DataFrame({"rank": [0, 1, 2], "test_acc": [0.5, 0.5, 0.25], "best_lr": list(best)})
        feedback = Feedback("01-loop")
        _winner(feedback, df, rates)
        return feedback

    assert named(0.05, 0.05, 0.05).passed and named(0.01, 0.01, 0.01).passed
    split = named(0.01, 0.05, 0.05)
    assert split.status == "failed" and "but lr 0.01 or lr 0.05 (a tie) won" in split.messages("fail")[0]
    assert named(0.1, 0.1, 0.1).status == "failed"
