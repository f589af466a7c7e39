"""labkit.models: the lessons' CNN, MLP stack and small causal transformer."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

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


# -- CausalLM: lesson 14's small transformer --------------------------------------------------------
def test_causal_lm_shapes_and_size():
    from labkit.models import CausalLM

    model = CausalLM(vocab=64, dim=64, depth=2, heads=4, max_len=1024)
    assert model(torch.randint(0, 64, (3, 10))).shape == (3, 10, 64)
    per_block = 2 * 2 * 64 + (64 * 192 + 192) + (64 * 64 + 64) + (64 * 256 + 256) + (256 * 64 + 64)
    embeddings, head = 64 * 64 + 1024 * 64, 2 * 64 + 64 * 64 + 64
    assert count_parameters(model) == embeddings + 2 * per_block + head == 173_888


def test_causal_lm_never_looks_ahead():
    """Changing a token changes no output before its position."""
    from labkit.models import CausalLM

    torch.manual_seed(0)
    model = CausalLM(vocab=16, dim=16, depth=2, heads=2, max_len=32)
    tokens = torch.randint(0, 16, (2, 12))
    changed = tokens.clone()
    changed[:, 7] = (changed[:, 7] + 1) % 16
    a, b = model(tokens), model(changed)
    assert torch.equal(a[:, :7], b[:, :7]) and not torch.allclose(a[:, 7:], b[:, 7:])


def test_a_slice_at_its_own_positions_is_the_start_of_the_whole():
    """The first tokens, given at their positions, compute what the whole sequence computes there:
    causal attention sees nothing later. A later slice alone does not: it misses the keys before it."""
    from labkit.models import CausalLM

    torch.manual_seed(0)
    model = CausalLM(vocab=16, dim=16, depth=2, heads=2, max_len=32)
    tokens = torch.randint(0, 16, (2, 12))
    whole = model(tokens)
    assert torch.allclose(model(tokens[:, :5], torch.arange(5)), whole[:, :5], atol=1e-6)
    assert not torch.allclose(model(tokens[:, 5:], torch.arange(5, 12)), whole[:, 5:], atol=1e-3)


def test_causal_attention_is_torchs_causal_attention():
    from labkit.models import causal_attention

    q, k, v = torch.randn(3, 2, 4, 9, 8, dtype=torch.float64).unbind(0)
    positions = torch.arange(9)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(causal_attention(q, k, v, positions, positions), expected, atol=1e-12)


def test_attention_and_mlp_can_be_replaced():
    """Lesson 14 puts ring attention in attn.attend and a mixture of experts in mlp."""
    from labkit.models import CausalLM, causal_attention

    model = CausalLM(vocab=16, dim=16, depth=1, heads=2, max_len=8)
    calls = []

    def attend(q, k, v, q_positions, k_positions):
        calls.append(q_positions.tolist())
        return causal_attention(q, k, v, q_positions, k_positions)

    model.blocks[0].attn.attend = attend
    model.blocks[0].mlp = torch.nn.Identity()
    model(torch.randint(0, 16, (1, 4)), torch.arange(2, 6))
    assert calls == [[2, 3, 4, 5]]


@pytest.mark.parametrize("kwargs, match", [
    ({"dim": 30, "heads": 4}, r"dim a multiple of heads.*dim=30.*heads=4.*HINT"),
    ({"depth": 0}, r"sizes >= 1.*depth=0"),
])
def test_causal_lm_bad_sizes(kwargs, match):
    from labkit.models import CausalLM

    with pytest.raises(ValueError, match=match):
        CausalLM(**kwargs)


def test_positions_beyond_the_model_are_a_clear_error():
    from labkit.models import CausalLM

    with pytest.raises(ValueError, match=r"positions up to 9; the model covers positions below 8.*HINT"):
        CausalLM(vocab=16, dim=16, depth=1, heads=2, max_len=8)(torch.zeros(1, 10, dtype=torch.long))
