"""The flight recorder, read back: which collective each rank called, in order (lesson 10).

PyTorch keeps the last ``TORCH_FR_BUFFER_SIZE`` collectives of every process group in a ring
buffer, with their sequence number, op, sizes and the Python stack that called them. NCCL
writes it to ``TORCH_FR_DUMP_TEMP_FILE<rank>`` by itself when a collective times out
(``TORCH_NCCL_DUMP_ON_TIMEOUT=1``); on gloo a script dumps it itself when a collective fails::

    from torch._C._distributed_c10d import _dump_fr_trace   # no public name for it yet
    path = os.environ["TORCH_FR_DUMP_TEMP_FILE"] + str(rank)
    with open(path + ".tmp", "wb") as f:        # another name until it is whole: torchrun
        f.write(_dump_fr_trace())               # stops the other ranks once one has failed
    os.replace(path + ".tmp", path)

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


class _Refused(pickle.UnpicklingError):
    """A dump that would build an object: never loaded."""


class _PlainUnpickler(pickle.Unpickler):
    """Loads dicts, lists, tuples, strings and numbers; refuses every class and function."""

    def find_class(self, module, name):
        raise _Refused(f"a flight record holds plain data only; refused {module}.{name}")


class TornDump(ValueError):
    """A rank's dump that is empty or cut short: the rank was stopped while writing it."""


def read_dump(path: str | os.PathLike) -> dict:
    """One rank's flight-recorder dump (``_dump_fr_trace``'s bytes), as plain Python data.

    Raises:
        TornDump: the file is empty or cut short (a rank stopped mid-write), with the reason.
        pickle.UnpicklingError: the file would build an object; it is refused, not loaded.
        ValueError: it is whole but not a flight-recorder dump.
    """
    size = os.path.getsize(path)
    if size == 0:
        raise TornDump("its dump is empty: the rank was stopped before it wrote a byte (write "
                       "it under a temporary name, then rename it)")
    with open(path, "rb") as f:
        try:
            data = _PlainUnpickler(f).load()
        except _Refused:
            raise
        except (EOFError, pickle.UnpicklingError) as err:
            raise TornDump(f"its dump is cut short at {size} bytes ({err}): the rank was stopped "
                           f"while writing it (write it under a temporary name, then rename it)") from None
    if not isinstance(data, dict) or not isinstance(data.get("entries"), list):
        raise ValueError(f"{path} is not a flight-recorder dump (no 'entries' list)")
    return data


def _expected_ranks(folder: Path) -> list[int]:
    """The ranks of the run (from run.json's world_size); [] when the folder does not say."""
    try:
        size = _rundir.read_info(folder, _rundir.RUN_INFO, kind="run", hint="").get("world_size")
    except Exception:  # noqa: BLE001 - a bare folder of dumps: no world size to expect
        return []
    return list(range(size)) if isinstance(size, int) else []


def _readable(folder: Path) -> tuple[dict[int, dict], dict[int, str]]:
    """({rank: its dump}, {rank: why it has none}) over the run's ranks and the dumps found."""
    files = _rundir.flight_files(folder)
    dumps, missing = {}, {}
    for rank in sorted(set(files) | set(_expected_ranks(folder))):
        if rank not in files:
            missing[rank] = ("no dump: it was stopped before it wrote one, or it never reached "
                             "the code that dumps")
            continue
        try:
            dumps[rank] = read_dump(files[rank])
        except TornDump as err:
            missing[rank] = str(err)
    return dumps, missing


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

        A rank without a readable dump (none written, or one left empty or cut short by a rank
        stopped mid-write) is named on a printed line with its reason; ``table.attrs["missing"]``
        holds them: {rank: reason}.

    Raises:
        FileNotFoundError: no rank left a readable dump (each rank's reason is said; was
            ``TORCH_FR_BUFFER_SIZE`` set, and did the script dump it?).
        pickle.UnpicklingError: a dump would build an object (refused: dumps are plain data).

    Example (lesson 10)::

        fr = labkit.flight_records(err.run)
        fr.pivot(index="seq", columns="rank", values="op")
    """
    import pandas as pd

    folder = Path(getattr(run_or_folder, "run_dir", run_or_folder))
    dumps, missing = _readable(folder)
    if not dumps:
        why = "".join(f"; rank {rank}: {reason}" for rank, reason in missing.items())
        raise FileNotFoundError(
            f"no flight-recorder dump in {folder}{why}. HINT: launch with "
            f"env={{'TORCH_FR_BUFFER_SIZE': '64'}} and have the script write _dump_fr_trace() to "
            f"TORCH_FR_DUMP_TEMP_FILE + rank (a temporary name, then os.replace) when a "
            f"collective fails.")
    for rank, reason in missing.items():
        print(f"rank {rank}: {reason}")
    rows = [_row(rank, entry) for rank, dump in dumps.items() for entry in dump["entries"]]
    table = pd.DataFrame(rows, columns=["rank", "seq", "op", "group", "where", "sizes"])
    table.attrs["missing"] = missing
    return table


def _row(rank: int, entry: dict) -> dict:
    group = entry.get("process_group") or ("", "")
    return {
        "rank": rank,
        "seq": entry.get("p2p_seq_id") if entry.get("is_p2p") else entry.get("collective_seq_id"),
        "op": str(entry.get("profiling_name", "")).split(":", 1)[-1],
        "group": group[1] if len(group) > 1 else str(group[0]),
        "where": _caller(entry.get("frames")),
        "sizes": entry.get("input_sizes"),
    }
