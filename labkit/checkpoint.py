"""Script side: save training state so that a crash never leaves a half-written "latest".

Lesson 05's script uses it::

    from labkit import checkpoint
    if rank == 0:
        checkpoint.save_atomic(state, checkpoint.step_path("checkpoints/05", step))
    dist.barrier()
    path = checkpoint.latest("checkpoints/05")          # None on a fresh start
    state = torch.load(path, map_location=device, weights_only=True)

How a write stays atomic: the bytes go to a temporary file in the same folder
(``.step_00000040.pt.tmp-<pid>``), are flushed and fsync'ed, and only then is
the file renamed into place with ``os.replace``. A rename within one file
system is atomic: a reader sees the old folder or the new one, never a file
that is half there. A process killed mid-write leaves only the temporary file,
whose name ``latest`` never matches, so it can never become "the latest".

RNG states are kept as tensors, ints and tuples, so a checkpoint holding them
still loads with ``torch.load(..., weights_only=True)`` (no arbitrary pickles).

Standard library and torch only (NumPy when installed), cheap to import in a rank.
"""

from __future__ import annotations

import os
import random
import re
import warnings
import zipfile
from pathlib import Path

import torch

__all__ = ["save_atomic", "step_path", "latest", "prune", "rng_state", "set_rng_state", "files_written"]

_STEP_FILE = re.compile(r"^step_(\d{8,})\.pt$")
_WRITTEN: list[Path] = []  # every file save_atomic has put in place in this process, oldest first


def _check_folder(folder) -> Path:
    if not isinstance(folder, (str, os.PathLike)):
        raise TypeError(f"folder must be a path (str or Path), got {type(folder).__name__}. "
                        f"HINT: pass the checkpoint folder, e.g. 'checkpoints/05'.")
    return Path(folder)


def step_path(folder, step: int) -> Path:
    """The checkpoint file of ``step`` in ``folder``: ``folder/step_00000040.pt``.

    Zero-padded, so that names sort in step order too.

    Args:
        folder: the checkpoint folder.
        step: the optimizer step the state is saved at.

    Returns:
        the Path (the file need not exist).

    Raises:
        TypeError: ``folder`` is not a path.
        ValueError: ``step`` is not an int >= 0.

    Example (lesson 05)::

        checkpoint.step_path("checkpoints/05", 40)   # checkpoints/05/step_00000040.pt
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}. "
                         f"HINT: pass the optimizer step the state was saved at.")
    return _check_folder(folder) / f"step_{step:08d}.pt"


def save_atomic(obj, path) -> Path:
    """``torch.save(obj, path)`` so that ``path`` is either the old file or the whole new one.

    Writes to a temporary file beside ``path``, flushes and fsyncs it, renames it
    over ``path`` with ``os.replace`` (atomic on POSIX and Windows), then fsyncs the
    folder so the rename itself survives a power cut. If anything fails before
    the rename, the temporary file is removed and ``path`` is untouched.

    Args:
        obj: what to save, usually a dict of state dicts, tensors and numbers.
        path: the final file; its folder is created if needed.

    Returns:
        ``path`` as a Path.

    Raises:
        TypeError: ``path`` is not a path.
        IsADirectoryError: ``path`` is an existing folder.

    Example (lesson 05)::

        if rank == 0:
            checkpoint.save_atomic(state, checkpoint.step_path(args.ckpt_dir, step))
        dist.barrier()  # every rank waits until the file is complete
    """
    path = _check_folder(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a folder; save_atomic writes a file. "
                                f"HINT: use checkpoint.step_path(folder, step) for the file name.")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")  # never matches latest()
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_folder(path.parent)
    _WRITTEN.append(path)  # for files_written(): which process wrote which file
    return path


def files_written() -> list[Path]:
    """The files ``save_atomic`` has put in place in this process, oldest first (a copy).

    Each rank is its own process, so this tells which ranks wrote a checkpoint: with one
    writer, rank 0's list grows at every save and the others' stay empty.

    Example (exercise 05's skeleton, around its save)::

        before = len(checkpoint.files_written())
        save_checkpoint(step, epoch, batch_in_epoch)
        metrics.log(step, wrote=len(checkpoint.files_written()) - before)   # 1 on rank 0, else 0
    """
    return list(_WRITTEN)


def _fsync_folder(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # e.g. Windows: folders cannot be opened; the rename is enough there
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _complete_files(folder: Path) -> list[tuple[int, Path]]:
    if not folder.is_dir():
        return []
    found = []
    for entry in folder.iterdir():
        match = _STEP_FILE.match(entry.name)
        if match and entry.is_file():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def latest(folder) -> Path | None:
    """The newest complete checkpoint in ``folder`` (``step_*.pt``), or None if there is none.

    Temporary files of writes still running, or killed, are never candidates:
    their names start with a dot. As a second guard, a file whose zip archive
    (torch.save's format) has no end record, such as one copied in half or
    written by a plain ``torch.save`` that was killed, is skipped with a warning.

    Args:
        folder: the checkpoint folder; it need not exist yet.

    Returns:
        the Path of the highest step, or None.

    Raises:
        TypeError: ``folder`` is not a path.
        NotADirectoryError: ``folder`` exists and is a file.

    Example (lesson 05)::

        path = checkpoint.latest(args.ckpt_dir)
        if path is not None:
            state = torch.load(path, map_location=device, weights_only=True)
    """
    folder = _check_folder(folder)
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(f"{folder} is a file, not a checkpoint folder. "
                                 f"HINT: pass the folder that holds the step_*.pt files.")
    for step, path in reversed(_complete_files(folder)):
        if zipfile.is_zipfile(path):
            return path
        warnings.warn(f"skipping {path}: it is not a complete torch.save archive (torn write?)",
                      stacklevel=2)
    return None


def prune(folder, *, keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest checkpoints in ``folder``; return the deleted paths.

    Call it after ``save_atomic`` on the saving rank only. Temporary files are left alone.

    Args:
        folder: the checkpoint folder.
        keep: how many of the newest ``step_*.pt`` files to keep.

    Returns:
        the deleted paths, oldest first.

    Raises:
        ValueError: ``keep`` is not an int >= 1 (keeping none would delete the one just saved).

    Example (lesson 05)::

        checkpoint.prune(args.ckpt_dir, keep=2)   # the newest two: a fallback if the newest is damaged
    """
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be an int >= 1, got {keep!r}. "
                         f"HINT: keep=2 leaves a fallback if the newest file is damaged.")
    old = [path for _, path in _complete_files(_check_folder(folder))[:-keep]]
    for path in old:
        path.unlink(missing_ok=True)
    return old


# -- random number generators -----------------------------------------------------------
def rng_state() -> dict:
    """This process's RNG states, in a form that loads with ``weights_only=True``.

    Python's ``random``, NumPy's global generator (when NumPy is installed),
    torch's CPU generator and, when CUDA is initialised, every GPU's generator.
    Each rank has its own streams: gather them all if ranks draw different numbers.

    Returns:
        a dict of tensors, ints, floats and tuples.

    Example (lesson 05)::

        state["rng"] = checkpoint.rng_state()
        ...
        checkpoint.set_rng_state(state["rng"])
    """
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - NumPy comes with the course environment
        pass
    else:
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), int(pos),
                          int(has_gauss), float(cached))
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what ``rng_state`` captured (tensors may come back on any device).

    Args:
        state: the dict ``rng_state`` returned, e.g. from a checkpoint loaded with
            ``map_location`` (the tensors are moved back to the CPU here).

    Raises:
        TypeError: ``state`` is not a dict from ``rng_state``.
        ValueError: it holds CUDA states but CUDA is not available here.
    """
    if not isinstance(state, dict) or "torch" not in state or "python" not in state:
        raise TypeError(f"expected the dict that checkpoint.rng_state() returns, got "
                        f"{type(state).__name__} with keys {sorted(state) if isinstance(state, dict) else '-'}. "
                        f"HINT: save checkpoint.rng_state() and pass the same object back.")
    if "cuda" in state and not torch.cuda.is_available():
        raise ValueError("this RNG state holds CUDA generators, but CUDA is not available here. "
                         "HINT: resume on a machine with GPUs, or drop state['cuda'] on purpose.")
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"].cpu())  # map_location may have moved it to a GPU
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.cpu().numpy().astype("uint32"), pos, has_gauss, cached))
    if "cuda" in state:
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
