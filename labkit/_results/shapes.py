"""A model as the cost arithmetic sees it: its parameters' shapes, and how each strategy cuts them.

``labkit/_results/costs.py`` works out what each rank holds and sends from a ``Shapes``, never
from torch: the planner draws it in a notebook without loading torch, and the lessons' checks
build the same ``Shapes`` from the model their script trained::

    Shapes.of(MLPStack(dim=256, depth=4))        # read from a module (its parameters' shapes)
    Shapes.mlp_stack(dim=256, depth=4)           # the same, worked out without torch
    Shapes.count(7_000_000_000, blocks=32)       # a bare parameter count: no shapes to cut

Standard library only.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

#: The MLPStack layers tensor parallelism cuts: fc1 by its outputs (rows), fc2 by its inputs
#: (columns); fc2's bias stays whole (lesson 11).
TP_CUTS = {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1}
_BLOCK = re.compile(r"^blocks\.(\d+)\.")


def chunk(rows: int, parts: int, index: int) -> int:
    """Rows of part ``index`` when ``rows`` are cut into ``parts`` as torch.chunk (and FSDP2) cut them."""
    size = -(-rows // parts)
    return max(0, min(size, rows - index * size))


def padded(rows: int, parts: int) -> int:
    """``rows`` rounded up to a multiple of ``parts``: what a collective of equal shards carries."""
    return -(-rows // parts) * parts


@dataclass(frozen=True)
class Shapes:
    """A model's parameters, in order: each one's shape, and the parts the strategies cut.

    Attributes:
        tensors: ``{name: shape}`` of every parameter, as ``named_parameters()`` lists them.
        value_bytes: bytes per value (4 for float32).
        width: features per sample between two blocks (what tensor parallelism all-reduces and
            a pipeline stage sends), or None when unknown (a bare parameter count).
        tp_cuts: ``{name: dim}`` of the tensors tensor parallelism cuts; empty: it cannot.
        label: what the planner calls the model.

    Example (lessons 06, 11-13)::

        Shapes.of(model).numel()     # the parameter count, as sum(p.numel()) says
    """

    tensors: dict
    value_bytes: int = 4
    width: int | None = None
    tp_cuts: dict | None = None
    label: str = "model"

    # -- made from a module, from MLPStack's arguments, or from a count ----------------------
    @classmethod
    def of(cls, model, *, label: str | None = None) -> "Shapes":
        """Read a module's parameters (an ``MLPStack`` also says its width and TP's cuts)."""
        params = dict(model.named_parameters())
        sizes = {p.element_size() for p in params.values()}
        if len(sizes) != 1:
            raise ValueError(f"the model's parameters mix element sizes {sorted(sizes)} bytes. "
                             f"HINT: cast it to one dtype first (model.float()).")
        blocks = getattr(model, "blocks", None)
        fc1 = getattr(blocks[0], "fc1", None) if blocks is not None and len(blocks) else None
        width = fc1.in_features if fc1 is not None else None
        cuts = {k: d for k in params for suffix, d in TP_CUTS.items() if width and k.endswith(suffix)
                and _BLOCK.match(k)}
        return cls({k: tuple(p.shape) for k, p in params.items()}, sizes.pop(), width, cuts,
                   label or type(model).__name__)

    @classmethod
    def mlp_stack(cls, *, dim: int, depth: int, in_features: int = 3 * 32 * 32, num_classes: int = 10,
                  value_bytes: int = 4) -> "Shapes":
        """``labkit.models.MLPStack(num_classes, dim, depth, in_features)``'s parameters, without torch."""
        for name, value in (("dim", dim), ("depth", depth), ("in_features", in_features),
                            ("num_classes", num_classes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}. "
                                 f"HINT: Shapes.mlp_stack(dim=256, depth=4) is lesson 06's smoke size.")
        tensors = {"stem.1.weight": (dim, in_features), "stem.1.bias": (dim,)}
        for b in range(depth):
            tensors.update({f"blocks.{b}.norm.weight": (dim,), f"blocks.{b}.norm.bias": (dim,),
                            f"blocks.{b}.fc1.weight": (4 * dim, dim), f"blocks.{b}.fc1.bias": (4 * dim,),
                            f"blocks.{b}.fc2.weight": (dim, 4 * dim), f"blocks.{b}.fc2.bias": (dim,)})
        tensors.update({"head.0.weight": (dim,), "head.0.bias": (dim,),
                        "head.1.weight": (num_classes, dim), "head.1.bias": (num_classes,)})
        cuts = {k: d for k in tensors for suffix, d in TP_CUTS.items() if k.endswith(suffix) and _BLOCK.match(k)}
        return cls(tensors, value_bytes, dim, cuts, f"MLPStack(dim={dim}, depth={depth})")

    @classmethod
    def count(cls, parameters: int, *, blocks: int = 1, value_bytes: int = 4) -> "Shapes":
        """A bare parameter count, in ``blocks`` equal blocks: enough for DDP, ZeRO and FSDP; not
        for tensor or pipeline parallelism's traffic, which needs the model's shapes."""
        if isinstance(parameters, bool) or not isinstance(parameters, int) or parameters < blocks:
            raise ValueError(f"parameters must be an int >= blocks ({blocks}), got {parameters!r}. "
                             f"HINT: Shapes.count(7_000_000_000, blocks=32).")
        sizes = [parameters // blocks + (b < parameters % blocks) for b in range(blocks)]
        return cls({f"blocks.{b}.weight": (n,) for b, n in enumerate(sizes)}, value_bytes,
                   label=f"{parameters:,} parameters")

    def with_value_bytes(self, value_bytes: int) -> "Shapes":
        """The same shapes, every value in ``value_bytes`` bytes (2 for bf16)."""
        return Shapes(self.tensors, value_bytes, self.width, self.tp_cuts, self.label)

    # -- what the strategies read --------------------------------------------------------------
    def numel(self, names=None) -> int:
        """Values in the tensors ``names`` (all when None)."""
        return sum(math.prod(s) for k, s in self.tensors.items() if names is None or k in names)

    def bytes(self, names=None) -> int:
        return self.numel(names) * self.value_bytes

    @property
    def depth(self) -> int:
        """How many blocks (``blocks.<i>.`` names)."""
        return len({m[1] for k in self.tensors if (m := _BLOCK.match(k))})

    def block_of(self, name: str) -> int | None:
        match = _BLOCK.match(name)
        return int(match[1]) if match else None

    def root(self) -> list[str]:
        """The tensors outside the blocks: what FSDP's root unit holds (stem and head)."""
        return [k for k in self.tensors if self.block_of(k) is None]

    def units(self) -> list[int]:
        """Values in each unit ZeRO flattens (lesson 13): what comes before the blocks, each
        block, what comes after; empty parts left out."""
        before, after, blocks = 0, 0, {}
        for k, s in self.tensors.items():
            b = self.block_of(k)
            if b is not None:
                blocks[b] = blocks.get(b, 0) + math.prod(s)
            elif blocks:
                after += math.prod(s)
            else:
                before += math.prod(s)
        return [n for n in (before, *(blocks[b] for b in sorted(blocks)), after) if n]

    def tp_cut(self, n: int) -> dict:
        """Each tensor's shape on one rank of a tensor-parallel group of ``n``."""
        out = {}
        for k, s in self.tensors.items():
            s = list(s)
            if k in (self.tp_cuts or {}):
                s[self.tp_cuts[k]] //= n
            out[k] = tuple(s)
        return out

    def stage(self, s: int, stages: int) -> list[str]:
        """The tensors pipeline stage ``s`` of ``stages`` holds: its blocks, and what comes
        before the blocks (first stage) or after them (last)."""
        per, first = self.depth // stages, None
        mine = []
        for k in self.tensors:
            b = self.block_of(k)
            if b is not None:
                first = False
                if s * per <= b < (s + 1) * per:
                    mine.append(k)
            elif (first is None and s == 0) or (first is False and s == stages - 1):
                mine.append(k)
        return mine
