"""The lessons' models, for 32×32 RGB images: a small ResNet-style CNN, and a residual MLP stack.

Lesson 01 shows the CNN; later lessons import it::

    from labkit.models import SmallResNet
    model = SmallResNet(width=32)

``model.blocks`` holds the residual blocks in order: lesson 05 wraps the heavy
ones in activation checkpointing. Lesson 06 shards each block of ``MLPStack``
with ``fully_shard``: its memory is in its parameters, which is what FSDP shards.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["BasicBlock", "SmallResNet", "MLPBlock", "MLPStack", "count_parameters"]


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


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters (elements, not bytes)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
