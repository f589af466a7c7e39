"""labkit.bandwidth: what the ranks' links carry, measured as nccl-tests measures it (lesson 07).

A launch of ``labkit/_rank/collectives.py`` times all-reduce, all-gather and reduce-scatter over
message sizes (gloo on CPU ranks, NCCL on GPUs). Two rates come back for each:

- **algorithm bandwidth** (algbw) = size / time, where size is the bytes of the whole tensor:
  the all-reduce's buffer, the all-gather's output, the reduce-scatter's input (nccl-tests'
  convention);
- **bus bandwidth** (busbw) = algbw x 2(n-1)/n for all-reduce, x (n-1)/n for all-gather and
  reduce-scatter: the rate each rank's link runs at in a ring, comparable across world sizes
  and with the hardware's link speed.

Predictions come from the alpha-beta model of a ring, fitted to the measured all-reduce:
``time = f(W) x (W x alpha + B / busbw)`` with f the bus factor above, so an all-reduce makes
2(W-1) steps of latency alpha and moves 2(W-1)/W x B bytes through each link. It holds where
the bigger world has the same links (one box, one fabric) and runs a ring; see ``AlphaBeta``
(``ring.py``).
Kernel side: pandas, numpy and matplotlib load inside the functions that draw or fit.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from pathlib import Path

from labkit._diagnose.ring import OPS, AlphaBeta, _positive_int, bus_factor, fit_alpha_beta, format_bytes

_SCRIPT = Path(__file__).resolve().parents[1] / "_rank" / "collectives.py"


def default_sizes(device: str, smoke: bool) -> list[int]:
    """1 KiB up to 1 MiB (smoke), 64 MiB (CPU ranks) or 1 GiB (GPUs), each 4 times the last."""
    top = 20 if smoke else (30 if device == "cuda" else 26)
    return [2**p for p in range(10, top + 1, 2)]


@dataclass
class Bandwidth:
    """What ``labkit.bandwidth`` measured: one row per collective and size.

    Attributes:
        run: the launch that measured it (``run.output(0)`` prints nccl-tests' table).
        world_size, device, backend: where it was measured.

    Example (lesson 07)::

        bw = labkit.bandwidth(nproc=2, device=DEVICE)
        bw.table()                                  # op, size, time, algbw and busbw in GB/s
        bw.plot()                                   # busbw over sizes, log scale
        bw.predict_s(25 * 2**20, world_size=4)      # a 25 MiB all-reduce on 4 ranks, in seconds
    """

    run: object
    world_size: int
    device: str
    backend: str

    def table(self):
        """A DataFrame: ``op``, ``size_bytes``, ``size``, ``time_us`` (median), ``algbw_GBps``,
        ``busbw_GBps``, ``time_min_us``, ``time_max_us``, ``iters``."""
        df = self.run.metrics()
        df = df[(df["rank"] == 0) & df["op"].notna()].copy()
        df["size"] = df["size_bytes"].map(format_bytes)
        df["algbw_GBps"] = df["size_bytes"] / df["time_s"] / 1e9
        df["busbw_GBps"] = df["algbw_GBps"] * df["op"].map(lambda op: bus_factor(op, self.world_size))
        for column in ("time", "time_min", "time_max"):
            df[f"{column}_us"] = df[f"{column}_s"] * 1e6
        columns = ["op", "size_bytes", "size", "time_us", "algbw_GBps", "busbw_GBps",
                   "time_min_us", "time_max_us", "iters"]
        return df[columns].astype({"size_bytes": int, "iters": int}).reset_index(drop=True)

    def fit(self, op: str = "all_reduce", *, leave_out=(), stat: str = "median") -> AlphaBeta:
        """The alpha-beta model of ``op`` fitted to this measurement (see ``AlphaBeta``).

        Args:
            op: which collective.
            leave_out: sizes (bytes, as asked for) the fit must not see, to test it on them. A
                size is matched to the one measured, which is rounded down to whole float32
                elements per rank.
            stat: "median" (nccl-tests' habit) or "min": the fastest timed call of each size,
                what the link does when nothing else gets in the way (on CPU ranks that share
                cores, the median may hold a rank that the system paused for a tick).

        Example (lesson 07)::

            ring = bw.fit(leave_out=[GRAD_BYTES], stat="min")
            ring.time_s(GRAD_BYTES)     # a size the fit did not see: compare with bw.table()
        """
        if stat not in ("median", "min"):
            raise ValueError(f"stat must be 'median' or 'min', got {stat!r}. HINT: stat='min' on "
                             f"CPU ranks that share cores.")
        rows = self._rows(op)
        rows = rows.drop(index=self._matched(rows, leave_out, op))
        column = "time_us" if stat == "median" else "time_min_us"
        return fit_alpha_beta(op, self.world_size, rows["size_bytes"], rows[column] / 1e6)

    def rows_of(self, sizes, op: str = "all_reduce"):
        """The rows of ``table()`` measured for ``sizes`` (bytes, as asked for: each matched to
        the size measured, rounded down to whole float32 elements per rank)."""
        rows = self._rows(op)
        return rows.loc[self._matched(rows, sizes, op)]

    def _rows(self, op: str):
        rows = self.table()
        return rows[rows["op"] == _check_op(op, set(rows["op"]))]

    def _matched(self, rows, sizes, op: str) -> list:
        """The index of the row measured for each of ``sizes`` (none: an empty list)."""
        found = []
        for size in _check_sizes(sizes) if list(sizes) else []:
            match = rows[(rows["size_bytes"] <= size) & (rows["size_bytes"] > size - 4 * self.world_size)]
            if match.empty:
                raise ValueError(f"{format_bytes(size)} ({size:,} bytes) was not measured for {op}; "
                                 f"measured: {', '.join(map(format_bytes, rows['size_bytes']))}. HINT: "
                                 f"pass it in labkit.bandwidth(sizes=[...]).")
            found.append(match.index[0])
        return found

    def predict_s(self, nbytes: float, world_size: int | None = None, op: str = "all_reduce") -> float:
        """Seconds for one ``op`` of ``nbytes`` on ``world_size`` ranks, from the fitted
        alpha-beta model (``fit(op).time_s``; its docstring says where it holds)."""
        return self.fit(op).time_s(nbytes, world_size)

    def plot(self, *, y: str = "busbw_GBps", ax=None, title: str | None = None):
        """Bandwidth over message sizes (log scale), one line per collective; returns the Axes."""
        import matplotlib.pyplot as plt

        if y not in ("busbw_GBps", "algbw_GBps"):
            raise ValueError(f"y must be 'busbw_GBps' or 'algbw_GBps', got {y!r}")
        if ax is None:
            _, ax = plt.subplots(figsize=(7, 4))
        table = self.table()
        for op, rows in table.groupby("op", sort=False):
            ax.plot(rows["size_bytes"], rows[y], marker="o", label=op)
        ax.set_xscale("log", base=2)
        sizes = table["size_bytes"].unique()
        ax.set_xticks(sizes, _tick_labels(sizes), rotation=45, fontsize=8)
        ax.set_xlabel("message size (the whole tensor)")
        ax.set_ylabel(("bus" if y.startswith("bus") else "algorithm") + " bandwidth (GB/s)")
        ax.set_title(title or f"{self.world_size} ranks, {self.backend} on {self.device.upper()}")
        ax.grid(alpha=0.3)
        ax.legend()
        return ax

    def __repr__(self) -> str:
        return f"<Bandwidth: {self.world_size} ranks, {self.backend} on {self.device}; {self.run.run_dir}>"


def _tick_labels(sizes, min_octaves: float = 0.6) -> list[str]:
    """A label for each size on a log2 axis, leaving out those that would overlap a neighbour:
    a size off the powers of two (one asked for by name, like a model's gradients) keeps its label
    over a power of two beside it."""
    logs = [math.log2(s) for s in sizes]
    odd = [abs(x - round(x)) > 0.05 for x in logs]
    kept: list[int] = []
    for i in sorted(range(len(sizes)), key=lambda i: (not odd[i], i)):
        if all(abs(logs[i] - logs[j]) >= min_octaves for j in kept):
            kept.append(i)
    return [format_bytes(s) if i in kept else "" for i, s in enumerate(sizes)]


def _check_op(op, known=OPS) -> str:
    if op not in known:
        close = difflib.get_close_matches(str(op), list(known), n=1)
        raise ValueError(f"unknown collective {op!r}. HINT: "
                         + (f"did you mean {close[0]!r}? " if close else "")
                         + f"one of {', '.join(sorted(known))}.")
    return op


def _check_sizes(sizes) -> list[int]:
    if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__"):
        raise TypeError(f"sizes must be a list of byte counts, got {sizes!r}. "
                        f"HINT: e.g. sizes=[2**k for k in range(10, 21, 2)].")
    sizes = list(sizes)
    bad = [s for s in sizes if isinstance(s, bool) or not isinstance(s, int) or s < 1]
    if not sizes or bad:
        raise ValueError(f"sizes must hold whole numbers of bytes >= 1, got {sizes!r}. "
                         f"HINT: e.g. sizes=[2**k for k in range(10, 21, 2)] (1 KiB to 1 MiB).")
    return sorted(set(sizes))


def bandwidth(nproc=None, *, device="auto", sizes=None, ops=OPS, warmup=None, iters=None,
              timeout_s=300, name=None, runs_dir="runs", quiet=False) -> Bandwidth:
    """Measure all-reduce, all-gather and reduce-scatter bandwidth over message sizes.

    One launch (``labkit.launch``: its output, errors and run folder are the usual ones) of
    ``labkit/_rank/collectives.py``: for each op and size, ``warmup`` calls left out, then
    ``iters`` calls timed one by one (started together, timed to their end on the device);
    the median of the slowest rank's times is kept. Sizes are nccl-tests' (the whole tensor).

    Args:
        nproc: ranks (default: what ``labkit.launch`` picks: every GPU, else 2 CPU ranks).
        device: "auto" (GPUs and NCCL when there are any) or "cpu" (gloo).
        sizes: bytes of each message (default: 1 KiB to 1 MiB in smoke mode, to 64 MiB on CPU
            ranks, to 1 GiB on GPUs; each 4 times the last).
        ops: which of "all_reduce", "all_gather", "reduce_scatter".
        warmup, iters: calls left out, calls timed (default 2 and 20 in smoke mode, else 5 and 20).
        timeout_s, name, runs_dir, quiet: as for ``labkit.launch``.

    Returns:
        a Bandwidth: ``.table()``, ``.plot()``, ``.fit()`` (the alpha-beta model) and
        ``.predict_s(nbytes, world_size)``.

    Raises:
        ValueError, TypeError: bad sizes, ops, warmup or iters (or what launch refuses), before
            anything runs.
        LaunchError, LaunchTimeout: as for ``labkit.launch``.

    Example (lesson 07)::

        bw = labkit.bandwidth(nproc=2, device=DEVICE)
        bw.plot()
        print(f"a 25 MiB all-reduce on 4 ranks: {bw.predict_s(25 * 2**20, world_size=4) * 1e3:.1f} ms")
    """
    from labkit import _hardware
    from labkit._launch.launch import launch
    from labkit._launch.plan import resolve_device

    smoke = _hardware.is_smoke()
    ops = [_check_op(op) for op in ([ops] if isinstance(ops, str) else list(ops))]
    if not ops:
        raise ValueError(f"ops is empty. HINT: e.g. ops=['all_reduce'], or leave it out for {OPS}.")
    sizes = default_sizes(resolve_device(device), smoke) if sizes is None else _check_sizes(sizes)
    warmup = (2 if smoke else 5) if warmup is None else warmup
    iters = 20 if iters is None else _positive_int("iters", iters)
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}. HINT: e.g. warmup=5.")
    args = ["--sizes", ",".join(map(str, sizes)), "--ops", ",".join(dict.fromkeys(ops)),
            "--warmup", str(warmup), "--iters", str(iters)]
    run = launch(_SCRIPT, nproc=nproc, device=device, args=args, timeout_s=timeout_s,
                 name=name or "bandwidth", runs_dir=runs_dir, quiet=quiet)
    return Bandwidth(run, world_size=run.info["world_size"], device=run.info["device"],
                     backend=run.info["backend"])
