"""The lessons' models: a small ResNet-style CNN and a residual MLP stack for 32×32 RGB images,
and a small causal transformer for token sequences.

Lesson 01 shows the CNN; later lessons import it::

    from labkit.models import SmallResNet
    model = SmallResNet(width=32)

``model.blocks`` holds the residual blocks in order: lesson 05 wraps the heavy
ones in activation checkpointing. Lesson 06 shards each block of ``MLPStack``
with ``fully_shard``: its memory is in its parameters, which is what FSDP shards.
Lesson 14 splits ``CausalLM``'s sequence over ranks (each block's ``attn.attend`` is
replaceable, and every token carries its position) and replaces a block's ``mlp`` by
a mixture of experts.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["BasicBlock", "SmallResNet", "MLPBlock", "MLPStack", "causal_attention", "Attention",
           "FeedForward", "TransformerBlock", "CausalLM", "count_parameters"]


NORMS = ("batch", "group")


def norm_layer(kind: str, channels: int) -> nn.Module:
    """BatchNorm (statistics over the batch) or GroupNorm (over each sample's channel groups).

    GroupNorm makes every sample's output independent of the rest of the batch,
    which lesson 02 uses to prove DDP exact; lesson 03 is about BatchNorm.
    """
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    if kind == "group":
        return nn.GroupNorm(math.gcd(8, channels), channels)
    raise ValueError(f"norm must be one of {NORMS}, got {kind!r}")


class BasicBlock(nn.Module):
    """Two 3×3 convolutions with normalisation and a skip connection (He et al., 2016)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1, norm: str = "batch"):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = norm_layer(norm, out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = norm_layer(norm, out_channels)
        self.shortcut = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            # Match the shape of the skip path when the block changes it.
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                norm_layer(norm, out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class SmallResNet(nn.Module):
    """stem → 3 residual blocks (width, 2·width, 4·width channels) → pooled linear head.

    Args:
        num_classes: outputs of the head (10 for CIFAR-10).
        width: channels of the first block; compute grows with width².
            8 keeps smoke runs on a laptop CPU quick; 32 is a real model.
        norm: "batch" (BatchNorm, the default) or "group" (GroupNorm).
    """

    def __init__(self, num_classes: int = 10, width: int = 32, norm: str = "batch"):
        super().__init__()
        if width < 1:
            raise ValueError(f"width must be >= 1, got {width}")
        if norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, 1, 1, bias=False),
            norm_layer(norm, width),
            nn.ReLU(inplace=True),
        )
        self.blocks = nn.Sequential(
            BasicBlock(width, width, norm=norm),
            BasicBlock(width, 2 * width, stride=2, norm=norm),
            BasicBlock(2 * width, 4 * width, stride=2, norm=norm),
        )
        self.head = nn.Sequential(
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(4 * width, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)))


class MLPBlock(nn.Module):
    """A transformer's feed-forward half: LayerNorm → Linear(d, 4d) → GELU → Linear(4d, d), plus the input."""

    def __init__(self, dim: int, expansion: int = 4):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, expansion * dim)
        self.fc2 = nn.Linear(expansion * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class MLPStack(nn.Module):
    """Flattened image → Linear(3072, dim) → ``depth`` MLPBlocks → LayerNorm → Linear(dim, classes).

    Nearly all its memory is parameters (8·dim² per block), few activations:
    the model for lesson 06, where FSDP shards parameters, gradients and
    optimizer state. dim=256, depth=4 has 2.9 M parameters; dim=1024, depth=8 has 70 M.

    Args:
        num_classes: outputs of the head.
        dim: width of the residual stream.
        depth: number of blocks (``model.blocks``).
        in_features: inputs per sample (3·32·32 for CIFAR-sized images).

    Raises:
        ValueError: ``dim`` or ``depth`` below 1.
    """

    def __init__(self, num_classes: int = 10, dim: int = 256, depth: int = 4,
                 in_features: int = 3 * 32 * 32):
        super().__init__()
        if dim < 1 or depth < 1:
            raise ValueError(f"dim and depth must be >= 1, got dim={dim}, depth={depth}. "
                             f"HINT: MLPStack(dim=256, depth=4) is the smoke-mode size.")
        self.stem = nn.Sequential(nn.Flatten(), nn.Linear(in_features, dim))
        self.blocks = nn.Sequential(*[MLPBlock(dim) for _ in range(depth)])
        self.head = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
    """Plain attention, ``softmax(q kᵀ / √d) v``, each query seeing the keys at positions up to its own.

    It builds the whole score matrix, queries × keys: on one process that is sequence² numbers
    per head, which is what lesson 14 measures and ring attention avoids.

    Args:
        q: queries, (batch, heads, queries, head_dim).
        k, v: keys and values, (batch, heads, keys, head_dim).
        q_positions, k_positions: the position in the sequence of each query and each key
            (1-D int tensors). A query at position i sees the keys at positions ≤ i.

    Returns:
        (batch, heads, queries, head_dim).

    Example (lesson 14)::

        out = causal_attention(q, k, v, positions, positions)   # one process: the whole sequence
    """
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    future = q_positions[:, None] < k_positions[None, :]
    return scores.masked_fill(future, float("-inf")).softmax(dim=-1) @ v


class Attention(nn.Module):
    """Multi-head self-attention: one Linear for queries, keys and values, ``attend``, one Linear out.

    ``attend(q, k, v, q_positions, k_positions)`` does the attention itself; it is
    ``causal_attention`` unless replaced (lesson 14 puts ring attention there).
    """

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.attend = causal_attention

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        qkv = self.qkv(x).view(batch, length, 3, self.heads, dim // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (batch, heads, length, head_dim)
        out = self.attend(q, k, v, positions, positions)
        return self.proj(out.transpose(1, 2).reshape(batch, length, dim))


class FeedForward(nn.Module):
    """Linear(d, 4d) → GELU → Linear(4d, d): what a transformer block does to each token alone."""

    def __init__(self, dim: int, expansion: int = 4):
        super().__init__()
        self.fc1 = nn.Linear(dim, expansion * dim)
        self.fc2 = nn.Linear(expansion * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class TransformerBlock(nn.Module):
    """A pre-norm transformer block: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``.

    Only ``attn`` mixes tokens; the norms and ``mlp`` act on each token alone.
    """

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = FeedForward(dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), positions)
        return x + self.mlp(self.norm2(x))


class CausalLM(nn.Module):
    """A small GPT-style language model: token and position embeddings → ``depth`` blocks → logits.

    Each output predicts the next token from the tokens up to its own position. The positions
    are an argument, so that a rank holding only some of a sequence's tokens (context
    parallelism, lesson 14) gives each its place in the whole sequence. dim=64, depth=2,
    heads=4, a vocabulary of 64 and max_len=1024 make 0.17 M parameters.

    Args:
        vocab: tokens in the vocabulary (``labkit.data.synthetic_tokens`` draws from it).
        dim: width of the residual stream; a multiple of ``heads``.
        depth: transformer blocks (``model.blocks``).
        heads: attention heads per block.
        max_len: the longest sequence the position embedding covers.

    Raises:
        ValueError: a size below 1, or ``dim`` not a multiple of ``heads``.

    Example (lesson 14)::

        model = CausalLM(vocab=64, dim=64, depth=2, heads=4)
        logits = model(tokens)                       # (batch, length, vocab)
        logits = model(tokens[:, 8:16], torch.arange(8, 16))   # a slice, at its own positions
    """

    def __init__(self, vocab: int = 64, dim: int = 64, depth: int = 2, heads: int = 4,
                 max_len: int = 1024):
        super().__init__()
        sizes = {"vocab": vocab, "dim": dim, "depth": depth, "heads": heads, "max_len": max_len}
        if min(sizes.values()) < 1 or dim % heads:
            raise ValueError(f"CausalLM needs sizes >= 1 and dim a multiple of heads, got "
                             f"{', '.join(f'{k}={v}' for k, v in sizes.items())}. "
                             f"HINT: CausalLM(vocab=64, dim=64, depth=2, heads=4) is lesson 14's size.")
        self.max_len = max_len
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList([TransformerBlock(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (batch, length, vocab) for ``tokens`` (batch, length) at ``positions`` (length,;
        default 0 to length − 1)."""
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        if tokens.shape[1] != len(positions) or int(positions.max()) >= self.max_len:
            raise ValueError(f"{tokens.shape[1]} tokens at {len(positions)} positions up to "
                             f"{int(positions.max())}; the model covers positions below {self.max_len}. "
                             f"HINT: one position per token, and CausalLM(max_len=...) above the longest sequence.")
        x = self.embed(tokens) + self.position(positions)
        for block in self.blocks:
            x = block(x, positions)
        return self.head(self.norm(x))


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters (elements, not bytes)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
