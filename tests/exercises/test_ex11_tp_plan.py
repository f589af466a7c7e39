"""Exercise 11-tp-plan: each common mistake gets the message that names it (real 2-rank launches),
and the check reads a finished run."""

from __future__ import annotations

import json

import labkit
from labkit._course.checks import ex11_tp_plan
from mistakes import Mistake, each_named_by

NOTEBOOK = "11_tensor_parallel.ipynb"

_PLAN = 'PLAN = {"gate": ColwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()}'
_NUMBERS = "the output and every gradient equal one process's"

MISTAKES = {
    "down-cut-by-outputs": Mistake(   # the run stops on a shape mismatch: the check says why
        _PLAN, 'PLAN = {"gate": ColwiseParallel(), "up": ColwiseParallel(), "down": ColwiseParallel()}',
        "the run stopped because down is cut by its outputs (ColwiseParallel)", hint=2),
    "cuts-swapped": Mistake(
        _PLAN, 'PLAN = {"gate": RowwiseParallel(), "up": RowwiseParallel(), "down": ColwiseParallel()}',
        "gate is cut by its inputs (RowwiseParallel)", hint=1),
    "up-left-whole": Mistake(
        _PLAN, 'PLAN = {"gate": ColwiseParallel(), "down": RowwiseParallel()}',
        "up is not cut (every rank holds all of it) while gate is", hint=1),
    "nothing-cut": Mistake(   # runs, and computes the right numbers: on every rank, whole
        _PLAN, "PLAN = {}", "nothing is cut, so every rank holds all of gate, up and down", (_NUMBERS,), hint=1),
    "outputs-gathered": Mistake(   # right numbers, needless all-gathers
        _PLAN, "from torch.distributed.tensor import Replicate\n"
               "PLAN = {name: ColwiseParallel(output_layouts=Replicate()) for name in ('gate', 'up', 'down')}",
        "a layer's output was gathered whole (output_layouts=Replicate()?)", (_NUMBERS,), hint=2),
    "one-backward-all-reduce-per-block": Mistake(
        '"backward_all_reduces": 2 * args.depth', '"backward_all_reduces": args.depth',
        "each, cut by its outputs, all-reduces its own partial gradient of h",
        ("gate and up are cut by their outputs", _NUMBERS), hint=3),
    "bytes-of-the-hidden-layer": Mistake(
        '"bytes_per_all_reduce": args.batch_size * args.dim * 4',
        '"bytes_per_all_reduce": args.batch_size * 4 * args.dim * 4',
        "not the hidden layer (batch × 4·dim)", ("one all-reduce per block in forward and two in backward",), hint=3),
}

test_each_mistake_gets_the_message_that_names_it = each_named_by(labkit.check_tp_plan, NOTEBOOK, MISTAKES)


def _run(folder, *, gap=1e-7, forward=2, backward=4, placements=("Shard(dim=0)",) * 2 + ("Shard(dim=1)",),
         predicted=(2, 4, 4096), device="cpu"):
    """A finished 2-rank Run of exercise 11, written by hand."""
    from labkit._results.run import Run

    (folder / "metrics").mkdir(parents=True)
    for rank in range(2):
        lines = [{"step": 0, "dim": 64, "depth": 2, "batch_size": 16,
                  **{f"{name}_placement": f"({p},)" for name, p in zip(ex11_tp_plan.LAYERS, placements)},
                  **{f"{name}_shape": "?" for name in ex11_tp_plan.LAYERS}},
                 {"step": 0, **{f"predicted_{k}": v for k, v in zip(ex11_tp_plan.PREDICTIONS, predicted)}},
                 {"step": 1, "loss": 1.0, "output_gap": gap, "grad_gap": gap, "forward_all_reduce": forward,
                  "backward_all_reduce": backward, "bytes_all_reduce": 4096 * (forward + backward)}]
        (folder / "metrics" / f"rank{rank}.jsonl").write_text("".join(
            json.dumps({"rank": rank, "world_size": 2, "restart": 0, "time": 1.0 + i, **line}) + "\n"
            for i, line in enumerate(lines)))
    return Run(folder, {"name": "by-hand", "nproc": 2, "device": device})


def test_check_tp_plan_reads_a_finished_run(tmp_path):
    feedback = labkit.check_tp_plan(_run(tmp_path))
    assert feedback.passed and len(feedback.items) == 4, feedback


def test_the_tolerance_is_rounding_on_cpu_and_wider_on_gpus(tmp_path):
    assert not labkit.check_tp_plan(_run(tmp_path / "cpu", gap=1e-4)).passed
    assert labkit.check_tp_plan(_run(tmp_path / "gpu", gap=1e-4, device="cuda")).passed


def test_a_right_plan_with_wrong_numbers_points_at_the_skeleton(tmp_path):
    feedback = labkit.check_tp_plan(_run(tmp_path, gap=0.3))
    assert "keep the skeleton's lines outside the TODOs as they are" in feedback.messages("fail")[0], feedback
