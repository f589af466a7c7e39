"""The flight recorder, read back: which collective each rank called, in order (lesson 10).

PyTorch keeps the last ``TORCH_FR_BUFFER_SIZE`` collectives of every process group in a ring
buffer, with their sequence number, op, sizes and the Python stack that called them. NCCL
writes it to ``TORCH_FR_DUMP_TEMP_FILE<rank>`` by itself when a collective times out
(``TORCH_NCCL_DUMP_ON_TIMEOUT=1``); on gloo a script dumps it itself when a collective fails::

    from torch._C._distributed_c10d import _dump_fr_trace   # no public name for it yet
    with open(os.environ["TORCH_FR_DUMP_TEMP_FILE"] + str(rank), "wb") as f:
        f.write(_dump_fr_trace())

labkit.launch points ``TORCH_FR_DUMP_TEMP_FILE`` into the run folder (unless you set it), so
the dumps stay with the run, and ``labkit.flight_records(run)`` reads them into a table.

A dump is a pickle of plain dicts, lists and numbers. It is read with an unpickler that
refuses every class, so a file planted in a run folder cannot run code.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

from labkit import _rundir

_TORCH_PARTS = (f"{os.sep}torch{os.sep}", f"{os.sep}labkit{os.sep}", "<frozen ")


class _PlainUnpickler(pickle.Unpickler):
    """Loads dicts, lists, tuples, strings and numbers; refuses every class and function."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"a flight record holds plain data only; refused {module}.{name}")


def read_dump(path: str | os.PathLike) -> dict:
    """One rank's flight-recorder dump (``_dump_fr_trace``'s bytes), as plain Python data."""
    with open(path, "rb") as f:
        data = _PlainUnpickler(f).load()
    if not isinstance(data, dict) or not isinstance(data.get("entries"), list):
        raise ValueError(f"{path} is not a flight-recorder dump (no 'entries' list)")
    return data


def _caller(frames) -> str:
    """'10_hang.py:31' for the innermost frame outside torch and labkit ('' if none)."""
    for frame in frames or ():
        filename = str(frame.get("filename", ""))
        if filename and not any(part in filename for part in _TORCH_PARTS):
            return f"{os.path.basename(filename)}:{frame.get('line')}"
    return ""


def flight_records(run_or_folder):
    """Every rank's flight-recorder entries in one table, in the order each rank called them.

    Args:
        run_or_folder: a ``Run`` (reads the dumps labkit pointed into its folder), or a run
            folder.

    Returns:
        a pandas DataFrame, one row per rank and collective: ``rank``, ``seq`` (the
        collective's sequence number in its process group, from 1), ``op`` (e.g.
        ``all_reduce``), ``group`` (the process group's name), ``where`` (the script's line that
        called it, e.g. ``10_hang.py:31``), ``sizes`` (the input tensors' shapes).

    Raises:
        FileNotFoundError: the run left no dump (was ``TORCH_FR_BUFFER_SIZE`` set, and did the
            script dump it?).

    Example (lesson 10)::

        fr = labkit.flight_records(err.run)
        fr.pivot(index="seq", columns="rank", values="op")
    """
    import pandas as pd

    folder = Path(getattr(run_or_folder, "run_dir", run_or_folder))
    files = _rundir.flight_files(folder)
    if not files:
        raise FileNotFoundError(
            f"no flight-recorder dump in {folder}. HINT: launch with env={{'TORCH_FR_BUFFER_SIZE': "
            f"'64'}} and have the script write _dump_fr_trace() to "
            f"TORCH_FR_DUMP_TEMP_FILE + rank when a collective fails.")
    rows = []
    for rank, path in files.items():
        for entry in read_dump(path)["entries"]:
            group = entry.get("process_group") or ("", "")
            rows.append({
                "rank": rank,
                "seq": entry.get("p2p_seq_id") if entry.get("is_p2p") else entry.get("collective_seq_id"),
                "op": str(entry.get("profiling_name", "")).split(":", 1)[-1],
                "group": group[1] if len(group) > 1 else str(group[0]),
                "where": _caller(entry.get("frames")),
                "sizes": entry.get("input_sizes"),
            })
    return pd.DataFrame(rows, columns=["rank", "seq", "op", "group", "where", "sizes"])
