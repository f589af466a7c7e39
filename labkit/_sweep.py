"""labkit.sweep: the same script at several world sizes, repeated, side by side."""

from __future__ import annotations

import os
import statistics
from pathlib import Path

from labkit import _hardware, _rundir
from labkit._errors import LabkitError
from labkit._launch import launch, safe_name
from labkit._plan import check_nnodes, check_nproc, plan, refuse_keywords, resolve_device
from labkit._live import in_notebook
from labkit._run import Run, new_folder


class Sweep:
    """Runs of one script at several ``nproc``, with repeats.

    Attributes:
        name: the sweep's label.
        runs: every Run, in the order they ran.
        sweep_dir: the folder holding the runs and ``sweep.json``.
        threads_per_rank: OMP_NUM_THREADS of every rank of every run.
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
        return f"Sweep({self.name!r}, nprocs={self.info['nprocs']}, runs={len(self.runs)}, '{self.sweep_dir}')"


@refuse_keywords(nproc="sweep() takes nprocs=[...], the world sizes to compare, e.g. nprocs=[1, 2]; "
                       "for one run use labkit.launch(script, nproc=2).")
def sweep(script, *, nprocs, repeats=3, args=(), device="auto", threads_per_rank=None,
          timeout=600, name=None, runs_dir="runs", nnodes=1) -> Sweep:
    """Launch ``script`` at each nproc in ``nprocs``, ``repeats`` times, for a speedup chart.

    Runs are interleaved (1, 2, 4, 1, 2, 4, ...) so that a slow spell of the
    machine spreads over every point. On CPU, threads per rank stay fixed across
    nproc (default: cores // max(nprocs)), so adding a rank adds cores, the way
    adding a GPU adds a device. With ``nnodes`` > 1 every run has that many nodes (torchrun
    agents on this machine, lesson 08) and ``nprocs`` are the ranks per node.

    Returns:
        a Sweep; ``sweep.table()`` and ``labkit.plot_speedup(sweep)`` read it.

    Raises:
        ValueError: empty ``nprocs``, a bad or repeated nproc, ``repeats < 1`` (before anything
            runs).
        LaunchError: a run failed; its ``.sweep`` holds the runs that finished before it.

    Example (lesson 02)::

        sweep = labkit.sweep("scripts/02_ddp.py", nprocs=[1, 2], repeats=3, args=["--epochs", "1"])
    """
    if isinstance(nprocs, int) or not hasattr(nprocs, "__iter__"):
        raise TypeError(f"nprocs must be a list of ints, e.g. [1, 2], got {nprocs!r}")
    nprocs = list(nprocs)
    if not nprocs:
        raise ValueError("nprocs is empty: a sweep needs at least one world size, e.g. [1, 2]")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    nnodes = check_nnodes(nnodes)
    kind = resolve_device(device)
    for n in nprocs:
        check_nproc(n, kind, nnodes)
    if len(set(nprocs)) != len(nprocs):
        raise ValueError(f"nprocs has duplicates: {nprocs}. HINT: name each world size once; "
                         f"repeats={repeats} already runs each of them {repeats} time(s).")
    nprocs = sorted(nprocs)
    if threads_per_rank is None:
        threads_per_rank = max(1, _hardware.cpu_count() // (max(nprocs) * nnodes))
    for n in nprocs:  # every argument checked before the first launch
        plan(script, nproc=n, args=args, timeout=timeout, device=device,
             threads_per_rank=threads_per_rank, nnodes=nnodes)
    name = safe_name(Path(os.fspath(script)).stem if name is None else name, os.fspath(script), 0)
    sweep_dir = _rundir.create(runs_dir, f"sweep-{name}", subfolders=False)
    info = {"name": name, "script": os.fspath(script), "args": [str(a) for a in args],
            "nprocs": nprocs, "nnodes": nnodes, "repeats": repeats, "device": kind,
            "threads_per_rank": threads_per_rank,
            "hardware": _hardware.describe(),
            "runs": []}
    result = Sweep(sweep_dir, info, [])
    handle = None
    if in_notebook():
        from IPython.display import display
        handle = display({"text/plain": f"sweep {name}: starting"}, raw=True, display_id=True)
    total = len(nprocs) * repeats
    for repeat in range(repeats):
        for n in nprocs:
            label = f"{name}-n{n}-r{repeat + 1}" + (f"-{nnodes}nodes" if nnodes > 1 else "")
            progress = f"sweep {name}: run {len(result.runs) + 1}/{total} (nproc={n}, repeat {repeat + 1})"
            if handle is not None:
                handle.update({"text/plain": progress}, raw=True)
            try:
                run = launch(script, nproc=n, nnodes=nnodes, args=args, device=device, timeout=timeout,
                             threads_per_rank=threads_per_rank, name=label, runs_dir=sweep_dir,
                             quiet=True)
            except LabkitError as err:
                err.sweep = result  # the runs that did finish stay usable (LabkitError.sweep)
                print(f"sweep {name} stopped at run {len(result.runs) + 1}/{total}; the runs before it "
                      f"are in {sweep_dir} (labkit.Sweep.load reads them)")
                raise
            result.runs.append(run)
            info["runs"].append(run.run_dir.name)
            result._save_info(sweep_dir)
            try:
                speed = f"{run.throughput():,.0f} samples/s"
            except LabkitError as err:  # e.g. too few windows: sweep.table() will say so again
                speed = f"no throughput ({str(err).splitlines()[0]})"
            print(f"nproc={n} repeat {repeat + 1}/{repeats}: {speed} ({run.wall_s:.1f} s)")
    if handle is not None:
        handle.update({"text/plain": f"sweep {name}: {total} runs done — {sweep_dir}"}, raw=True)
    return result
