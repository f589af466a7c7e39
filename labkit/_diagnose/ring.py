"""The alpha-beta model of a ring collective: bus factors, sizes said in binary units, and the
fit of measured times (``labkit.bandwidth`` measures them; lesson 07 predicts bigger worlds with it).

Standard library at import (numpy loads inside the fit): ``labkit/_rank/collectives.py``, which
runs on the ranks, imports ``bus_factor`` and ``format_bytes`` from here.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

OPS = ("all_reduce", "all_gather", "reduce_scatter")  # what labkit.bandwidth measures


def bus_factor(op: str, world_size: int) -> float:
    """busbw / algbw for ``op`` on ``world_size`` ranks (nccl-tests): 2(n-1)/n or (n-1)/n."""
    share = (world_size - 1) / world_size
    return 2 * share if op == "all_reduce" else share


def format_bytes(nbytes: float) -> str:
    """'64 KiB', '1 MiB', '512 B': a message size as the tables and the chart say it."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.4g} {unit}"
    return f"{nbytes:.4g} B"


@dataclass(frozen=True)
class AlphaBeta:
    """The alpha-beta model of a ring collective, fitted to measured times at one world size.

    ``time_s(B, W) = f(W) * (W * latency_s + B / (busbw_GBps * 1e9))``, f = ``bus_factor``:
    a ring all-reduce takes 2(W-1) steps of ``latency_s`` each and sends 2(W-1)/W x B bytes
    through every link at ``busbw_GBps``.

    Limits: it assumes the bigger world has links as fast as the measured one (true inside one
    box or one fabric; across nodes the slowest link sets busbw), and a ring (NCCL may choose a
    tree or NVLS for some sizes and worlds, with a latency that grows as log W); CPU ranks that
    share cores slow each other, which it does not know. ``max_error`` says how well it fits the
    sizes it was fitted to; outside them it extrapolates.

    Example (lesson 07)::

        model = labkit.bandwidth(nproc=2).fit()
        model.time_s(25 * 2**20, world_size=4)     # a 25 MiB all-reduce on 4 ranks, in seconds
    """

    op: str
    world_size: int
    latency_s: float
    busbw_GBps: float
    max_error: float

    def time_s(self, nbytes: float, world_size: int | None = None) -> float:
        """Predicted seconds for one ``op`` of ``nbytes`` on ``world_size`` ranks (default: the
        measured world). 0 on one rank: nothing to send."""
        world = self.world_size if world_size is None else _positive_int("world_size", world_size)
        if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Real) or nbytes < 0 \
                or not math.isfinite(nbytes):
            raise ValueError(f"nbytes must be a number of bytes >= 0, got {nbytes!r}. "
                             f"HINT: e.g. labkit.allreduce_bytes(...) of a lesson run, or 25 * 2**20.")
        return bus_factor(self.op, world) * (world * self.latency_s + nbytes / (self.busbw_GBps * 1e9))

    def __str__(self) -> str:
        return (f"{self.op} on {self.world_size} ranks: {self.latency_s * 1e6:.1f} us a ring hop, "
                f"busbw {self.busbw_GBps:.3g} GB/s (fits the measured sizes within "
                f"{self.max_error:.0%})")


def fit_alpha_beta(op: str, world_size: int, sizes, seconds) -> AlphaBeta:
    """Least squares of ``time = a + b x size`` in relative error (small and large sizes count
    alike), a >= 0, turned into the ring's latency per step and its bus bandwidth."""
    import numpy as np

    size, time = np.asarray(sizes, float), np.asarray(seconds, float)
    weight = 1 / time**2
    design = np.stack([np.ones_like(size), size], axis=1) * np.sqrt(weight)[:, None]
    (a, b), *_ = np.linalg.lstsq(design, time * np.sqrt(weight), rcond=None)
    if a < 0:  # no latency below zero: the line through the origin instead
        a, b = 0.0, float((weight * size * time).sum() / (weight * size * size).sum())
    if b <= 0 or world_size < 2:
        raise ValueError(
            f"cannot fit the {op} times on {world_size} rank(s): they do not grow with the size "
            f"({', '.join(format_bytes(s) for s in size)}). HINT: measure on 2 ranks or more, "
            f"with sizes up to a few MiB, e.g. labkit.bandwidth(nproc=2, sizes=[2**k for k in "
            f"range(10, 24, 2)]).")
    factor = bus_factor(op, world_size)
    error = float(np.max(np.abs(a + b * size - time) / time))
    return AlphaBeta(op, world_size, latency_s=float(a) / (factor * world_size),
                     busbw_GBps=factor / float(b) / 1e9, max_error=error)


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}. HINT: e.g. {name}=4.")
    return value
