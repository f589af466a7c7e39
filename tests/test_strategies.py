"""labkit._results.strategies: a run's shards, costs and saved tensors read back, and proved against a
reference, on small tables and tensors written here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import torch

import labkit

ROOT = Path(__file__).resolve().parent.parent


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


def test_tensor_gaps_name_each_tensor(tmp_path):
    (tmp_path / "ref").mkdir()
    (tmp_path / "run").mkdir()
    a, b = torch.tensor([1.0, -4.0]), torch.tensor([2.0, 2.0])
    reference = _run(tmp_path / "ref", ROWS, saves={"grads": {0: {"a": a, "b": b}}})
    run = _run(tmp_path / "run", ROWS, saves={"grads": {0: {"a": a, "b": b + 0.5}}})
    assert labkit.tensor_gaps(run, reference, "grads") == {"a": 0.0, "b": 0.25}
    assert labkit.tensor_gap(run, reference, "grads") == 0.25


def test_held_shards_keep_the_placements_when_logged(tmp_path):
    rows = [{**row, "fc1_placement": "(Shard(dim=0),)", "fc2_placement": "(Shard(dim=1),)"}
            if row["step"] == 0 else row for row in ROWS]
    held = labkit.held_shards(_run(tmp_path, rows))
    assert held.loc[0, "fc1_placement"] == "(Shard(dim=0),)" and held.loc[1, "fc2_rows"] == 8


def _notebook_cell(stem: str, needle: str) -> str:
    """The source of the code cell of notebooks/<stem>.ipynb that holds ``needle``."""
    cells = json.loads((ROOT / "notebooks" / f"{stem}.ipynb").read_text())["cells"]
    found = ["".join(c["source"]) for c in cells if c["cell_type"] == "code" and needle in "".join(c["source"])]
    assert len(found) == 1, (stem, needle, len(found))
    return found[0]


@pytest.mark.launch
def test_lesson_11s_traffic_check_fails_on_a_plan_that_gathers_whole(workdir):
    """Issue 26: a plan that gathers fc1's output whole and hands it to fc2 as a whole input computes
    the right numbers; lesson 11's check of what TP sends must fail on it, naming the all-gathers."""
    labkit.write_variant(ROOT / "notebooks" / "scripts" / "11_tp.py", "11_tp_gathers.py", {
        'PLAN = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}':
        'from torch.distributed.tensor import Replicate\n'
        'PLAN = {"fc1": ColwiseParallel(output_layouts=Replicate()), "fc2": RowwiseParallel(input_layouts=Replicate())}'})
    sizes = {"DIM": 32, "DEPTH": 2, "BATCH": 16, "RANKS": 2}
    args = ["--dim", "32", "--depth", "2", "--batch-size", "16", "--steps", "2", "--strategy", "tp"]
    run = labkit.launch("11_tp_gathers.py", nproc=2, device="cpu", args=args, quiet=True, timeout_s=120)
    cell = _notebook_cell("11_tensor_parallel", "counts = labkit.last_step(tp)")
    with pytest.raises(AssertionError) as failed:
        exec(cell, {"labkit": labkit, "tp": run, **sizes})
    assert "all_gather" in str(failed.value), failed.value
    assert labkit.last_step(run)["forward_all_gather"].eq(2).all()   # one per block: fc1's output, whole


def _first_code_cell(stem: str) -> str:
    cells = json.loads((ROOT / "notebooks" / f"{stem}.ipynb").read_text())["cells"]
    return next("".join(c["source"]) for c in cells if c["cell_type"] == "code")


@pytest.mark.parametrize("smoke", ["1", "0"])
@pytest.mark.parametrize("ranks", ["2", "3", "4", "8"])
def test_lesson_12s_hatched_rows_are_lesson_11s_runs(monkeypatch, capsys, smoke, ranks):
    """Lesson 12 draws DDP, FSDP and TP from the arithmetic lesson 11 checked against its runs: only
    honest if both lessons choose the same sizes and ranks, in every mode and at every LABKIT_RANKS."""
    monkeypatch.setenv("LABKIT_SMOKE", smoke)
    monkeypatch.setenv("LABKIT_RANKS", ranks)
    sizes = []
    for stem in ("11_tensor_parallel", "12_pipeline_parallel"):
        scope: dict = {}
        exec(_first_code_cell(stem), scope)
        sizes.append({k: scope[k] for k in ("DIM", "DEPTH", "BATCH", "RANKS", "ON_GPUS")})
    assert sizes[0] == sizes[1]


def _map(stem: str) -> list[str]:
    """The rows of the strategy map (the markdown table whose header starts "| strategy | splits")."""
    cells = json.loads((ROOT / "notebooks" / f"{stem}.ipynb").read_text())["cells"]
    tables = [[line for line in "".join(c["source"]).splitlines() if line.startswith("|")]
              for c in cells if c["cell_type"] == "markdown" and "| strategy | splits |" in "".join(c["source"])]
    assert len(tables) == 1, (stem, len(tables))
    return tables[0]


def test_the_strategy_map_is_one_map():
    """Lesson 14 shows lesson 12's map, row for row, with its own two rows in it: not a second table."""
    rows = _map("12_pipeline_parallel")
    assert _map("14_long_context_experts") == rows
    assert [row.split("|")[1].strip() for row in rows[2:]] == [
        "DDP", "FSDP", "tensor parallel", "pipeline parallel", "FSDP × TP (2-D)", "context parallel", "expert parallel"]


def test_lesson_14s_context_parallel_api_refuses_a_length_that_does_not_split():
    """On 3 (or 6) GPUs 8192 tokens make no 2 x W equal pieces: torch then drops its zig-zag and the
    shares differ. The script refuses such a length with the one that works, before it touches a GPU
    (so this runs on CPU); the lesson passes fit(8192) for that reason."""
    env = {**os.environ, "WORLD_SIZE": "3", "LOCAL_RANK": "0", "RANK": "0"}
    done = subprocess.run([sys.executable, "scripts/14_cp_api.py", "--seq-len", "8192"], cwd=ROOT / "notebooks",
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, (done.returncode, done.stderr[-800:])
    assert "8192 tokens do not split into 6 equal pieces" in done.stderr
    assert "HINT: a multiple of 6." in done.stderr
