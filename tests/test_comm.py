"""labkit.comm: the counting hook counts DDP's gradient all-reduces, and changes no gradient.

Also the properties lesson 04 teaches, as tests: k accumulated micro-batches
(loss / k) give the gradient of one batch k times larger, in one process and
under DDP, with and without ``no_sync``; ``no_sync`` makes k micro-steps cost
the all-reduces of one step. Float64, so "the same" means within 1e-12.
"""

from __future__ import annotations


import pytest
import torch
from torch import nn
from torch.nn import functional as F

from _ranks import run_ranks
from labkit import comm
from labkit.comm import AllReduceCounter, count_allreduces

MICRO, TOL = 3, 1e-12   # samples per micro-batch (per rank), tolerance in float64


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 3)).double()


def _global_batch(world_size: int, k: int):
    gen = torch.Generator().manual_seed(1)
    n = world_size * k * MICRO
    return torch.randn(n, 6, generator=gen, dtype=torch.float64), torch.randn(n, 3, generator=gen, dtype=torch.float64)


def _grads(model: nn.Module) -> list:
    grads = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def _accumulate(model, x, y, k: int, *, no_sync: bool, scale: bool = True) -> None:
    """k micro-steps on (x, y); the loss of each divided by k unless scale=False."""
    for j, (xj, yj) in enumerate(zip(x.chunk(k), y.chunk(k))):
        last = j == k - 1
        quiet = model.no_sync() if no_sync and not last else torch.enable_grad()
        with quiet:
            loss = F.mse_loss(model(xj), yj)
            (loss / k if scale else loss).backward()


def _ddp_rank(rank: int, world_size: int, k: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_model(), bucket_cap_mb=0.01)   # small buckets: several per backward
    counter = count_allreduces(model)
    x, y = _global_batch(world_size, k)
    mine = slice(rank * k * MICRO, (rank + 1) * k * MICRO)   # this rank's k micro-batches
    x, y = x[mine], y[mine]
    out = {"param_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}

    F.mse_loss(model(x), y).backward()          # warm-up: DDP rebuilds its buckets after it
    model.zero_grad(set_to_none=True)
    runs = {"one_big_batch": lambda: F.mse_loss(model(x), y).backward(),
            "no_sync": lambda: _accumulate(model, x, y, k, no_sync=True),
            "sync_every_micro_step": lambda: _accumulate(model, x, y, k, no_sync=False),
            "no_sync_unscaled": lambda: _accumulate(model, x, y, k, no_sync=True, scale=False)}
    for name, run in runs.items():
        counter.reset()
        run()
        out[name] = {"calls": counter.calls, "bytes": counter.bytes, "grads": _grads(model)}
    try:
        count_allreduces(model)
    except ValueError as err:
        out["second_hook_error"] = str(err)
    return out


@pytest.mark.launch
@pytest.mark.parametrize("world_size, k", [(2, 4)])
def test_counts_and_gradients_under_ddp(world_size, k):
    ranks = run_ranks(world_size, _ddp_rank, k)
    reference = _model()
    x, y = _global_batch(world_size, k)
    F.mse_loss(reference(x), y).backward()      # one process, the whole global batch
    expected = _grads(reference)

    for rank, out in enumerate(ranks):
        buckets = out["one_big_batch"]["calls"]
        assert buckets >= 2, f"small buckets should give several all-reduces, got {buckets}"
        assert out["one_big_batch"]["bytes"] == out["param_bytes"]
        assert out["no_sync"]["calls"] == buckets, "no_sync: one synchronised backward in k"
        assert out["no_sync"]["bytes"] == out["param_bytes"]
        assert out["sync_every_micro_step"]["calls"] == k * buckets
        assert out["sync_every_micro_step"]["bytes"] == k * out["param_bytes"]
        for name in ("one_big_batch", "no_sync", "sync_every_micro_step"):
            for got, want in zip(out[name]["grads"], expected):
                torch.testing.assert_close(got, want, atol=TOL, rtol=TOL,
                                           msg=lambda m: f"rank {rank}, {name}: {m}")
        for got, want in zip(out["no_sync_unscaled"]["grads"], expected):
            torch.testing.assert_close(got, k * want, atol=TOL, rtol=TOL)   # k times too large
        assert "already has a communication hook (_counting_allreduce)" in out["second_hook_error"]


def test_accumulation_in_one_process_equals_one_big_batch():
    k = 4
    x, y = _global_batch(1, k)
    big, small = _model(), _model()
    F.mse_loss(big(x), y).backward()
    _accumulate(small, x, y, k, no_sync=False)
    for got, want in zip(_grads(small), _grads(big)):
        torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)


def test_counter_reset():
    counter = AllReduceCounter(calls=3, bytes=12)
    counter.reset()
    assert (counter.calls, counter.bytes) == (0, 0)


def test_count_needs_a_ddp_model():
    with pytest.raises(TypeError, match=r"needs a DistributedDataParallel model, got Sequential.*HINT"):
        count_allreduces(_model())


def test_module_is_documented():
    import inspect
    for name in comm.__all__:
        assert "lesson 04" in inspect.getdoc(getattr(comm, name)), name
