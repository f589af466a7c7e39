"""labkit._results.costs: what each strategy should hold and send, from the model's shapes (the arithmetic
lessons 11 and 12 check against their runs), on a small MLPStack."""

from __future__ import annotations

import pytest
import torch

import labkit
from labkit.models import MLPStack

DIM, DEPTH, BATCH = 8, 4, 16


@pytest.fixture(scope="module")
def model():
    return MLPStack(dim=DIM, depth=DEPTH, in_features=DIM)


@pytest.fixture(scope="module")
def sizes(model):
    """P (parameter bytes), what TP cuts, and the root's bytes, counted the way lesson 11 counts them."""
    P = sum(p.numel() * 4 for p in model.parameters())
    split = sum(p.numel() * 4 for n, p in model.named_parameters()
                if n.split(".")[-2] in ("fc1", "fc2") and not n.endswith("fc2.bias"))
    root = sum(p.numel() * 4 for n, p in model.named_parameters() if not n.startswith("blocks."))
    return P, split, root


def cost(strategy, model, ranks, **kw):
    return labkit.expected_cost(strategy, model, ranks=ranks, batch_size=BATCH, **kw)


def test_one_process_and_ddp_hold_the_whole_model(model, sizes):
    P, _, _ = sizes
    one = cost("one process", model, 1)
    assert list(one.index) == [0] and one.loc[0, "state_bytes"] == 3 * P and one.loc[0, "sent_bytes"] == 0
    ddp = cost("DDP", model, 2)
    assert (ddp["state_bytes"] == 3 * P).all() and (ddp["sent_bytes"] == P).all()   # 2(n-1)/n = 1 at n=2
    assert (cost("DDP", model, 4)["sent_bytes"] == 1.5 * P).all()


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_fsdp_shards_add_up_to_the_model(model, sizes, ranks):
    P, _, _ = sizes
    fsdp = cost("FSDP", model, ranks)
    assert fsdp["param_bytes"].sum() == P and (fsdp["state_bytes"] == 3 * fsdp["param_bytes"]).all()


def test_fsdp_sends_its_weights_twice_and_its_gradients_once(model, sizes):
    P, _, root = sizes
    assert (cost("FSDP", model, 2)["sent_bytes"] == 1 / 2 * (3 * P - root)).all()   # every row count even
    # Over 4 ranks the head's 10 rows travel padded to 12 (FSDP's collectives send equal shards):
    # 2 rows of its weight (8 values) and 2 of its bias, 72 bytes more in each collective that
    # carries the root's parameters (the forward all-gather and the reduce-scatter).
    assert (cost("FSDP", model, 4)["sent_bytes"] == 3 / 4 * (3 * P - root + 2 * 72)).all()


def test_fsdp_cuts_rows_as_torch_chunk_does(model):
    """The head's 10 rows over 4 ranks: 3, 3, 3, 1 (torch.chunk), so rank 3 holds less."""
    head = dict(model.named_parameters())["head.1.weight"]
    assert [len(c) for c in torch.chunk(head, 4)] == [3, 3, 3, 1]
    fsdp = cost("FSDP", model, 4)
    assert fsdp.loc[3, "param_bytes"] < fsdp.loc[0, "param_bytes"]


@pytest.mark.parametrize("ranks", [2, 4])
def test_tp_cuts_fc1_and_fc2s_weight_and_sends_activations(model, sizes, ranks):
    P, split, _ = sizes
    tp = cost("TP", model, ranks)
    assert (tp["param_bytes"] == P - split + split // ranks).all()
    assert (tp["sent_bytes"] == 2 * (ranks - 1) / ranks * 2 * DEPTH * BATCH * DIM * 4).all()


@pytest.mark.parametrize("ranks", [2, 4])
def test_pp_stages_hold_disjoint_parts_and_send_at_their_cuts(model, sizes, ranks):
    P, _, _ = sizes
    pp = cost("PP", model, ranks)
    assert pp["param_bytes"].sum() == P
    activations = BATCH * DIM * 4
    assert list(pp["sent_bytes"]) == [activations] + [2 * activations] * (ranks - 2) + [activations]


@pytest.mark.parametrize("ranks, tp", [(2, 2), (4, 2)])
def test_fsdp_x_tp_is_tp_then_fsdp(model, sizes, ranks, tp):
    P, split, root = sizes
    dp = ranks // tp
    two_d = cost("FSDP x TP", model, ranks, tp=tp)
    assert two_d["param_bytes"].sum() == tp * (P - split) + split
    local = P - split + split // tp
    expected = 2 * (tp - 1) / tp * 2 * DEPTH * (BATCH // dp) * DIM * 4 + (dp - 1) / dp * (3 * local - root)
    assert (two_d["sent_bytes"] - expected).abs().max() < 1e-9 * expected
    if dp == 1:   # FSDP over one rank shards nothing: exactly TP
        assert two_d.equals(cost("TP", model, ranks))


@pytest.mark.parametrize("strategy, ranks, kw, match", [
    ("ZeRO", 2, {}, r"unknown strategy 'ZeRO'"),
    ("DDP", 0, {}, r"ranks must be a whole number >= 1"),
    ("TP", 3, {}, r"4\*dim = 32, which must divide by 3"),
    ("PP", 3, {}, r"depth must divide by ranks"),
    ("FSDP x TP", 3, {"tp": 2}, r"tp \(2\) must divide the ranks \(3\)"),
])
def test_bad_input_is_refused(model, strategy, ranks, kw, match):
    with pytest.raises(ValueError, match=match):
        cost(strategy, model, ranks, **kw)
