"""Exercise 07-hook: each common mistake gets the message that names it (real 2-rank launches)."""

from __future__ import annotations

import labkit
from mistakes import Mistake, each_named_by

NOTEBOOK = "07_profiling.ipynb"

_COMPRESS = "compressed = buffer.to(torch.bfloat16).div_(world_size)"
_COUNT = 'state["bytes"] += compressed.numel() * compressed.element_size()'
_ASYNC = "future = dist.all_reduce(compressed, async_op=True).get_future()"
_HALVED = "as bfloat16: half of float32's"
_COUNTED = "your hook counted what it sent"
_OVERLAP = "your hook returned without waiting"
_FOLLOWS = "the loss follows float32 training on the same batches"

MISTAKES = {
    # The lesson's pitfall: the sum of the ranks' gradients, as if the learning rate were W times larger.
    "no-division": Mistake(_COMPRESS, "compressed = buffer.to(torch.bfloat16)",
                           "your hook returned the sum of the ranks' gradients", (_HALVED, _COUNTED, _OVERLAP), hint=2),
    "no-compression": Mistake(_COMPRESS, "compressed = buffer.clone().div_(world_size)",
                              "as float32: 4 bytes a gradient value, uncompressed", (_COUNTED, _FOLLOWS), hint=1),
    "counts-values-not-bytes": Mistake(_COUNT, 'state["bytes"] += compressed.numel()',
                                       "the number of values sent, not the bytes", (_HALVED, _FOLLOWS), hint=2),
    "counts-the-float32-bucket": Mistake(_COUNT, 'state["bytes"] += buffer.numel() * buffer.element_size()',
                                         "the float32 bucket's size", (_HALVED, _FOLLOWS), hint=2),
    # Waiting inside the hook holds up the backward pass: the trace shows no overlap.
    "waits-in-the-hook": Mistake(_ASYNC, _ASYNC + "\n    future.wait()",
                                 "the hook waited for each all-reduce before the backward pass went on",
                                 (_HALVED, _COUNTED, _FOLLOWS), hint=3),
}


test_each_mistake_gets_the_message_that_names_it = each_named_by(labkit.check_hook, NOTEBOOK, MISTAKES)
