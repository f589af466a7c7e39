"""The run folder: its one definition, for the launcher, the ranks and whoever reads it later.

A launch writes everything about itself under ``runs/<timestamp>-<name>/``::

    run.json                              what ran, how, where, and how it ended (the launcher)
    torchrun.log                          torchrun's own output (the launcher)
    data.json                             which data set the run trained on (rank 0, labkit.data)
    metrics/rank<R>.jsonl                 rank R's metrics.log lines
    pids/rank<R>.json                     rank R's pid, so the launcher can stop it (latest attempt)
    errors/rank<R>-restart<N>.json        rank R's uncaught exception in attempt N
    torchrun/<id>/attempt_<N>/<R>/stdout.log   what rank R printed in attempt N (torchrun --log-dir)
    flight_rank<R>                        rank R's flight-recorder dump, if it wrote one (lesson 10)
    predictions.jsonl                     the learner's graded guesses, one line each (labkit.predict)

With several nodes (``launch(nnodes=N)``) agent k writes ``torchrun-node<k>.log``, its ranks'
logs go to ``torchrun/node<k>/<id>/attempt_<N>/<local rank>/stdout.log``, and
``pids/layout.jsonl`` says which rank each (node, attempt, local rank) was. A Slurm job
(``labkit.sbatch``) writes its output to ``slurm.out``.

A sweep's folder holds ``sweep.json`` and one run folder per run. An export (``Run.export``)
keeps run.json, data.json, metrics/ and predictions.jsonl: enough to redraw every chart.

The launcher tells each rank its run folder in the ``LABKIT_RUN_DIR`` environment variable.
Standard library only: each rank imports this before its script (and torch) is loaded.
"""

from __future__ import annotations

import glob
import json
import os
import re
import time
from pathlib import Path

#: The environment variable labkit.launch sets, in every rank, to the run folder.
RUN_DIR_ENV = "LABKIT_RUN_DIR"

RUN_INFO = "run.json"
SWEEP_INFO = "sweep.json"
TORCHRUN_LOG = "torchrun.log"
#: Which data set the run trained on (``labkit.data`` writes it, ``Run.data`` reads it).
DATA_FILE = "data.json"

METRICS = "metrics"
PIDS = "pids"
ERRORS = "errors"
TORCHRUN = "torchrun"
SUBFOLDERS = (METRICS, PIDS, ERRORS, TORCHRUN)

#: Several nodes: one line per rank and attempt, {rank, node, local_rank, group_rank, restart, pid}.
LAYOUT_FILE = "layout.jsonl"
#: A Slurm job's output file.
SLURM_OUTPUT = "slurm.out"
#: What labkit sets PyTorch's TORCH_FR_DUMP_TEMP_FILE to, in the run folder: a rank's
#: flight-recorder dump is this prefix followed by its rank.
FLIGHT_PREFIX = "flight_rank"

#: The learner's graded predictions (``Prediction.grade``), in a run or sweep folder.
PREDICTIONS = "predictions.jsonl"

_LAYOUT_KEYS = ("rank", "node", "local_rank", "group_rank", "restart", "pid")
_RANK_FILE = re.compile(r"^rank(\d+)\.json$")
_NODE_LOG = re.compile(r"node(\d+)[/\\][^/\\]+[/\\]attempt_(\d+)[/\\](\d+)[/\\]stdout\.log$")
_RANK_LOG = re.compile(r"attempt_(\d+)[/\\](\d+)[/\\]stdout\.log$")


def from_env() -> str | None:
    """The run folder this process writes to (a rank under labkit.launch); None under a bare
    ``torchrun`` or ``python``."""
    return os.environ.get(RUN_DIR_ENV) or None


def create(runs_dir: str | os.PathLike, name: str, *, subfolders: bool = True) -> Path:
    """Create ``runs_dir/<timestamp>-<name>`` (unique, even for concurrent launches), with the
    subfolders a launch writes to (a sweep's folder has none).

    Raises:
        PermissionError: ``runs_dir`` cannot be written to (with a HINT).
    """
    root = Path(runs_dir)
    try:
        root.mkdir(parents=True, exist_ok=True)
        if not os.access(root, os.W_OK | os.X_OK):
            raise PermissionError(f"no write permission on {root}")
    except OSError as err:
        raise PermissionError(
            f"cannot write run folders under {root.resolve()}: {err}. "
            f"HINT: pass runs_dir= a folder you can write to."
        ) from None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for attempt in range(1000):
        suffix = "" if attempt == 0 else f"-{attempt + 1}"
        run_dir = root / f"{stamp}-{name}{suffix}"
        try:
            run_dir.mkdir()
        except FileExistsError:
            continue
        for sub in SUBFOLDERS if subfolders else ():
            (run_dir / sub).mkdir()
        return run_dir
    raise RuntimeError(f"could not create a run folder under {root}")  # pragma: no cover


# -- files, by rank ------------------------------------------------------------------------
def metrics_file(run_dir: str | os.PathLike, rank: int) -> Path:
    return Path(run_dir, METRICS, f"rank{rank}.jsonl")


def metrics_files(run_dir: str | os.PathLike) -> list[Path]:
    """Every rank's metrics file, in name order."""
    return sorted(Path(run_dir, METRICS).glob("rank*.jsonl"))


def pid_file(run_dir: str | os.PathLike, rank: int) -> Path:
    return Path(run_dir, PIDS, f"rank{rank}.json")


def pid_files(run_dir: str | os.PathLike) -> dict[int, Path]:
    """{rank: its pid file}."""
    found = {}
    for path in Path(run_dir, PIDS).glob("rank*.json"):
        match = _RANK_FILE.match(path.name)
        if match:
            found[int(match[1])] = path
    return found


def error_file(run_dir: str | os.PathLike, rank: int, restart: int) -> Path:
    return Path(run_dir, ERRORS, f"rank{rank}-restart{restart}.json")


def error_files(run_dir: str | os.PathLike) -> list[Path]:
    return sorted(Path(run_dir, ERRORS).glob("rank*-restart*.json"))


def flight_prefix(run_dir: str | os.PathLike) -> Path:
    """TORCH_FR_DUMP_TEMP_FILE for a run: each rank's dump is this path followed by its rank."""
    return Path(run_dir, FLIGHT_PREFIX)


def flight_files(run_dir: str | os.PathLike) -> dict[int, Path]:
    """{rank: its flight-recorder dump} of the dumps in the run folder."""
    found = {}
    for path in Path(run_dir).glob(FLIGHT_PREFIX + "*"):
        suffix = path.name[len(FLIGHT_PREFIX):]
        if suffix.isdigit():
            found[int(suffix)] = path
    return dict(sorted(found.items()))


def predictions_file(folder: str | os.PathLike) -> Path:
    """Where ``Prediction.grade`` appends its lines, in a run or sweep folder."""
    return Path(folder, PREDICTIONS)


def prediction_files(root: str | os.PathLike) -> list[Path]:
    """Every predictions file under ``root``, at any depth (sweeps, a room's run folders)."""
    return sorted(Path(root).rglob(PREDICTIONS))


def torchrun_dir(run_dir: str | os.PathLike) -> Path:
    """The folder given to torchrun's ``--log-dir``."""
    return Path(run_dir, TORCHRUN)


def rank_logs(run_dir: str | os.PathLike) -> list[tuple[int, int, Path]]:
    """(attempt, rank, path) of every rank's stdout log torchrun has made so far, oldest attempt
    first, then by rank. With several nodes, a log whose rank has not yet written its layout
    line is left out."""
    pattern = os.path.join(os.fspath(run_dir), TORCHRUN, "*", "attempt_*", "*", "stdout.log")
    found = []
    for path in glob.glob(pattern):
        match = _RANK_LOG.search(path)
        if match:
            found.append((int(match[1]), int(match[2]), Path(path)))
    node_logs = node_rank_logs(run_dir)
    layout = read_layout(run_dir) if node_logs else {}
    for node, attempt, local, path in node_logs:
        rec = layout.get((node, attempt, local))
        if rec is not None:
            found.append((attempt, rec["rank"], path))
    return sorted(found)


# -- several nodes -----------------------------------------------------------------------------
def agent_log(run_dir: str | os.PathLike, node: int, nnodes: int) -> Path:
    """Agent ``node``'s own output: ``torchrun.log`` for one node, ``torchrun-node<k>.log``."""
    return Path(run_dir, TORCHRUN_LOG if nnodes == 1 else f"torchrun-node{node}.log")


def node_dir(run_dir: str | os.PathLike, node: int) -> Path:
    """Agent ``node``'s ``--log-dir`` (several nodes)."""
    return Path(run_dir, TORCHRUN, f"node{node}")


def layout_file(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir, PIDS, LAYOUT_FILE)


def layout_records(run_dir: str | os.PathLike) -> list[dict]:
    """Every line of the layout file, in the order the ranks wrote them (torn lines skipped):
    the one reader of that file. A rank's newest process is its last line."""
    try:
        text = layout_file(run_dir).read_text()
    except OSError:
        return []
    found = []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and all(isinstance(rec.get(key), int) for key in _LAYOUT_KEYS):
            found.append(rec)
    return found


def read_layout(run_dir: str | os.PathLike) -> dict[tuple[int, int, int], dict]:
    """{(node, restart, local_rank): that line of the layout file}; a later line for the same
    place (an elastic round that reused it) wins."""
    return {(rec["node"], rec["restart"], rec["local_rank"]): rec for rec in layout_records(run_dir)}


def node_rank_logs(run_dir: str | os.PathLike) -> list[tuple[int, int, int, Path]]:
    """(node, attempt, local rank, path) of every rank log under ``torchrun/node<k>/``."""
    pattern = os.path.join(os.fspath(run_dir), TORCHRUN, "node*", "*", "attempt_*", "*", "stdout.log")
    found = []
    for path in glob.glob(pattern):
        match = _NODE_LOG.search(path)
        if match:
            found.append((int(match[1]), int(match[2]), int(match[3]), Path(path)))
    return sorted(found)


# -- JSON files ------------------------------------------------------------------------------
def write_json(path: str | os.PathLike, data: dict, *, indent: int | None = None) -> None:
    """Write ``data`` to ``path`` atomically: a reader sees the old file or the new, never half."""
    tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=indent, default=str)
    os.replace(tmp, path)


def read_info(folder: str | os.PathLike, file: str, *, kind: str, hint: str) -> dict:
    """The JSON ``file`` that makes ``folder`` a run (run.json) or sweep (sweep.json) folder.

    Raises:
        FileNotFoundError: ``folder`` has no such file; says so, with ``hint``.
    """
    path = Path(folder, file)
    if not path.is_file():
        raise FileNotFoundError(f"{Path(folder)} is not a {kind} folder: it has no {file}. "
                                f"HINT: {hint}")
    return json.loads(path.read_text())


def read_data_note(run_dir: str | os.PathLike) -> dict | None:
    """What ``data.json`` says (source, description, sizes); None if the run wrote none."""
    try:
        note = json.loads(Path(run_dir, DATA_FILE).read_text())
    except (OSError, ValueError):
        return None
    return note if isinstance(note, dict) else None
