"""labkit.models: the lessons' CNN."""

from __future__ import annotations

import pytest
import torch

from labkit.models import SmallResNet, count_parameters


def test_shapes_and_blocks():
    model = SmallResNet(width=8)
    assert model(torch.randn(4, 3, 32, 32)).shape == (4, 10)
    assert len(model.blocks) == 3
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())


def test_width_scales_parameters_about_quadratically():
    small, big = count_parameters(SmallResNet(width=8)), count_parameters(SmallResNet(width=16))
    assert 3.5 < big / small < 4.1


def test_bad_width():
    with pytest.raises(ValueError, match="width must be >= 1"):
        SmallResNet(width=0)


def test_mlp_stack_shapes_blocks_and_size():
    from labkit.models import MLPStack

    model = MLPStack(dim=16, depth=3)
    assert model(torch.randn(4, 3, 32, 32)).shape == (4, 10)
    assert len(model.blocks) == 3
    per_block = 2 * 16 + (16 * 64 + 64) + (64 * 16 + 16)   # LayerNorm, fc1, fc2
    stem, head = 3072 * 16 + 16, 2 * 16 + 16 * 10 + 10
    assert count_parameters(model) == stem + 3 * per_block + head


def test_mlp_stack_bad_size():
    from labkit.models import MLPStack

    with pytest.raises(ValueError, match=r"dim and depth must be >= 1.*HINT"):
        MLPStack(dim=0)
