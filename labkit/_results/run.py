"""A run: one launch's folder, and what can be read from it."""

from __future__ import annotations

import os
from pathlib import Path

from labkit import _rundir
from labkit._errors import LabkitError, NoMetricsError
from labkit._launch.tail import LineTail, parse_records

#: Columns labkit stamps on every metrics line.
STAMP_COLUMNS = ["rank", "step", "time", "restart", "world_size"]


def new_folder(folder: str | os.PathLike) -> Path:
    """Create ``folder`` for an export; FileExistsError if it holds anything (nothing is overwritten)."""
    target = Path(folder)
    if target.exists() and any(target.iterdir()):
        raise FileExistsError(f"{target} exists and is not empty. HINT: choose a new folder; "
                              f"nothing was overwritten.")
    target.mkdir(parents=True, exist_ok=True)
    return target


class Run:
    """One launch of a script: its settings, outcome and run folder.

    Made by ``labkit.launch`` (lesson 00 on) or reloaded with ``Run.load``.

    Attributes:
        name: the label used in charts.
        run_dir: the run folder (``runs/<timestamp>-<name>``).
        command: the exact torchrun command, as a shell line.
        nproc: ranks per node (per run, with one node).
        nnodes: torchrun agents ("nodes") of the run; world_size: nproc × nnodes.
        returncode: torchrun's exit code (None while running).
        wall_s: wall-clock seconds from launch to the end of the last rank.
        info: everything ``run.json`` holds.

    Example::

        run = labkit.launch("scripts/02_ddp.py", nproc=2)
        run.metrics(), run.throughput(), run.output(0)
        run.predictions()          # the guesses graded against this run (labkit.predict)
        ref = labkit.Run.load("../reference/02-ddp-8xH100")
    """

    def __init__(self, run_dir: str | os.PathLike, info: dict):
        self.run_dir = Path(run_dir)
        self.info = info

    # -- what run.json says ---------------------------------------------------------
    name = property(lambda self: self.info["name"])
    command = property(lambda self: self.info["command"])
    nproc = property(lambda self: self.info["nproc"])
    nnodes = property(lambda self: self.info.get("nnodes", 1))
    world_size = property(lambda self: self.info.get("world_size", self.nproc * self.nnodes))
    args = property(lambda self: list(self.info.get("args", [])))
    returncode = property(lambda self: self.info.get("returncode"))
    wall_s = property(lambda self: self.info.get("wall_s"))
    status = property(lambda self: self.info.get("status", "unknown"))
    start_time = property(lambda self: self.info.get("start_time"))

    @property
    def data(self) -> str | None:
        """The data set the run trained on, "CIFAR-10" or "synthetic", as rank 0 noted it when it
        called ``labkit.data.get_datasets``; None for a script that did not."""
        note = _rundir.read_data_note(self.run_dir)
        return None if note is None else note.get("source")

    @property
    def caption(self) -> str:
        """Hardware, backend and threads or devices per rank, for chart captions."""
        hw = self.info.get("hardware", {})
        if self.info.get("device") == "cuda":
            gpus = hw.get("gpus") or [{}]
            return (f"{self.world_size} × {gpus[0].get('name', 'GPU')}, NCCL, one GPU per rank{self._nodes}")
        return (f"{self.world_size} CPU rank(s){self._nodes} × {self.info.get('threads_per_rank')} thread(s), gloo, "
                f"on {hw.get('cpu_count', '?')} cores")

    @property
    def _nodes(self) -> str:
        return "" if self.nnodes == 1 else f" on {self.nnodes} nodes"

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Run":
        """Reload a finished run from its folder (reference runs, instructors, lesson charts).

        Raises:
            FileNotFoundError: ``path`` is not a run folder (no run.json in it).
        """
        return cls(path, _rundir.read_info(
            path, _rundir.RUN_INFO, kind="run",
            hint="pass a folder under runs/, e.g. the one printed by labkit.launch."))

    def export(self, folder: str | os.PathLike) -> "Run":
        """Copy what the charts need (run.json, the data note and every rank's metrics) to ``folder``.

        The copy is small and all text, so it can be committed and shipped: an instructor
        records reference runs on a GPU box, and learners without GPUs load them with
        ``Run.load(folder)`` and plot them next to their own. Rank logs stay behind.

        Returns:
            the exported Run, loaded from ``folder``.

        Raises:
            FileExistsError: ``folder`` exists and is not empty (nothing is overwritten).

        Example (README, for instructors)::

            run.export("reference/02-ddp-8xH100")
        """
        target = new_folder(folder)
        (target / _rundir.METRICS).mkdir()
        for path in _rundir.metrics_files(self.run_dir):
            (target / _rundir.METRICS / path.name).write_bytes(path.read_bytes())
        for kept in (self.run_dir / _rundir.DATA_FILE, _rundir.predictions_file(self.run_dir)):
            if kept.is_file():
                (target / kept.name).write_bytes(kept.read_bytes())
        Run(target, dict(self.info, exported_from=str(self.run_dir))).save_info()
        return Run.load(target)

    def save_info(self) -> None:
        """Write run.json atomically (the launcher calls this at start and end)."""
        _rundir.write_json(self.run_dir / _rundir.RUN_INFO, self.info, indent=2)

    # -- what the ranks left ----------------------------------------------------------
    def metrics(self):
        """Every metrics line of every rank, as a pandas DataFrame.

        One row per ``metrics.log`` call: ``rank``, ``step``, ``time``, ``restart``,
        ``world_size`` and whatever the script logged. A torn last line (a rank
        killed mid-write) is skipped; ``df.attrs["skipped_lines"]`` counts them.

        Raises:
            NoMetricsError: the script logged nothing.
        """
        import pandas as pd

        records, skipped = [], 0
        for path in _rundir.metrics_files(self.run_dir):
            tail = LineTail(path)
            lines = tail.new_lines()
            found, bad = parse_records(lines)
            records += found
            skipped += bad + (1 if tail.rest().strip() else 0)
        if not records:
            raise NoMetricsError(
                f"run '{self.name}' logged no metrics ({self.run_dir / _rundir.METRICS} is empty). "
                f"HINT: call `metrics.log(step, loss=...)` from the script (from labkit import metrics)."
            )
        df = pd.DataFrame.from_records(records)
        df = df.sort_values(["restart", "rank", "time"], kind="stable").reset_index(drop=True)
        df.attrs["skipped_lines"] = skipped
        df.attrs["run"] = self.name
        return df

    def throughput(self, *, warmup_windows: int = 1) -> float:
        """Steady-state samples/s of the whole run, from the ``samples`` it logged.

        A window is the stretch between two consecutive log lines of a rank (with
        the ``samples`` done in it), so the start-up before a rank's first line is
        never counted. The first ``warmup_windows`` windows of each rank (and of each
        restart) are dropped too: the first steps are slow while caches, the
        allocator and DDP's buckets settle. Each rank's median window rate is
        taken, and the ranks' rates are added (with a DistributedSampler each rank
        sees different samples).

        Raises:
            NoMetricsError: nothing logged, or no ``samples`` column.
            LabkitError: too few windows left after the warm-up.
        """
        return steady_throughput(self.metrics(), warmup_windows=warmup_windows, name=self.name)

    def windows(self, *, warmup_windows: int = 1):
        """Each rank's throughput windows: a DataFrame with ``rank``, ``restart``, ``step``
        (where the window ends), ``dt_s``, ``samples``, ``samples_per_s`` and ``warmup``
        (True for the windows ``throughput`` leaves out). Lesson 01 charts it."""
        return throughput_windows(self.metrics(), warmup_windows=warmup_windows, name=self.name)

    def predictions(self):
        """The learner's graded guesses kept in this run's folder (``Prediction.grade(run=...)``):
        a DataFrame, one row per grade, as ``labkit.predictions`` reads a whole folder of runs."""
        import pandas as pd

        from labkit._interact.guesses import COLUMNS, read_predictions

        rows = [{"run": self.run_dir.name, **record} for record in read_predictions(self.run_dir)]
        return pd.DataFrame(rows, columns=COLUMNS)

    def output(self, rank: int = 0) -> str:
        """Everything ``rank`` printed, over all restarts (a Slurm job: its one output file)."""
        if "slurm" in self.info:
            try:
                return Path(self.info["slurm"]["output"]).read_text(errors="replace")
            except OSError:
                return ""
        return "".join(path.read_text(errors="replace")
                       for _, r, path in _rundir.rank_logs(self.run_dir) if r == rank)

    def __repr__(self) -> str:
        wall = f"{self.wall_s:.1f} s" if isinstance(self.wall_s, (int, float)) else "?"
        nodes = "" if self.nnodes == 1 else f", nnodes={self.nnodes}"
        return (f"Run({self.name!r}, nproc={self.nproc}{nodes}, status={self.status}, "
                f"returncode={self.returncode}, wall={wall}, run_dir='{self.run_dir}')")


def throughput_windows(df, *, warmup_windows: int = 1, name: str = "run"):
    """Per-window samples/s of each rank from a metrics DataFrame (see ``Run.windows``)."""
    import pandas as pd

    if isinstance(warmup_windows, bool) or not isinstance(warmup_windows, int) or warmup_windows < 0:
        raise ValueError(f"warmup_windows must be an int >= 0, got {warmup_windows!r}")
    if "samples" not in df.columns:
        raise NoMetricsError(
            f"run '{name}' logged no 'samples', so its throughput is unknown. "
            f"HINT: metrics.log(step, ..., samples=<samples since the previous log call>)."
        )
    df = df[df["samples"].notna()]  # lines such as test accuracy carry no samples
    parts = []
    for (rank, restart), part in df.groupby(["rank", "restart"]):
        part = part.sort_values("time")
        windows = pd.DataFrame({
            "rank": rank, "restart": restart, "step": part["step"].to_numpy()[1:],
            "dt_s": part["time"].diff().to_numpy()[1:],
            "samples": part["samples"].to_numpy()[1:],
        })
        windows["warmup"] = windows.index < warmup_windows
        parts.append(windows[windows["dt_s"] > 0])
    if not parts:
        return pd.DataFrame(columns=["rank", "restart", "step", "dt_s", "samples", "warmup",
                                     "samples_per_s"])
    out = pd.concat(parts, ignore_index=True)
    out["samples_per_s"] = out["samples"] / out["dt_s"]
    return out


def steady_throughput(df, *, warmup_windows: int = 1, name: str = "run") -> float:
    """Steady-state samples/s from a metrics DataFrame (see ``Run.throughput``)."""
    windows = throughput_windows(df, warmup_windows=warmup_windows, name=name)
    total = 0.0
    for rank in sorted(df["rank"].unique()):
        steady = windows[(windows["rank"] == rank) & ~windows["warmup"]]
        if steady.empty:
            raise LabkitError(
                f"run '{name}': rank {rank} has no steady-state window left after dropping "
                f"{warmup_windows} warm-up window(s). HINT: log more often or run more steps."
            )
        total += float(steady["samples_per_s"].median())
    return total
