"""labkit.try_load: each way of opening a file reports what really happened, and prints nothing."""

from __future__ import annotations

import pickle

import pytest
import torch

import labkit
from labkit.models import MLPStack

DIM, DEPTH = 7, 2  # 7 rows do not split evenly over 2 ranks


def test_a_plain_state_dict_loads_every_way(tmp_path):
    saved = MLPStack(dim=DIM, depth=DEPTH)
    torch.save(saved.state_dict(), tmp_path / "plain.pt")
    model = MLPStack(dim=DIM, depth=DEPTH)
    found = labkit.try_load(tmp_path / "plain.pt", model)
    assert (found.fresh_python, found.into_model, found.logged) == (None, None, [])
    assert found.numbers_held == found.numbers_in_model == sum(p.numel() for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), saved.parameters()))
    assert "loaded" in str(found)


def test_the_ddp_wrappers_keys_open_but_do_not_fit_a_plain_model(tmp_path):
    state = {f"module.{k}": v for k, v in MLPStack(dim=DIM, depth=DEPTH).state_dict().items()}
    torch.save(state, tmp_path / "wrapped.pt")
    found = labkit.try_load(tmp_path / "wrapped.pt", MLPStack(dim=DIM, depth=DEPTH))
    assert found.fresh_python is None
    assert found.into_model.startswith("Error(s) in loading state_dict") and "Missing key(s)" in found.into_model
    assert found.numbers_held == found.numbers_in_model


def test_a_file_that_opens_nowhere_raises_what_torch_load_raised(tmp_path):
    (tmp_path / "torn.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        labkit.try_load(tmp_path / "torn.pt", MLPStack(dim=DIM, depth=DEPTH))


def test_bad_input_is_refused_before_anything_runs(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"missing\.pt.*HINT"):
        labkit.try_load(tmp_path / "missing.pt", MLPStack(dim=DIM, depth=DEPTH))
    torch.save({}, tmp_path / "empty.pt")
    with pytest.raises(TypeError, match=r"model must be an nn.Module, got dict.*HINT"):
        labkit.try_load(tmp_path / "empty.pt", {})


NAIVE = f"""
    import sys, torch, torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from labkit import memory, metrics
    from labkit.models import MLPStack
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = MLPStack(dim={DIM}, depth={DEPTH})
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    held = sum(memory.local_tensor(v).numel() for v in model.state_dict().values())
    metrics.log(0, held=held)
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), sys.argv[1])   # the pitfall of lesson 06
    dist.barrier()
    dist.destroy_process_group()
"""


@pytest.mark.launch
def test_rank_0s_fsdp_state_dict_holds_its_shards_only(workdir, write_script, capfd):
    write_script("naive.py", NAIVE)
    run = labkit.launch("naive.py", nproc=2, args=[str(workdir / "naive.pt")], quiet=True, timeout_s=180)
    held = run.metrics().dropna(subset=["held"]).set_index("rank")["held"]
    capfd.readouterr()
    found = labkit.try_load(workdir / "naive.pt", MLPStack(dim=DIM, depth=DEPTH))
    printed = capfd.readouterr()
    assert "UnpicklingError" in found.fresh_python and "torch.distributed.tensor" in found.fresh_python
    weight = found.state["blocks.0.fc1.weight"]
    assert type(weight).__name__ == "DTensor" and weight.to_local().shape[0] < weight.shape[0]
    assert found.into_model.startswith("'stem.1.weight': ") and "DTensor" in found.into_model
    assert found.numbers_held == held[0] < held.sum() == found.numbers_in_model   # rank 0's shards
    assert any("DeviceMesh" in line for line in found.logged)
    assert "DeviceMesh" not in printed.out + printed.err, "PyTorch's log lines are collected, not printed"
    assert "DeviceMesh" in str(found)
