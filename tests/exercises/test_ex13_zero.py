"""Exercise 13-zero: each common mistake gets the message that names it (real 2-rank launches), and
the check reads a finished run."""

from __future__ import annotations

import json

import labkit
from mistakes import Mistake, each_named_by

NOTEBOOK = "13_zero.ipynb"

_SCATTER = "    dist.reduce_scatter_single(shard.grad, grads)  # slice r of the sum over ranks, to rank r\n"
_DIVIDE = "    shard.grad /= world_size  # the sum divided by W: the mean, as DDP computes it\n"
_STEP = "    optimizer.step()  # updates shard, this rank's slice of flat, and nothing else\n"
_GATHER = "    dist.all_gather_single(flat, shard)  # after the step: every rank's new slice, everywhere\n"
_FREE = ("    for p in params:\n"
         "        p.grad = None  # from now on this rank needs its slice of the gradient only\n")
_WEIGHTS = "after every step every weight equals DDP's"

MISTAKES = {
    # DDP's habit: all-reduce everything, then keep a slice. Right numbers, twice the bytes sent,
    # and the slice keeps the whole all-reduced buffer alive.
    "all-reduce-left-in": Mistake(
        "    shard.grad = torch.empty_like(shard)\n" + _SCATTER,
        "    dist.all_reduce(grads)\n    shard.grad = grads[rank * size:(rank + 1) * size]\n",
        "you all-reduced the whole gradient", (_WEIGHTS, "shard.grad is this rank's slice of DDP's mean"), hint=1),
    "no-division-by-world-size": Mistake(
        _DIVIDE, "", "times DDP's mean: a reduce-scatter sums over the 2 ranks", ("each step made one reduce-scatter",),
        hint=2),
    "gathered-before-the-step": Mistake(
        _STEP + _GATHER, _GATHER + _STEP, "you gathered the slices before optimizer.step()",
        ("shard.grad is this rank's slice of DDP's mean",), hint=3),
    "whole-gradients-kept": Mistake(
        _FREE, "", "still holds the whole gradients", (_WEIGHTS,), hint=2),
    "never-gathered": Mistake(
        _GATHER, "", "no rank ever received the others' updated slices", hint=3),
}

test_each_mistake_gets_the_message_that_names_it = each_named_by(labkit.check_zero, NOTEBOOK, MISTAKES)


def _run(folder, *, gap=0.0, ratio=1.0, own=0.0, other=0.0, grad_bytes=50_180, calls=(1, 1), device="cpu"):
    """A finished 2-rank Run of exercise 13, written by hand."""
    from labkit._results.run import Run

    (folder / "metrics").mkdir(parents=True)
    for rank in range(2):
        lines = [{"step": 0, "numel": 25_089, "padding": 1, "slice_values": 12_545}]
        lines += [{"step": step, "loss": 2.0, "samples": 16, "own_gap": own, "other_gap": other, "grad_gap": gap,
                   "grad_ratio": ratio, "grad_bytes": grad_bytes, "calls_reduce_scatter": calls[0],
                   "calls_all_gather": calls[1], "bytes_reduce_scatter": 100_360, "bytes_all_gather": 100_360}
                  for step in range(1, 5)]
        (folder / "metrics" / f"rank{rank}.jsonl").write_text("".join(
            json.dumps({"rank": rank, "world_size": 2, "restart": 0, "time": 1.0 + i, **line}) + "\n"
            for i, line in enumerate(lines)))
    return Run(folder, {"name": "by-hand", "nproc": 2, "device": device})


def test_check_zero_reads_a_finished_run(tmp_path):
    feedback = labkit.check_zero(_run(tmp_path))
    assert feedback.passed and len(feedback.items) == 4, feedback


def test_the_tolerance_is_exact_arithmetic_on_cpu_and_wider_on_gpus(tmp_path):
    assert not labkit.check_zero(_run(tmp_path / "cpu", gap=1e-5, own=1e-5)).passed
    assert labkit.check_zero(_run(tmp_path / "gpu", gap=1e-5, own=1e-5, device="cuda")).passed


def test_two_reduce_scatters_a_step_are_named(tmp_path):
    feedback = labkit.check_zero(_run(tmp_path, calls=(2, 1)))
    assert "the run made 2 and 1 a step" in feedback.messages("fail")[0], feedback
