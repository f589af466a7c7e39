"""Exercise 03-syncbn: each common mistake gets the message that names it (real launches on 2 ranks, or LABKIT_RANKS)."""

from __future__ import annotations

import labkit
from mistakes import Mistake, each_named_by

NOTEBOOK = "03_syncbn.ipynb"

_SUMS = "total = AllReduceSum.apply(local)"
_RUNNING = ("            self.running_mean.lerp_(mean, self.momentum)\n"
            "            self.running_var.lerp_(var * n / (n - 1), self.momentum)  # unbiased: what BatchNorm keeps\n")
_OUTPUTS = "every rank's outputs equal nn.BatchNorm2d's"

MISTAKES = {
    "local-statistics": Mistake(_SUMS, "total = local",
                                "each rank normalised its slice with its own mean and variance"),
    "all-reduce-autograd-cannot-see": Mistake(
        _SUMS, "dist.all_reduce(local)  # in place: autograd never sees it\n        total = local",
        "the gradient does not travel back through the all-reduce", (_OUTPUTS, "running_mean and running_var")),
    "backward-not-summed": Mistake("        dist.all_reduce(grad, op=dist.ReduceOp.SUM)\n", "",
                                   "AllReduceSum.backward must all-reduce grad_output too", (_OUTPUTS,)),
    "means-averaged-not-weighted": Mistake(
        "local = torch.cat([x.sum(dims), (x * x).sum(dims), count])",
        "local = torch.cat([x.mean(dims), (x * x).mean(dims), torch.ones_like(count)])",
        "you took the mean as the plain average of the ranks' means"),
    "biased-running-var": Mistake("self.running_var.lerp_(var * n / (n - 1), self.momentum)",
                                  "self.running_var.lerp_(var, self.momentum)",
                                  "running_var holds the biased variance", (_OUTPUTS, "so are the input gradients")),
    "no-running-update": Mistake(_RUNNING, "", "running_mean and running_var never changed", (_OUTPUTS,)),
    "one-apply-per-statistic": Mistake(   # the right numbers, three times the collectives
        _SUMS, "total = torch.cat([AllReduceSum.apply(part) for part in local.split([channels, channels, 1])])",
        "a step made 3 all-reduce(s) in forward and 3 in backward", (_OUTPUTS, "so are the input gradients"),
        hint=2),
}


test_each_mistake_gets_the_message_that_names_it = each_named_by(labkit.check_syncbn, NOTEBOOK, MISTAKES)
