"""labkit.zero_bytes, zero_table, zero_traffic and memory.storage_bytes (lesson
13): the ZeRO paper's table, exactly as lesson 13's scripts/zero.py holds and sends, proven on 3 real
gloo ranks, where units do not divide by the world size."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import labkit
from labkit import comm, memory
from _ranks import run_ranks

ZERO_PY = Path(__file__).resolve().parents[1] / "notebooks" / "scripts" / "zero.py"


# -- storage_bytes ---------------------------------------------------------------------------------
def test_storage_bytes_counts_each_buffer_once_and_whole():
    flat = torch.zeros(10)
    assert memory.storage_bytes([flat[:3], flat[3:7]]) == 40   # views of one buffer: the buffer
    assert memory.tensor_bytes([flat[:3], flat[3:7]]) == 28    # their own numbers only
    assert memory.storage_bytes([flat, torch.zeros(2, dtype=torch.float64)]) == 56
    assert memory.storage_bytes(flat) == 40


def test_a_freed_storage_counts_nothing():
    flat = torch.zeros(10)
    view = flat[2:5]
    flat.untyped_storage().resize_(0)   # how ZeRO-3 frees a unit it gathered
    assert memory.storage_bytes([view, flat]) == 0


def test_storage_bytes_rejects_non_tensors():
    with pytest.raises(TypeError, match="HINT"):
        memory.storage_bytes([torch.zeros(1), 3])


# -- the table -------------------------------------------------------------------------------------
def test_zero_bytes_is_the_papers_table_when_units_divide():
    psi, w = 24, 4   # two units of 8 and 16 values: both divide by 4
    table = {stage: labkit.zero_bytes([8, 16], w, stage) for stage in range(4)}
    assert table[0] == memory.ModelBytes(4 * psi, 4 * psi, 8 * psi)             # DDP: 16 Psi bytes
    assert table[1] == memory.ModelBytes(4 * psi, 4 * psi, 8 * psi // w)        # optimizer state cut
    assert table[2] == memory.ModelBytes(4 * psi, 4 * psi // w, 8 * psi // w)   # gradients too
    assert table[3] == memory.ModelBytes(4 * psi // w, 4 * psi // w, 8 * psi // w)   # parameters too


def test_zero_bytes_pads_each_unit_to_a_multiple_of_the_world_size():
    # 10 values pad to 12, 7 to 8: 20 in all, a slice of 5 per rank
    assert labkit.zero_bytes([10, 7], 4, 3) == memory.ModelBytes(20, 20, 40)
    assert labkit.zero_bytes([10, 7], 4, 1) == memory.ModelBytes(80, 68, 40)   # whole gradients, unpadded
    assert labkit.zero_bytes([10, 7], 4, 0) == memory.ModelBytes(68, 68, 136)  # DDP pads nothing
    assert labkit.zero_bytes([10, 7], 4, 2, value_bytes=2, optimizer_values=1) == memory.ModelBytes(40, 10, 10)


def test_on_one_rank_every_stage_holds_what_ddp_holds():
    units = [torch.nn.Linear(5, 3), torch.nn.LayerNorm(7)]
    assert {labkit.zero_bytes(units, 1, stage) for stage in range(4)} == {labkit.zero_bytes([18, 14], 1, 0)}


def test_zero_traffic_is_2_psi_for_stages_1_and_2_and_3_psi_for_stage_3():
    assert labkit.zero_traffic([8, 16], 4, 0) == {"all_reduce": 96}
    assert labkit.zero_traffic([8, 16], 4, 1) == labkit.zero_traffic([8, 16], 4, 2) == {
        "all_gather": 96, "reduce_scatter": 96}
    assert labkit.zero_traffic([10, 7], 4, 3) == {"all_gather": 160, "reduce_scatter": 80}   # padded


def test_zero_table_sends_what_ddp_sends_until_stage_3():
    table = labkit.zero_table([8, 16], 4)
    assert list(table.index) == ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
    assert table.loc["DDP", "sent"] == table.loc["ZeRO-1", "sent"] == table.loc["ZeRO-2", "sent"] == 144
    assert table.loc["ZeRO-3", "sent"] == 1.5 * 144
    assert (table["total"] == table[["params", "grads", "optimizer"]].sum(axis=1)).all()
    assert table["total"].is_monotonic_decreasing


@pytest.mark.parametrize("bad, match", [
    (dict(units=[], world_size=2, stage=1), "non-empty"),
    (dict(units=[3, 0], world_size=2, stage=1), "value counts > 0"),
    (dict(units=[3], world_size=0, stage=1), "world_size must be an int >= 1"),
    (dict(units=[3], world_size=2, stage=4), "stage must be 0"),
])
def test_bad_input_is_refused_with_the_values(bad, match):
    with pytest.raises(ValueError, match=match):
        labkit.zero_bytes(**bad)
    with pytest.raises(ValueError, match=match):
        labkit.zero_traffic(**bad)


# -- the lesson's ZeRO, on real ranks --------------------------------------------------------------
DIM, DEPTH, BATCH = 5, 2, 4   # units of 30, 2 × 235 and 70 values: 235 and 70 do not divide by 3


def _zero_rank(rank: int, world_size: int, stage: int) -> dict:
    """Two AdamW steps of an MLPStack under lesson 13's ZeRO at ``stage``: what the rank holds
    after the second backward, what one step sends, and the final weights."""
    import torch.nn.functional as F

    from labkit.models import MLPStack

    spec = importlib.util.spec_from_file_location("zero", ZERO_PY)
    zero = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(zero)
    torch.manual_seed(0)
    model = MLPStack(dim=DIM, depth=DEPTH, in_features=DIM)
    pieces = [model.stem, *model.blocks, model.head]
    numels = [sum(p.numel() for p in m.parameters()) for m in pieces]
    units = [zero.FlatShard(m, stage) for m in pieces]
    optimizer = torch.optim.AdamW([u.shard for u in units], lr=0.01)
    data = torch.Generator().manual_seed(rank)
    out = {"numels": numels}
    for step in (1, 2):
        x, y = torch.randn(BATCH, DIM, generator=data), torch.randint(0, 10, (BATCH,), generator=data)
        with comm.count_collectives() as sent:
            model.zero_grad(set_to_none=True)
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            params = [*model.parameters(), *(u.shard for u in units)]
            out["held"] = memory.ModelBytes(
                memory.storage_bytes(params), memory.storage_bytes([t.grad for t in params if t.grad is not None]),
                memory.tensor_bytes([v for s in optimizer.state.values() for k, v in s.items() if k != "step"]))
            zero.zero_step(units, optimizer, stage)
        out["sent"] = sent.bytes
    for u in units:
        if stage == 3:
            u.gather()
    out["weights"] = torch.cat([p.detach().flatten() for p in model.parameters()])
    return out


def _one_process(world_size: int) -> torch.Tensor:
    """The same two steps in one process, on the ranks' batches together: the truth."""
    import torch.nn.functional as F

    from labkit.models import MLPStack

    torch.manual_seed(0)
    model = MLPStack(dim=DIM, depth=DEPTH, in_features=DIM)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    data = [torch.Generator().manual_seed(rank) for rank in range(world_size)]
    for _ in (1, 2):
        batches = [(torch.randn(BATCH, DIM, generator=g), torch.randint(0, 10, (BATCH,), generator=g)) for g in data]
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(torch.cat([x for x, _ in batches])), torch.cat([y for _, y in batches])).backward()
        optimizer.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.launch
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_lessons_zero_holds_and_sends_what_the_table_says_and_trains_like_one_process(stage):
    world_size = 3
    truth = _one_process(world_size)
    for rank, out in enumerate(run_ranks(world_size, _zero_rank, stage)):
        assert sum(n % world_size > 0 for n in out["numels"]) == 3, out["numels"]   # padding is exercised
        assert out["held"] == labkit.zero_bytes(out["numels"], world_size, stage), (rank, out["held"])
        assert out["sent"] == labkit.zero_traffic(out["numels"], world_size, stage), (rank, out["sent"])
        torch.testing.assert_close(out["weights"], truth, rtol=0, atol=1e-5)


# -- the lesson's pitfall: a gradient W times too large, under AdamW --------------------------------
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_adamw_steps_alike_for_a_gradient_and_w_times_it_but_for_eps(world_size):
    """Lesson 13's pitfall says a forgotten division by W hides from AdamW: the step is the same
    but for eps, and the decoupled weight decay never sees the gradient. (In the lesson's kernel
    the first AdamW costs 2 s of imports, so this is checked here.)"""
    def one_step(scale: float, eps: float) -> torch.Tensor:
        w = torch.ones(1000, requires_grad=True)
        w.grad = scale * torch.randn(1000, generator=torch.Generator().manual_seed(0))
        torch.optim.AdamW([w], lr=0.01, eps=eps, weight_decay=0.01).step()
        return w.detach()

    assert torch.equal(one_step(world_size, 0.0), one_step(1, 0.0))        # no eps: the very same weights
    assert not torch.equal(one_step(world_size, 1e-8), one_step(1, 1e-8))  # the default eps tells them apart
