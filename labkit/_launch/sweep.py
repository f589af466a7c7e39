"""labkit.sweep: the same script at several world sizes, repeated, side by side (lesson 02).

Kernel side: each run is a quiet ``launch``; ``Sweep`` reads them back
(``labkit._results`` draws the chart).
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from labkit import _hardware, _rundir
from labkit._errors import LabkitError
from labkit._launch.command import safe_name
from labkit._launch.launch import launch
from labkit._launch.keywords import refuse_keywords, renamed
from labkit._launch.plan import check_nnodes, check_nproc, plan, resolve_device
from labkit._launch.live import duration, in_notebook
from labkit._results.run import Run, new_folder


class Sweep:
    """Runs of one script at several ``nproc``, with repeats.

    Attributes:
        name: the sweep's label.
        runs: every Run, in the order they ran.
        sweep_dir: the folder holding the runs and ``sweep.json``.
        threads_per_rank: OMP_NUM_THREADS of every rank of every run.

    Example (lesson 02)::

        sweep = labkit.sweep("scripts/02_ddp.py", nproc=[1, 2], repeats=3)
        sweep.table(); labkit.plot_speedup(sweep)
        again = labkit.Sweep.load(sweep.sweep_dir)
    """

    def __init__(self, sweep_dir: Path, info: dict, runs: list[Run]):
        self.sweep_dir = Path(sweep_dir)
        self.info = info
        self.runs = runs

    name = property(lambda self: self.info["name"])
    threads_per_rank = property(lambda self: self.info["threads_per_rank"])

    @property
    def caption(self) -> str:
        hw = self.info["hardware"]
        if self.info["device"] == "cuda":
            gpus = hw.get("gpus") or [{}]
            per = f"one {gpus[0].get('name', 'GPU')} per rank, NCCL"
        else:
            per = (f"{self.threads_per_rank} CPU thread(s) per rank (held fixed, so each rank adds "
                   f"cores), gloo, on {hw['cpu_count']} cores")
        nnodes = self.info.get("nnodes", 1)
        nodes = f"; {nnodes} nodes (torchrun agents) on one machine, nproc ranks each" if nnodes > 1 else ""
        return f"{self.info['repeats']} repeat(s) per point; {per}{nodes}."

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Sweep":
        """Reload a sweep from its folder (``sweep.json`` plus one folder per run).

        Raises:
            FileNotFoundError: ``path`` is not a sweep folder (no sweep.json in it).
        """
        info = _rundir.read_info(
            path, _rundir.SWEEP_INFO, kind="sweep",
            hint="pass the folder that labkit.sweep printed (runs/<time>-sweep-<name>); a single "
                 "run loads with labkit.Run.load.")
        return cls(path, info, [Run.load(Path(path, d)) for d in info["runs"]])

    def export(self, folder: str | os.PathLike) -> "Sweep":
        """Copy the sweep (sweep.json and each run's ``Run.export``) to ``folder``, to ship it.

        Raises:
            FileExistsError: ``folder`` exists and is not empty.
        """
        target = new_folder(folder)
        for run in self.runs:
            run.export(target / run.run_dir.name)
        self._save_info(target)
        return Sweep.load(target)

    def _save_info(self, folder: Path) -> None:
        _rundir.write_json(Path(folder, _rundir.SWEEP_INFO), self.info, indent=2)

    def table(self):
        """nproc, samples/s (median, min, max over repeats), speedup and efficiency.

        Speedup is the median samples/s over that of the smallest nproc; efficiency
        is speedup over the ideal (nproc / smallest nproc).
        """
        import pandas as pd

        by_nproc: dict[int, list[float]] = {}
        for run in self.runs:
            by_nproc.setdefault(run.nproc, []).append(run.throughput())
        rows = []
        for nproc in sorted(by_nproc):
            rates = by_nproc[nproc]
            rows.append({"nproc": nproc, "samples_per_s": statistics.median(rates),
                         "samples_per_s_min": min(rates), "samples_per_s_max": max(rates),
                         "repeats": len(rates)})
        table = pd.DataFrame(rows)
        base_n, base_rate = table["nproc"].iloc[0], table["samples_per_s"].iloc[0]
        table["speedup"] = table["samples_per_s"] / base_rate
        table["efficiency"] = table["speedup"] / (table["nproc"] / base_n)
        nnodes = self.info.get("nnodes", 1)
        if nnodes > 1:  # nproc is per node
            table.insert(1, "world_size", table["nproc"] * nnodes)
        return table

    def __repr__(self) -> str:
        nproc = self.info.get("nproc", self.info.get("nprocs"))  # a sweep.json made before the rename
        return f"Sweep({self.name!r}, nproc={nproc}, runs={len(self.runs)}, '{self.sweep_dir}')"


@refuse_keywords(**renamed("sweep", nprocs="nproc", timeout="timeout_s"))
def sweep(script, *, nproc, repeats=3, args=(), device="auto", threads_per_rank=None,
          timeout_s=600, name=None, runs_dir="runs", nnodes=1) -> Sweep:
    """Launch ``script`` at each world size in ``nproc``, ``repeats`` times, for a speedup chart.

    Runs are interleaved (1, 2, 4, 1, 2, 4, ...) so that a slow spell of the
    machine spreads over every point. On CPU, threads per rank stay fixed across
    nproc (default: cores // max(nproc)), so adding a rank adds cores, the way
    adding a GPU adds a device. With ``nnodes`` > 1 every run has that many nodes (torchrun
    agents on this machine, lesson 09) and ``nproc`` are the ranks per node.

    Args:
        script: the script, relative to the notebook's folder.
        nproc: the ranks of each point, a list (``launch`` takes one int under the same name).
        repeats: runs at each point.
        args, device, threads_per_rank, timeout_s, name, runs_dir, nnodes: as for ``launch``
            (``timeout_s`` for each run).

    Returns:
        a Sweep; ``sweep.table()`` and ``labkit.plot_speedup(sweep)`` read it.

    Raises:
        ValueError: an empty ``nproc`` list, a bad or repeated world size, ``repeats < 1``
            (before anything runs).
        LaunchError: a run failed; its ``.sweep`` holds the runs that finished before it.

    Example (lesson 02)::

        sweep = labkit.sweep("scripts/02_ddp.py", nproc=[1, 2], repeats=3, args=["--epochs", "1"])
    """
    kind = resolve_device(device)
    nnodes = check_nnodes(nnodes)
    sizes = _check_sizes(nproc, repeats, kind, nnodes)
    if threads_per_rank is None:
        threads_per_rank = max(1, _hardware.cpu_count() // (max(sizes) * nnodes))
    for n in sizes:  # every argument checked before the first launch
        plan(script, nproc=n, args=args, timeout_s=timeout_s, device=device,
             threads_per_rank=threads_per_rank, nnodes=nnodes)
    name = safe_name(Path(os.fspath(script)).stem if name is None else name, os.fspath(script), 0)
    sweep_dir = _rundir.create(runs_dir, f"sweep-{name}", subfolders=False)
    result = Sweep(sweep_dir, {
        "name": name, "script": os.fspath(script), "args": [str(a) for a in args],
        "nproc": sizes, "nnodes": nnodes, "repeats": repeats, "device": kind,
        "threads_per_rank": threads_per_rank, "hardware": _hardware.describe(), "runs": []}, [])
    progress = _Progress(name, len(sizes) * repeats)
    for repeat in range(repeats):
        for n in sizes:  # interleaved, so that a slow spell of the machine spreads over every point
            label = f"{name}-n{n}-r{repeat + 1}" + (f"-{nnodes}nodes" if nnodes > 1 else "")
            progress.show(f"run {len(result.runs) + 1}/{progress.total} (nproc={n}, repeat {repeat + 1})")
            try:
                run = launch(script, nproc=n, nnodes=nnodes, args=args, device=device,
                             timeout_s=timeout_s, threads_per_rank=threads_per_rank, name=label,
                             runs_dir=sweep_dir, quiet=True)
            except LabkitError as err:
                err.sweep = result  # the runs that did finish stay usable (LabkitError.sweep)
                print(f"sweep {name} stopped at run {len(result.runs) + 1}/{progress.total}; the "
                      f"runs before it are in {sweep_dir} (labkit.Sweep.load reads them)")
                raise
            result.runs.append(run)
            result.info["runs"].append(run.run_dir.name)
            result._save_info(sweep_dir)
            progress.done()
            print(f"nproc={n} repeat {repeat + 1}/{repeats}: {_speed(run)} ({run.wall_s:.1f} s)"
                  f" · run {len(result.runs)}/{progress.total}{progress.left()}")
    progress.show(f"{progress.total} runs done — {sweep_dir}")
    return result


def _check_sizes(nproc, repeats, kind: str, nnodes: int) -> list[int]:
    """The world sizes of a sweep, checked and sorted."""
    if isinstance(nproc, int) or not hasattr(nproc, "__iter__"):
        raise TypeError(f"sweep's nproc must be a list of ints, e.g. nproc=[1, 2], got {nproc!r}. "
                        f"HINT: for one run use labkit.launch(script, nproc={nproc!r}).")
    sizes = list(nproc)
    if not sizes:
        raise ValueError("nproc is empty: a sweep needs at least one world size, e.g. [1, 2]")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    for n in sizes:
        check_nproc(n, kind, nnodes)
    if len(set(sizes)) != len(sizes):
        raise ValueError(f"nproc has duplicates: {sizes}. HINT: name each world size once; "
                         f"repeats={repeats} already runs each of them {repeats} time(s).")
    return sorted(sizes)


def _speed(run: Run) -> str:
    try:
        return f"{run.throughput():,.0f} samples/s"
    except LabkitError as err:  # e.g. too few windows: sweep.table() will say so again
        return f"no throughput ({str(err).splitlines()[0]})"


class _Progress:
    """One line in the notebook that says which run of the sweep is going, and about how long the
    rest will take at the pace of the runs so far (nothing elsewhere: each run prints a line)."""

    def __init__(self, name: str, total: int):
        self.name, self.total, self.handle = name, total, None
        self.started, self.finished = time.monotonic(), 0
        if in_notebook():
            from IPython.display import display
            self.handle = display({"text/plain": f"sweep {name}: starting"}, raw=True, display_id=True)

    def done(self) -> None:
        self.finished += 1

    def left(self) -> str:
        """" · about 2 min left" from the mean time of the runs finished so far ("" before one)."""
        if not self.finished or self.finished >= self.total:
            return ""
        each = (time.monotonic() - self.started) / self.finished
        return f" · about {duration(each * (self.total - self.finished))} left"

    def show(self, text: str) -> None:
        if self.handle is not None:
            self.handle.update({"text/plain": f"sweep {self.name}: {text}{self.left()}"}, raw=True)
