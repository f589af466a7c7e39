"""labkit._results.strategies: a run's shards, costs and saved tensors read back, and proved against a
reference, on small tables and tensors written here."""

from __future__ import annotations

from types import SimpleNamespace

import pandas as pd
import pytest
import torch

import labkit


def _run(tmp_path, rows, name="tp-2", saves=None):
    for stem, per_rank in (saves or {}).items():
        for rank, tensors in per_rank.items():
            torch.save(tensors, tmp_path / f"{stem}_rank{rank}.pt")
    df = pd.DataFrame(rows)
    return SimpleNamespace(name=name, run_dir=tmp_path, metrics=lambda: df, info={"device": "cpu"})


ROWS = [
    {"rank": 0, "step": 0, "fc1_rows": 16.0, "fc1_cols": 8.0, "fc2_rows": 8.0, "fc2_cols": 16.0},
    {"rank": 1, "step": 0, "fc1_rows": 16.0, "fc1_cols": 8.0, "fc2_rows": 8.0, "fc2_cols": 16.0},
    {"rank": 0, "step": 1, "param_bytes": 100.0, "grad_bytes": 100.0, "optim_bytes": 100.0},
    {"rank": 1, "step": 1, "param_bytes": 100.0, "grad_bytes": 100.0, "optim_bytes": 100.0},
    {"rank": 0, "step": 1, "loss": 2.0, "sent_bytes": 64.0, "forward_all_reduce": 4.0, "backward_all_reduce": 4.0},
    {"rank": 1, "step": 1, "loss": 2.0, "sent_bytes": 64.0, "forward_all_reduce": 4.0, "backward_all_reduce": 4.0},
    {"rank": 0, "step": 2, "loss": 1.5, "sent_bytes": 32.0, "forward_all_reduce": 4.0, "backward_all_reduce": 4.0,
     "backward_all_gather": 2.0},
    {"rank": 1, "step": 2, "loss": 1.5, "sent_bytes": 32.0, "forward_all_reduce": 4.0, "backward_all_reduce": 4.0,
     "backward_all_gather": 2.0},
]


def test_a_runs_shards_state_and_last_step_are_read_back(tmp_path):
    run = _run(tmp_path, ROWS)
    assert labkit.held_shards(run).to_dict("index")[1] == {"fc1_rows": 16, "fc1_cols": 8, "fc2_rows": 8, "fc2_cols": 16}
    assert list(labkit.last_step(run)["sent_bytes"]) == [32.0, 32.0]
    measured = labkit.measured_cost(run)
    assert measured.loc[0].to_dict() == {"param_bytes": 100, "state_bytes": 300, "sent_bytes": 32.0}
    assert labkit.collectives_per_step(run) == "8 all-reduce, 2 all-gather"


def test_a_run_that_logged_no_state_is_a_clear_error(tmp_path):
    run = _run(tmp_path, [{"rank": 0, "step": 1, "loss": 2.0}])
    with pytest.raises(ValueError, match=r"tp-2 logged no param_bytes, grad_bytes, optim_bytes.*HINT"):
        labkit.measured_cost(run)
    with pytest.raises(ValueError, match=r"logged no sent_bytes"):
        labkit.last_step(run)


def test_saved_tensors_merge_the_ranks_and_gaps_are_relative(tmp_path):
    (tmp_path / "ref").mkdir()
    (tmp_path / "pp").mkdir()
    a, b = torch.tensor([1.0, -4.0]), torch.tensor([2.0, 2.0])
    reference = _run(tmp_path / "ref", ROWS, name="one", saves={"grads": {0: {"a": a, "b": b}},
                                                                "weights": {0: {"a": a, "b": b}}})
    pipeline = _run(tmp_path / "pp", ROWS, name="pp", saves={"grads": {0: {"a": a}, 1: {"b": b + 0.02}},
                                                             "weights": {0: {"a": a}, 1: {"b": b}}})
    assert labkit.saved_tensors(pipeline, "grads").keys() == {"a", "b"}
    assert labkit.tensor_gap(pipeline, reference, "grads") == pytest.approx(0.01)   # 0.02 / max|b| = 2
    assert labkit.tensor_gap(pipeline, reference, "weights") == 0
    same = labkit.prove_same(pipeline, reference, label="pp", loss_tol=1e-4, tensor_tol=0.02)
    assert same.gap.max() == 0
    with pytest.raises(AssertionError, match=r"pp: every gradient of the first step is 1.0e-02 .* tolerance 0.001"):
        labkit.prove_same(pipeline, reference, label="pp", loss_tol=1e-4, tensor_tol=1e-3)
    with pytest.raises(FileNotFoundError, match=r"no nope_rank<R>.pt .*HINT"):
        labkit.saved_tensors(pipeline, "nope")
    torch.save({"c": a}, tmp_path / "pp" / "weights_rank2.pt")
    with pytest.raises(ValueError, match=r"different weights: only in one of them: \['c'\]"):
        labkit.tensor_gap(pipeline, reference, "weights")
