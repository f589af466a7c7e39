"""labkit.memory: known tensors give known bytes; the saved-tensor meter counts each storage once."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import labkit
from labkit import memory
from labkit.models import MLPStack, SmallResNet


# -- bytes of tensors and of model state ---------------------------------------------------------
def test_tensor_bytes_of_known_tensors():
    a = torch.zeros(10)                           # 10 × 4 bytes
    b = torch.zeros(3, 4, dtype=torch.float16)    # 12 × 2 bytes
    c = torch.zeros(5, dtype=torch.int64)         # 5 × 8 bytes
    assert memory.tensor_bytes([a, b, c]) == 40 + 24 + 40
    assert memory.tensor_bytes([a, a]) == 40      # one tensor, counted once
    assert memory.tensor_bytes([]) == 0


def test_tensor_bytes_rejects_non_tensors():
    with pytest.raises(TypeError, match=r"got a list.*HINT"):
        memory.tensor_bytes([[1.0, 2.0]])


def test_model_bytes_sgd_momentum():
    model = nn.Linear(10, 5)                      # 55 parameters: 220 bytes in float32
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert memory.model_bytes(model, opt) == memory.ModelBytes(220, 0, 0)  # nothing before a step
    model(torch.randn(2, 10)).sum().backward()
    opt.step()
    held = memory.model_bytes(model, opt)
    assert held == memory.ModelBytes(params=220, grads=220, optimizer=220)  # one momentum buffer
    assert held.total == 660


def test_model_bytes_adam_has_two_moments_and_step_counters():
    model = nn.Linear(10, 5)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 10)).sum().backward()
    opt.step()
    # exp_avg and exp_avg_sq for 55 floats, and a float32 step counter per parameter tensor
    assert memory.model_bytes(model, opt).optimizer == 2 * 220 + 2 * 4
    model.zero_grad(set_to_none=True)
    assert memory.model_bytes(model).grads == 0


def test_model_bytes_counts_the_lesson_model_exactly():
    model = MLPStack(dim=16, depth=2)
    n = sum(p.numel() for p in model.parameters())
    assert memory.model_bytes(model).params == 4 * n


def test_model_bytes_bad_input():
    with pytest.raises(TypeError, match=r"model must be an nn.Module.*HINT"):
        memory.model_bytes([torch.zeros(1)])
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"optimizer must be a torch.optim.Optimizer.*HINT"):
        memory.model_bytes(model, torch.optim.SGD(model.parameters(), lr=1).state_dict())


# -- the saved-tensor meter -------------------------------------------------------------------
def test_meter_counts_what_an_op_saves():
    x = torch.randn(100, requires_grad=True)      # 400 bytes
    with memory.SavedTensorMeter() as meter:
        y = x.sin()                               # sin saves its input for cos(x) in backward
    assert (meter.bytes, meter.storages, meter.packed) == (400, 1, 1)
    y.sum().backward()


class _Wrapper(torch.Tensor):
    """A tensor subclass with no storage of its own, as a functional collective's result is
    (AsyncCollectiveTensor, which lesson 11's sequence parallel saves for backward)."""

    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device)

    def __init__(self, elem):
        self.elem = elem

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t.elem if isinstance(t, _Wrapper) else t  # noqa: E731
        return func(*torch.utils._pytree.tree_map(unwrap, args),
                    **torch.utils._pytree.tree_map(unwrap, kwargs or {}))


def test_meter_counts_a_tensor_without_storage_of_its_own_by_its_size():
    x = torch.ones(3, 4, requires_grad=True)
    w = _Wrapper(torch.full((3, 4), 2.0))         # 48 bytes, and no valid storage to read
    with memory.SavedTensorMeter() as meter:
        y = x * w                                 # mul saves w, for x's gradient
    assert (meter.bytes, meter.storages) == (48, 1)
    y.sum().backward()
    assert torch.equal(x.grad, torch.full((3, 4), 2.0))


def test_meter_counts_a_tensor_saved_twice_once():
    x = torch.randn(100, requires_grad=True)
    with memory.SavedTensorMeter() as meter:
        y = x * x                                 # saves x as both operands
        z = x.exp()                               # and its output (another 400 bytes)
    assert meter.packed == 3
    assert (meter.bytes, meter.storages) == (800, 2)
    (y + z).sum().backward()


def test_meter_counts_a_view_as_its_whole_storage():
    x = torch.randn(100, requires_grad=True)
    with memory.SavedTensorMeter() as meter:
        a = x[10:20].sin()                        # a view of x: x's whole storage stays alive
        b = x[50:60].sin()                        # another view of the same storage
    assert (meter.bytes, meter.storages) == (400, 1)
    (a.sum() + b.sum()).backward()


def test_meter_excludes_parameters_and_buffers():
    model = nn.Linear(10, 5)                      # weight: 200 bytes
    inputs = torch.randn(8, 10, requires_grad=True)  # 320 bytes
    with memory.SavedTensorMeter() as everything:
        model(inputs).sum()                       # saves the input (for the weight's gradient)
    with memory.SavedTensorMeter(exclude=model) as activations:  # and the weight (for the input's)
        out = model(inputs).sum()
    assert everything.bytes == 320 + 200
    assert activations.bytes == 320               # the weight exists anyway: not an activation
    out.backward()


def test_meter_given_a_module_excludes_parameters_made_after_it_started():
    """FSDP2 gathers a sharded weight into a new nn.Parameter for the forward pass: a weight,
    not an activation, though the meter never saw it among the module's parameters."""
    model = nn.Linear(10, 5)
    inputs = torch.randn(8, 10, requires_grad=True)
    with memory.SavedTensorMeter(exclude=model) as meter:
        model.weight = nn.Parameter(torch.randn(5, 10))   # swapped in, as FSDP2 does, after the start
        out = model(inputs).sum()
    assert meter.bytes == 320
    with memory.SavedTensorMeter(exclude=[model.bias]) as tensors_only:   # given tensors, not a module
        model(inputs).sum()
    assert tensors_only.bytes == 320 + 200
    out.backward()


def test_held_bytes_drop_to_zero_after_backward():
    x = torch.randn(1000, requires_grad=True)
    with memory.SavedTensorMeter() as meter:
        loss = (x + 1).sin().exp().sum()          # saves x + 1 and exp's output: 2 × 4000 bytes
    assert meter.held_bytes() == meter.bytes == 8000
    loss.backward()                               # autograd frees what it saved
    assert meter.held_bytes() == 0 and meter.bytes == 8000
    with memory.SavedTensorMeter() as meter:
        loss = x.sin().sum()                      # saves x itself, which we still hold
    loss.backward()
    assert meter.held_bytes() == 4000


def test_a_freed_storage_whose_address_is_reused_counts_again():
    x = torch.randn(1000, requires_grad=True)
    with memory.SavedTensorMeter() as meter:
        for _ in range(3):                        # each loop frees the last graph: the allocator
            loss = (x + 1).sin().sum()            # may hand the same address to the new x + 1
    assert (meter.bytes, meter.storages) == (3 * 4000, 3)   # three graphs, whatever the addresses
    assert meter.held_bytes() == 4000             # only the last one is still alive
    loss.backward()


def test_address_reuse_is_told_apart_from_the_same_storage(monkeypatch):
    """Every storage at one address, as if the allocator reused it: alive = same, freed = new."""
    monkeypatch.setattr(memory.SavedTensorMeter, "_key",
                        staticmethod(lambda t: (("cpu", 1), t.numel() * t.element_size())))
    x = torch.randn(1000, requires_grad=True)
    with memory.SavedTensorMeter() as meter:
        first = (x + 1).sin()                     # saves x + 1 at "address 1"
        also = (x + 2).sin()                      # alive at the same "address": taken as the same
        assert (meter.bytes, meter.storages) == (4000, 1)
        del first, also                           # both graphs freed
        last = (x + 3).sin()                      # a new storage at the old address
    assert (meter.bytes, meter.storages) == (8000, 2)
    assert meter.held_bytes() == 4000
    last.sum().backward()


def test_meter_sees_checkpoint_keep_only_its_input():
    x = torch.randn(1000, requires_grad=True)
    a = x + 1                                     # add saves nothing
    f = lambda t: (t * 2).sin().exp()             # noqa: E731 - saves 2 tensors of 4000 bytes
    with memory.SavedTensorMeter() as plain:
        f(a).sum()
    with memory.SavedTensorMeter() as recomputed:
        out = checkpoint(f, a, use_reentrant=False).sum()
    assert plain.bytes == 8000
    assert recomputed.bytes == 4000               # only the input a, kept for the recomputation
    out.backward()


def test_by_module_attributes_bytes_to_who_saved_first():
    model = SmallResNet(width=4)
    parts = {"stem": model.stem, "blocks": model.blocks, "head": model.head}
    with memory.SavedTensorMeter(exclude=model, modules=parts) as meter:
        loss = model(torch.randn(2, 3, 32, 32)).sum()
    by = meter.by_module
    assert sum(by.values()) == meter.bytes
    assert set(parts) <= set(by) and by["stem"] > 0 and by["blocks"] > by["head"]
    loss.backward()
    out = model(torch.randn(1, 3, 32, 32))        # the hooks are gone after the block
    assert out.shape == (1, 10)


def test_meter_bad_input():
    with pytest.raises(TypeError, match=r"exclude must be an nn.Module or tensors.*HINT"):
        memory.SavedTensorMeter(exclude=["weight"])
    with pytest.raises(TypeError, match=r"modules must be a dict.*HINT"):
        memory.SavedTensorMeter(modules=[nn.Linear(1, 1)])


# -- CUDA ---------------------------------------------------------------------------------------
def test_cuda_peak_is_none_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert memory.cuda_peak_bytes() is None
    memory.reset_cuda_peak()                      # a no-op, not an error


@pytest.mark.gpu
def test_cuda_peak_sees_a_known_allocation():
    device = torch.device("cuda", 0)
    torch.cuda.init()
    memory.reset_cuda_peak(device)
    base = torch.cuda.memory_allocated(device)
    x = torch.empty(2**20, dtype=torch.float32, device=device)  # 4 MiB
    del x
    assert memory.cuda_peak_bytes(device) - base >= 4 * 2**20


def test_is_a_public_submodule():
    assert labkit.memory is memory and "memory" in labkit.__all__
