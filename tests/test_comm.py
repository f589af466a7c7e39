"""labkit.comm: the counting hook counts DDP's gradient all-reduces, and changes no gradient.

Also the properties lesson 04 teaches, as tests: k accumulated micro-batches
(loss / k) give the gradient of one batch k times larger, in one process and
under DDP, with and without ``no_sync``; ``no_sync`` makes k micro-steps cost
the all-reduces of one step. Float64, so "the same" means within 1e-12.
"""

from __future__ import annotations

import re

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
        assert re.search(r"lesson (04|11)|lessons 11 and 12", inspect.getdoc(getattr(comm, name))), name


# -- count_collectives: every collective of a step, whatever the strategy (lesson 11) --------------
DIM, DEPTH, BATCH = 16, 2, 4


def _collectives_rank(rank: int, world_size: int, strategy: str) -> dict:
    """One forward and one backward of an MLPStack under ``strategy``, counted two ways: by
    count_collectives, and by PyTorch's own CommDebugMode (names normalised to kinds)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.nn.parallel import DistributedDataParallel as DDP

    from labkit.models import MLPStack

    torch.manual_seed(0)
    model = MLPStack(dim=DIM, depth=DEPTH, in_features=DIM)
    mesh = init_device_mesh("cpu", (world_size,))
    if strategy == "ddp":
        model = DDP(model)
    elif strategy == "fsdp":
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        for block in model.blocks:
            parallelize_module(block, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    x, y = torch.randn(BATCH, DIM), torch.randint(0, 10, (BATCH,))
    out = {}
    with comm.count_collectives() as forward, CommDebugMode() as forward_torch:
        loss = F.cross_entropy(model(x), y)
    with comm.count_collectives() as backward, CommDebugMode() as backward_torch:
        loss.backward()
    for name, ours, theirs in (("forward", forward, forward_torch), ("backward", backward, backward_torch)):
        out[name] = {"calls": ours.calls, "bytes": ours.bytes, "sent": ours.sent_bytes,
                     "sizes": {c.group_size for c in ours.collectives},
                     "torch": {comm._KINDS[op.__name__]: n for op, n in theirs.get_comm_counts().items() if n}}
    return out


@pytest.mark.launch
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "tp"])
def test_count_collectives_counts_what_commdebugmode_counts_and_weighs_it(strategy):
    from labkit.models import MLPStack

    params = sum(p.numel() * 4 for p in MLPStack(dim=DIM, depth=DEPTH, in_features=DIM).parameters())
    activation = BATCH * DIM * 4   # a block's output, all-reduced by tensor parallelism
    expected = {   # what each strategy must do in one step on 2 ranks: calls and full-buffer bytes
        "ddp": ({}, {"all_reduce": (1, params)}),   # one bucket: the model is small
        "fsdp": ({"all_gather": (DEPTH + 1, params)},   # the root and each block, gathered
                 {"all_gather": (DEPTH, params - _root_bytes()),   # the blocks again; the root stays
                  "reduce_scatter": (DEPTH + 1, params)}),
        "tp": ({"all_reduce": (DEPTH, DEPTH * activation)}, {"all_reduce": (DEPTH, DEPTH * activation)}),
    }[strategy]
    for rank, out in enumerate(run_ranks(2, _collectives_rank, strategy)):
        for phase, want in zip(("forward", "backward"), expected):
            got = out[phase]
            assert got["calls"] == {kind: n for kind, (n, _) in want.items()}, (rank, phase, got)
            assert got["bytes"] == {kind: b for kind, (_, b) in want.items()}, (rank, phase, got)
            assert got["torch"] == got["calls"], (rank, phase, got)   # CommDebugMode agrees
            ring = sum(b * (2 if kind == "all_reduce" else 1) / 2 for kind, (_, b) in want.items())
            assert got["sent"] == pytest.approx(ring), (rank, phase, got)
            assert got["sizes"] <= {2}, got


def _root_bytes() -> int:
    """Bytes of the MLPStack's own parameters outside its blocks (stem and head)."""
    from labkit.models import MLPStack

    model = MLPStack(dim=DIM, depth=DEPTH, in_features=DIM)
    return sum(p.numel() * 4 for name, p in model.named_parameters() if not name.startswith("blocks."))


def test_collective_sent_bytes_follow_the_ring_algorithms():
    from labkit.comm import Collective

    assert Collective("all_reduce", 1000, 4).sent_bytes == 1500     # 2 (n-1)/n
    assert Collective("all_gather", 1000, 4).sent_bytes == 750      # (n-1)/n
    assert Collective("reduce_scatter", 1000, 2).sent_bytes == 500
    assert Collective("all_reduce", 1000, 1).sent_bytes == 0        # a group of one sends nothing


def test_count_collectives_outside_any_process_group_counts_nothing():
    with comm.count_collectives() as counted:
        F.mse_loss(_model()(torch.randn(4, 6, dtype=torch.float64)),
                   torch.zeros(4, 3, dtype=torch.float64)).backward()
    assert counted.calls == {} and counted.bytes == {} and counted.sent_bytes == 0


def _send_rank(rank: int, world_size: int) -> dict:
    """Rank 0 sends 10 float32 numbers to rank 1, point to point, as pipeline stages do."""
    import torch.distributed as dist

    tensor = torch.arange(10, dtype=torch.float32) if rank == 0 else torch.zeros(10)
    with comm.count_collectives() as counted:
        if rank == 0:
            dist.send(tensor, dst=1)
        else:
            dist.recv(tensor, src=0)
    return {"calls": counted.calls, "bytes": counted.bytes, "sent": counted.sent_bytes, "got": tensor}


@pytest.mark.launch
def test_count_collectives_counts_a_send_on_the_sending_rank_only():
    sender, receiver = run_ranks(2, _send_rank)
    assert sender["calls"] == {"send": 1} and sender["bytes"] == {"send": 40} and sender["sent"] == 40
    assert receiver["calls"] == {} and receiver["sent"] == 0
    assert torch.equal(receiver["got"], torch.arange(10, dtype=torch.float32))


# -- all-to-all with parts of different sizes, and a ring of sends (lesson 14) ---------------------
def _all_to_all_rank(rank: int, world_size: int) -> dict:
    """Rank r sends r + 1 rows of 2 float32 numbers to every rank (all_to_all_single with split
    sizes, as a mixture of experts dispatches), then a list all-to-all of one number per rank,
    then passes a 3-number tensor to the next rank of a ring with batch_isend_irecv."""
    import torch.distributed as dist

    send = [rank + 1] * world_size
    receive = [source + 1 for source in range(world_size)]
    rows = torch.full((sum(send), 2), float(rank))
    got = torch.empty(sum(receive), 2)
    singles = [torch.full((1,), float(rank)) for _ in range(world_size)]
    with comm.count_collectives() as split:
        dist.all_to_all_single(got, rows, receive, send)
        dist.all_to_all([torch.empty(1) for _ in range(world_size)], singles)
    neighbour = torch.empty(3)
    with comm.count_collectives() as ring:
        mine = torch.full((3,), float(rank))
        requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, (rank + 1) % world_size),
                                           dist.P2POp(dist.irecv, neighbour, (rank - 1) % world_size)])
        for request in requests:
            request.wait()
    return {"split": [(c.kind, c.bytes, c.sent_bytes) for c in split.collectives], "got": got,
            "ring": ring.calls, "ring_sent": ring.sent_bytes, "neighbour": neighbour}


@pytest.mark.launch
def test_count_collectives_weighs_an_uneven_all_to_all_exactly_and_counts_a_ring_of_sends():
    world_size = 3
    for rank, out in enumerate(run_ranks(world_size, _all_to_all_rank)):
        rows_sent = (world_size - 1) * (rank + 1)   # its own part stays on the rank
        received = sum(source + 1 for source in range(world_size))
        assert out["split"] == [("all_to_all", max(3 * (rank + 1), received) * 8, rows_sent * 8),
                                ("all_to_all", world_size * 4, (world_size - 1) * 4)], (rank, out)
        assert out["got"][:, 0].tolist() == [float(s) for s in range(world_size) for _ in range(s + 1)]
        assert out["ring"] == {"send": 1} and out["ring_sent"] == 12, (rank, out)
        assert out["neighbour"].tolist() == [float((rank - 1) % world_size)] * 3


def test_an_all_to_all_without_split_sizes_sends_all_but_its_own_equal_part():
    from labkit.comm import Collective

    assert Collective("all_to_all", 1200, 4).sent_bytes == 900      # (n-1)/n of equal parts
    assert Collective("all_to_all", 1200, 4, sent=100.0).sent_bytes == 100   # exact, when known
