"""The lessons' model: a small ResNet-style CNN with BatchNorm (or GroupNorm), for 32×32 RGB images.

Lesson 01 shows this code; later lessons import it::

    from labkit.models import SmallResNet
    model = SmallResNet(width=32)

``model.blocks`` holds the residual blocks in order: lesson 05 wraps the heavy
ones in activation checkpointing, lesson 06 shards each with ``fully_shard``.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["BasicBlock", "SmallResNet", "count_parameters"]


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


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters (elements, not bytes)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
