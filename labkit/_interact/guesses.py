"""The graded predictions kept in run folders, and read back: one learner's, or a room's.

``Prediction.grade(measured, run=run)`` appends one JSON line to the run's ``predictions.jsonl``
(``labkit/_rundir.py`` names it); ``Run.predictions()`` reads one run's, ``labkit.predictions``
every run under a folder::

    labkit.predictions("runs")[["question", "guess", "measured", "gap"]]

Standard library, and pandas for the tables.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from labkit import _rundir

#: The columns of a table of predictions.
COLUMNS = ["run", "time", "question", "unit", "guess", "measured", "gap", "why"]


def folder_of(run) -> Path:
    """The run or sweep folder ``run`` names (a Run, a Sweep, or a path)."""
    folder = getattr(run, "run_dir", None) or getattr(run, "sweep_dir", None)
    if folder is None and not isinstance(run, (str, os.PathLike)):
        raise ValueError(f"run must be a Run, a Sweep or a run folder, got a {type(run).__name__}. "
                         f"HINT: pass what labkit.launch returned: p.grade(value, run=run).")
    folder = Path(run if folder is None else folder)
    if not (Path(folder, _rundir.RUN_INFO).is_file() or Path(folder, _rundir.SWEEP_INFO).is_file()):
        raise ValueError(f"{folder} is not a run or sweep folder (no {_rundir.RUN_INFO}). HINT: pass "
                         f"what labkit.launch or labkit.sweep returned, or a folder under runs/.")
    return folder


def keep(folder: Path, graded) -> None:
    """Append one grade (a ``Grade``) to the folder's predictions file, as one JSON line."""
    record = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "question": graded.question,
              "unit": graded.unit, "guess": graded.guess, "measured": graded.measured,
              "gap": graded.gap, "why": graded.why}
    with open(_rundir.predictions_file(folder), "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def read_predictions(folder: str | os.PathLike) -> list[dict]:
    """Every grade kept in one run or sweep folder, oldest first (a torn line is skipped)."""
    try:
        lines = _rundir.predictions_file(folder).read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "question" in record:
            found.append(record)
    return found


def predictions(runs_dir: str | os.PathLike = "runs"):
    """Every graded prediction under ``runs_dir``, one row each: a learner's, or a room's.

    Run folders are found at any depth (sweeps, or one folder per learner that an instructor
    collected), so ``labkit.predictions("handouts/")`` reads a whole room.

    Args:
        runs_dir: the folder to search (default ``runs``, next to the notebook).

    Returns:
        a DataFrame with columns ``run`` (the folder, relative to ``runs_dir``), ``time``,
        ``question``, ``unit``, ``guess``, ``measured``, ``gap``, ``why``; oldest first.

    Raises:
        FileNotFoundError: ``runs_dir`` is not a folder.

    Example (any lesson from 02 on)::

        labkit.predictions("runs")[["question", "guess", "measured", "gap"]]
    """
    import pandas as pd

    root = Path(runs_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a folder. HINT: pass the folder that holds the run "
                                f"folders, e.g. labkit.predictions('runs') next to the notebook.")
    rows = [{"run": path.parent.relative_to(root).as_posix(), **record}
            for path in _rundir.prediction_files(root) for record in read_predictions(path.parent)]
    table = pd.DataFrame(rows, columns=COLUMNS)
    return table.sort_values("time", kind="stable").reset_index(drop=True)
