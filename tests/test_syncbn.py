"""labkit.syncbn: synchronised BatchNorm over W gloo ranks equals BatchNorm on the whole batch.

The property, for W = 1, 2, 3: rank r holds slice r of a global batch; each
rank runs SyncBatchNorm on its slice, then backward with its slice of a fixed
upstream gradient. Then, against ``nn.BatchNorm*d`` on the whole batch in one
process:
- each rank's output and input gradient are that rank's slice of BatchNorm's;
- the ranks' weight and bias gradients add up to BatchNorm's (each rank holds
  its share; DDP's all-reduce adds them);
- after several steps the running statistics (unbiased variance) and
  ``num_batches_tracked`` are BatchNorm's, on every rank;
- in eval() mode the output is BatchNorm's eval output.
Tolerances: 1e-10 in float64 (the maths is the same), 2e-5 in float32 (the
sums are added in another order; E[x²]−E[x]² loses a few more bits).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from _ranks import run_ranks
from labkit import syncbn
from labkit.syncbn import SyncBatchNorm, all_reduce_sum, convert_sync_batchnorm

CHANNELS, STEPS = 3, 3
TOLERANCE = {"float64": 1e-10, "float32": 2e-5}
BATCHNORM = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}


def _case_data(case: dict):
    """The global batches, upstream gradients and eval batch of a case (same on every rank)."""
    dtype = getattr(torch, case["dtype"])
    gen = torch.Generator().manual_seed(case.get("seed", 0))
    shape = (sum(case["sizes"]), CHANNELS, *case["tail"])
    batches = [(torch.randn(shape, generator=gen, dtype=dtype) * 2 + 0.5,
                torch.randn(shape, generator=gen, dtype=dtype)) for _ in range(STEPS)]
    weight = torch.rand(CHANNELS, generator=gen, dtype=dtype) + 0.5
    bias = torch.randn(CHANNELS, generator=gen, dtype=dtype)
    eval_x = torch.randn(shape, generator=gen, dtype=dtype)
    return batches, weight, bias, eval_x


def _run(layer, case: dict, rows: slice, device: str = "cpu") -> dict:
    """Train ``layer`` for STEPS steps on ``rows`` of each global batch, then evaluate.

    Returns every output and gradient, and the buffers, on the CPU.
    """
    batches, weight, bias, eval_x = _case_data(case)
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
    steps = []
    for x, grad in batches:
        x = x[rows].to(device).requires_grad_()
        y = layer(x)
        y.backward(grad[rows].to(device))
        steps.append({"y": y.detach().cpu(), "dx": x.grad.cpu(), "dw": layer.weight.grad.cpu(),
                      "db": layer.bias.grad.cpu()})
        layer.weight.grad = layer.bias.grad = None
    layer.eval()
    with torch.no_grad():
        eval_y = layer(eval_x[rows].to(device)).cpu()
    return {"steps": steps, "eval_y": eval_y, "running_mean": layer.running_mean.cpu(),
            "running_var": layer.running_var.cpu(),
            "num_batches_tracked": int(layer.num_batches_tracked)}


def _synced(rank: int, world_size: int, cases: list) -> list:
    results = []
    for case in cases:
        assert len(case["sizes"]) == world_size
        start = sum(case["sizes"][:rank])
        layer = SyncBatchNorm(CHANNELS, momentum=case["momentum"]).to(getattr(torch, case["dtype"]))
        before = syncbn.allreduce_counts()
        result = _run(layer, case, slice(start, start + case["sizes"][rank]))
        after = syncbn.allreduce_counts()
        result["allreduces"] = {k: after[k] - before[k] for k in after}
        results.append(result)
    return results


def _reference(case: dict) -> dict:
    layer = BATCHNORM[2 + len(case["tail"])](CHANNELS, momentum=case["momentum"])
    return _run(layer.to(getattr(torch, case["dtype"])), case, slice(None))


def _assert_matches(ranks: list, ref: dict, case: dict, tol: float | None = None) -> None:
    tol = TOLERANCE[case["dtype"]] if tol is None else tol
    close = lambda a, b, what: torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=lambda m: f"{case}: {what}: {m}")
    bounds = [0]
    for size in case["sizes"]:
        bounds.append(bounds[-1] + size)
    for step, ref_step in enumerate(ref["steps"]):
        for rank, result in enumerate(ranks):
            rows = slice(bounds[rank], bounds[rank + 1])
            mine = result["steps"][step]
            close(mine["y"], ref_step["y"][rows], f"step {step} rank {rank} output")
            close(mine["dx"], ref_step["dx"][rows], f"step {step} rank {rank} input gradient")
        for name in ("dw", "db"):
            total = sum(result["steps"][step][name] for result in ranks)
            close(total, ref_step[name], f"step {step} {name}, summed over ranks")
    for rank, result in enumerate(ranks):
        rows = slice(bounds[rank], bounds[rank + 1])
        close(result["running_mean"], ref["running_mean"], f"rank {rank} running_mean")
        close(result["running_var"], ref["running_var"], f"rank {rank} running_var (unbiased)")
        assert result["num_batches_tracked"] == ref["num_batches_tracked"] == STEPS
        close(result["eval_y"], ref["eval_y"][rows], f"rank {rank} eval() output")


def _cases(world_size: int) -> list:
    even = [4] * world_size
    return [
        {"sizes": even, "tail": (5, 5), "dtype": "float64", "momentum": 0.1},
        {"sizes": even, "tail": (5, 5), "dtype": "float32", "momentum": 0.1},
        {"sizes": even, "tail": (), "dtype": "float64", "momentum": None},      # (N, C), cumulative
        {"sizes": even, "tail": (2, 3, 3), "dtype": "float32", "momentum": 0.3},  # 3d
        {"sizes": [2 + rank for rank in range(world_size)], "tail": (7,), "dtype": "float64",
         "momentum": 0.1},                                                       # uneven slices
    ]


@pytest.mark.launch
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_synced_over_ranks_equals_batchnorm_on_the_whole_batch(world_size):
    cases = _cases(world_size)
    ranks = run_ranks(world_size, _synced, cases)
    for i, case in enumerate(cases):
        _assert_matches([result[i] for result in ranks], _reference(case), case)
        # One all-reduce per training forward and one per backward; eval() and a world of
        # one communicate nothing.
        expected = STEPS if world_size > 1 else 0
        for result in ranks:
            assert result[i]["allreduces"] == {"forward": expected, "backward": expected}


@pytest.mark.launch
def test_per_rank_batchnorm_is_not_the_same():
    """The test can fail: plain BatchNorm on each slice misses the whole batch's output."""
    case = _cases(2)[0]

    def per_rank(rows):
        return _run(nn.BatchNorm2d(CHANNELS).double(), case, rows)

    ref = _reference(case)
    local = per_rank(slice(0, 4))["steps"][0]["y"]
    assert (local - ref["steps"][0]["y"][:4]).abs().max() > 1e-2


# -- one process, no process group: plain BatchNorm -----------------------------------------
def test_without_a_process_group_it_is_batchnorm():
    case = {"sizes": [6], "tail": (4, 4), "dtype": "float64", "momentum": 0.1}
    _assert_matches([_run(SyncBatchNorm(CHANNELS).double(), case, slice(None))], _reference(case), case)


def test_convert_keeps_parameters_buffers_settings_and_mode():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, eps=1e-3, momentum=0.2),
                          nn.Sequential(nn.BatchNorm1d(4, affine=False)))
    bn = model[1]
    bn.running_mean.fill_(0.5)
    bn.num_batches_tracked.fill_(7)
    model[2][0].eval()
    weight, state = bn.weight, {k: v.clone() for k, v in model.state_dict().items()}
    converted = convert_sync_batchnorm(model)
    assert converted is model
    new = model[1]
    assert type(new) is SyncBatchNorm and type(model[2][0]) is SyncBatchNorm
    assert new.weight is weight, "the same Parameter: an optimizer made earlier still sees it"
    assert (new.eps, new.momentum, new.affine, new.track_running_stats) == (1e-3, 0.2, True, True)
    assert model[2][0].affine is False and model[2][0].weight is None
    assert new.training and not model[2][0].training
    assert isinstance(model[0], nn.Conv2d)
    assert model.state_dict().keys() == state.keys(), "state_dicts stay interchangeable"
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key


def test_convert_a_single_layer_returns_the_new_layer():
    layer = convert_sync_batchnorm(nn.BatchNorm3d(5))
    assert isinstance(layer, SyncBatchNorm) and layer.num_features == 5


def test_eval_mode_uses_running_statistics():
    layer = SyncBatchNorm(2)
    layer.running_mean.copy_(torch.tensor([1.0, -1.0]))
    layer.running_var.copy_(torch.tensor([4.0, 0.25]))
    layer.eval()
    x = torch.randn(3, 2, 4)
    expected = (x - layer.running_mean.view(1, 2, 1)) / torch.sqrt(layer.running_var.view(1, 2, 1) + layer.eps)
    torch.testing.assert_close(layer(x), expected)
    assert int(layer.num_batches_tracked) == 0, "eval() does not count batches"


# -- bad input, with a hint -----------------------------------------------------------------
def test_convert_rejects_what_is_not_a_module():
    with pytest.raises(TypeError, match=r"needs an nn.Module, got dict.*HINT"):
        convert_sync_batchnorm({"bn": nn.BatchNorm2d(3)})


def test_convert_after_ddp_is_refused():
    wrapped = nn.parallel.DistributedDataParallel.__new__(nn.parallel.DistributedDataParallel)
    with pytest.raises(ValueError, match=r"already wrapped in DistributedDataParallel.*HINT: convert first"):
        convert_sync_batchnorm(wrapped)


def test_convert_refuses_an_uninitialised_lazy_batchnorm():
    with pytest.raises(ValueError, match=r"LazyBatchNorm2d does not know its size yet.*HINT"):
        convert_sync_batchnorm(nn.Sequential(nn.LazyBatchNorm2d()))


@pytest.mark.parametrize("shape", [(4,), (2, 5, 3)])
def test_wrong_input_shape(shape):
    with pytest.raises(ValueError, match=r"SyncBatchNorm\(3\) expects input \(N, 3, ...\).*HINT"):
        SyncBatchNorm(3)(torch.randn(shape))


def test_all_reduce_sum_needs_a_process_group():
    with pytest.raises(RuntimeError, match="needs a process group. HINT"):
        all_reduce_sum(torch.ones(2))


def test_module_is_small_and_documented():
    import inspect
    source = inspect.getsource(syncbn)
    assert len(source.splitlines()) < 300
    for name in syncbn.__all__:
        doc = inspect.getdoc(getattr(syncbn, name))
        assert doc and "lesson 03" in doc, name


# -- GPU: PyTorch's nn.SyncBatchNorm and ours agree ------------------------------------------
GPU_TOLERANCE = {"float64": 1e-10, "float32": 1e-4}   # CUDA kernels add in their own order


def _both_on_gpu(rank: int, world_size: int, cases: list) -> list:
    results = []
    for case in cases:
        start = sum(case["sizes"][:rank])
        rows = slice(start, start + case["sizes"][rank])
        dtype = getattr(torch, case["dtype"])
        per_kind = {}
        for kind, cls in (("nn.SyncBatchNorm", nn.SyncBatchNorm), ("labkit", SyncBatchNorm)):
            layer = cls(CHANNELS, momentum=case["momentum"]).to(f"cuda:{rank}", dtype)
            per_kind[kind] = _run(layer, case, rows, device=f"cuda:{rank}")
        results.append(per_kind)
    return results


@pytest.mark.gpu
def test_agrees_with_torch_syncbatchnorm_on_gpus():
    """On 2 GPUs with NCCL, nn.SyncBatchNorm and labkit's both equal BatchNorm on the whole batch."""
    from labkit import _hardware
    if _hardware.gpu_count() < 2:
        pytest.skip(f"needs 2 GPUs for nn.SyncBatchNorm over NCCL; {_hardware.gpu_count()} visible")
    cases = [c for c in _cases(2) if c["tail"] == (5, 5)]
    ranks = run_ranks(2, _both_on_gpu, cases, backend="nccl")
    for i, case in enumerate(cases):
        ref = _reference(case)
        for kind in ("nn.SyncBatchNorm", "labkit"):
            _assert_matches([r[i][kind] for r in ranks], ref, dict(case, kind=kind),
                            tol=GPU_TOLERANCE[case["dtype"]])
