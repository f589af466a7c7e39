"""Exercise 14-moe-dispatch: each common mistake gets the message that names it (real 2-rank
launches), and the check reads a finished run."""

from __future__ import annotations

import json

import labkit
from mistakes import Mistake, each_named_by

NOTEBOOK = "14_long_context_experts.ipynb"

_COUNTS = ("    received_counts = torch.empty_like(counts)\n"
           "    dist.all_to_all_single(received_counts, counts)  # from each rank: its rows for each of my experts\n")
_COMBINE = "    return torch.zeros_like(x).index_add(0, token, back * row_weight[:, None])\n"
_NUMBERS = "every rank's output equals one process's"

MISTAKES = {
    "split-sizes-not-exchanged": Mistake(   # each rank assumes it receives what it sends
        _COUNTS, "    received_counts = counts.clone()  # as many as I send, surely\n",
        "the ranks disagreed on how many rows go where", hint=1),
    "combined-in-the-wrong-order": Mistake(
        _COMBINE, "    return torch.zeros_like(x).index_add(0, token.sort().values, back * row_weight[:, None])\n",
        "was added to the wrong token", hint=3),
    "router-weights-left-out": Mistake(
        _COMBINE, "    return torch.zeros_like(x).index_add(0, token, back)\n",
        "without the router's weights", hint=3),
    "rows-sent-round-autograd": Mistake(   # right numbers forward; the rows' gradients never go back
        "    received = AllToAll.apply(rows, send, receive)\n",
        "    received = rows.new_empty(sum(receive), rows.shape[1])\n"
        "    dist.all_to_all_single(received, rows, receive, send)\n",
        "AllToAll.apply", (_NUMBERS,), hint=1),
    "counts-gathered-not-exchanged": Mistake(   # right numbers, but every rank receives every count
        _COUNTS, "    everyone = [torch.empty_like(counts) for _ in range(world_size)]\n"
                 "    dist.all_gather(everyone, counts)\n"
                 "    received_counts = torch.cat([c.view(world_size, -1)[rank] for c in everyone])\n",
        "exchanged the counts with all_gather", (_NUMBERS,), hint=1),
}

test_each_mistake_gets_the_message_that_names_it = each_named_by(labkit.check_moe_dispatch, NOTEBOOK, MISTAKES)


def _run(folder, *, gap=1e-7, unweighted=0.5, total=0.5, calls=(3, 2), device="cpu"):
    """A finished 2-rank Run of exercise 14, written by hand: 2 experts a rank, 4 numbers a token;
    rank 0 sends 3 rows to its own experts and 5 to rank 1's, rank 1 sends 4 to rank 0's and 2 to
    its own."""
    from labkit._results.run import Run

    counts = {0: [1, 2, 2, 3], 1: [3, 1, 1, 1]}
    (folder / "metrics").mkdir(parents=True)
    for rank in range(2):
        out = sum(counts[rank][2:]) if rank == 0 else sum(counts[rank][:2])
        came = sum(counts[1][:2]) if rank == 0 else sum(counts[0][2:])
        rows = (out + came) * 4 * 4
        lines = [{"step": 0, "dim": 4, "tokens": 4, "experts": 4,
                  **{f"count_{e}": n for e, n in enumerate(counts[rank])}},
                 {"step": 1, "output_gap": gap, "grad_gap": gap, "unweighted_gap": unweighted,
                  "total_gap": total, "forward_all_to_all": calls[0], "backward_all_to_all": calls[1],
                  "forward_sent": 2 * 8 + rows, "backward_sent": rows}]
        (folder / "metrics" / f"rank{rank}.jsonl").write_text("".join(
            json.dumps({"rank": rank, "world_size": 2, "restart": 0, "time": 1.0 + i, **line}) + "\n"
            for i, line in enumerate(lines)))
    return Run(folder, {"name": "by-hand", "nproc": 2, "device": device})


def test_check_moe_dispatch_reads_a_finished_run(tmp_path):
    feedback = labkit.check_moe_dispatch(_run(tmp_path))
    assert feedback.passed and len(feedback.items) == 3, feedback


def test_the_tolerance_is_rounding_on_cpu_and_wider_on_gpus(tmp_path):
    assert not labkit.check_moe_dispatch(_run(tmp_path / "cpu", gap=1e-4)).passed
    assert labkit.check_moe_dispatch(_run(tmp_path / "gpu", gap=1e-4, device="cuda")).passed


def test_wrong_numbers_that_no_diagnosis_explains_ask_where_the_rows_went(tmp_path):
    feedback = labkit.check_moe_dispatch(_run(tmp_path, gap=0.3))
    assert "does each row reach its expert's rank" in feedback.messages("fail")[0], feedback


def test_a_forward_without_the_counts_exchange_is_named(tmp_path):
    feedback = labkit.check_moe_dispatch(_run(tmp_path, calls=(2, 2)))
    assert any("the counts were never exchanged" in text for text in feedback.messages("fail")), feedback
