"""Exercise 08-bf16: each common mistake gets the message that names it (real 2-rank launches)."""

from __future__ import annotations

import pytest

import labkit
from mistakes import Mistake, assert_named, each_named_by

NOTEBOOK = "08_speed.ipynb"

_HOOK = "model.register_comm_hook(None, default_hooks.bf16_compress_hook)"
_AUTOCAST = "with torch.autocast(device.type, dtype=torch.bfloat16):"
_STEP = "        optimizer.step()  # the weights stay float32\n"
_HALVED = "as bfloat16: half of float32's"
_AUTOCAST_OK = "the forward pass ran under bf16 autocast"

MISTAKES = {
    "no-hook": Mistake(_HOOK, "pass  #", "as float32: 4 bytes for each gradient value", (_AUTOCAST_OK,), hint=1),
    # A hook that all-reduces but does not compress: the bytes check must fail it (lesson 07's claim).
    "hook-that-does-not-compress": Mistake(_HOOK, "model.register_comm_hook(None, default_hooks.allreduce_hook)",
                                           "as float32: 4 bytes for each gradient value", (_AUTOCAST_OK,)),
    "fp16-hook": Mistake(_HOOK, "model.register_comm_hook(None, default_hooks.fp16_compress_hook)",
                         "but as float16 (fp16_compress_hook)", (_AUTOCAST_OK,), hint=2),
    "no-autocast": Mistake(_AUTOCAST, "with nullcontext():", "the forward pass ran in float32", (_HALVED,), hint=1),
    "fp16-autocast": Mistake(_AUTOCAST, "with torch.autocast(device.type, dtype=torch.float16):",
                             "the forward pass ran in float16", (_HALVED,), hint=2),
    # Converted after DDP wrapped it, the model also loses DDP's gradient hooks: nothing is all-reduced.
    "weights-in-bf16": Mistake(_HOOK, _HOOK + "\nmodel.to(torch.bfloat16)", "the weights are bfloat16", (_AUTOCAST_OK,)),
    "no-optimizer-step": Mistake(_STEP, "", "optimizer.step() ran 0 time(s) in a step", (_HALVED, _AUTOCAST_OK)),
    "two-optimizer-steps": Mistake(_STEP, _STEP + _STEP, "optimizer.step() ran 2 time(s) in a step", (_HALVED,)),
}


test_each_mistake_gets_the_message_that_names_it = each_named_by(labkit.check_bf16, NOTEBOOK, MISTAKES)


@pytest.mark.launch
@pytest.mark.solutions
def test_no_optimizer_step_also_leaves_the_loss_behind_float32(workdir):
    feedback = assert_named(labkit.check_bf16, NOTEBOOK, MISTAKES["no-optimizer-step"], workdir)
    assert any("where float32 training on the same batches reaches" in text for text in feedback.messages("fail"))
