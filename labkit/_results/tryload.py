"""labkit.try_load: open a saved state dict the way someone will tomorrow, and say what happens.

Lesson 06 uses it on the file that rank 0 wrote with ``torch.save(model.state_dict())``
under FSDP::

    found = labkit.try_load("checkpoints/06/naive_fsdp.pt", MLPStack(dim=256, depth=4))
    found.fresh_python      # the error a fresh Python gives torch.load(..., weights_only=True)
    found.into_model        # why load_state_dict refused it
    found.numbers_held, found.numbers_in_model   # rank 0's shards only: about half on 2 ranks

The plumbing stays here (a subprocess, PyTorch's log lines collected, an error
message parsed), so that a lesson shows the facts.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from labkit._launch.keywords import refuse_keywords, renamed
from labkit.memory import local_tensor

__all__ = ["try_load", "LoadReport"]

_FRESH = "import sys, torch; torch.load(sys.argv[1], map_location='cpu', weights_only=True)"
_EXCEPTION_LINE = re.compile(r"^[\w.]+(Error|Exception)\b")
# load_state_dict lists every parameter it could not copy; the first one's name and cause say it all.
_COPY_FAILED = re.compile(r'parameter named "([^"]+)".*?exception occurred : \(\'(.+?)\',\)', re.S)


@dataclass
class LoadReport:
    """What happened when ``try_load`` opened a file; see ``try_load``.

    Attributes:
        path: the file.
        fresh_python: the exception line a fresh Python printed for
            ``torch.load(path, weights_only=True)``, or None if it loaded there.
        state: the file's contents, loaded in this process (``torch.distributed.tensor``
            imported first, so that DTensors unpickle).
        logged: what PyTorch said while loading it here: warnings and
            ``torch.distributed`` log lines, collected instead of printed.
        into_model: why ``model.load_state_dict(state)`` refused the file (for a copy
            that failed: the first parameter and its cause), or None if it loaded.
        numbers_held: elements of the file's tensors (a DTensor counts its local shard).
        numbers_in_model: elements of the model's state dict.

    Example (lesson 06)::

        report = labkit.try_load("runs/06/model.pt", model)
        report.into_model is None, report.numbers_held, report.numbers_in_model
    """

    path: Path
    fresh_python: str | None
    state: dict
    logged: list[str] = field(default_factory=list)
    into_model: str | None = None
    numbers_held: int = 0
    numbers_in_model: int = 0

    def __str__(self) -> str:
        lines = [f"{self.path}:",
                 f"  a fresh Python, torch.load(weights_only=True): {self.fresh_python or 'loaded'}",
                 f"  into the model, load_state_dict: {self.into_model or 'loaded'}",
                 f"  the file holds {self.numbers_held:,} of the model's {self.numbers_in_model:,} numbers"]
        if self.logged:
            lines.append(f"  PyTorch said {len(self.logged)}× while loading: {self.logged[0][:90]}")
        return "\n".join(lines)


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@refuse_keywords(**renamed("try_load", timeout="timeout_s"))
def try_load(path: str | os.PathLike, model: torch.nn.Module, *, timeout_s: float = 120) -> LoadReport:
    """Load a saved state dict three ways, as a user of the file would, and report each outcome.

    1. In a **fresh Python** (a subprocess: nothing distributed imported yet), with
       ``torch.load(path, weights_only=True)``: does the file open at all?
    2. **Here**, after importing ``torch.distributed.tensor`` (which lets
       ``weights_only=True`` unpickle DTensors), collecting what PyTorch logs or
       warns meanwhile (unpickling a ``DeviceMesh`` with no process group logs a warning).
    3. **Into ``model``** with ``load_state_dict``: does it fit a plain model?

    It also counts the numbers the file holds (a DTensor's local shard) against the
    model's state dict. A file that fails step 1 or 3 is reported, not raised; one that
    does not open even in step 2 (a torn file) raises what ``torch.load`` raised.

    Args:
        path: the file ``torch.save`` wrote.
        model: a plain model of the architecture the file claims to hold; its weights
            are overwritten if the load succeeds.
        timeout_s: seconds for the fresh Python.

    Returns:
        a LoadReport.

    Raises:
        FileNotFoundError: ``path`` is not a file.
        TypeError: ``model`` is not an ``nn.Module``.
        subprocess.TimeoutExpired: the fresh Python took longer than ``timeout_s``.
        pickle.UnpicklingError, RuntimeError: the file does not open here either.

    Example (lesson 06)::

        found = labkit.try_load(CKPT / "naive_fsdp.pt", MLPStack(dim=DIM, depth=DEPTH))
        assert found.fresh_python and found.into_model
        print(found.numbers_held / found.numbers_in_model)   # 0.5 on 2 ranks: rank 0's shards
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{os.fspath(path)!r} is not a file (looked in {Path.cwd()}). "
                                f"HINT: pass the file that torch.save wrote.")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}. "
                        f"HINT: pass a plain model of the saved architecture, e.g. MLPStack(dim=..., depth=...).")

    fresh = subprocess.run([sys.executable, "-c", _FRESH, os.fspath(path)],
                           capture_output=True, text=True, timeout=timeout_s)
    fresh_python = None
    if fresh.returncode != 0:
        raised = [line for line in fresh.stderr.splitlines() if _EXCEPTION_LINE.match(line)]
        fresh_python = raised[-1] if raised else fresh.stderr.strip()[-300:]  # the exception's own line

    importlib.import_module("torch.distributed.tensor")  # lets weights_only=True unpickle DTensors

    state, logged = _load_here(path)
    into_model = None
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        first = _COPY_FAILED.search(str(err))
        into_model = f"{first[1]!r}: {first[2]}" if first else str(err).strip()[:400]
    return LoadReport(path=path, fresh_python=fresh_python, state=state, logged=logged,
                      into_model=into_model,
                      numbers_held=sum(local_tensor(v).numel() for v in state.values() if isinstance(v, torch.Tensor)),
                      numbers_in_model=sum(v.numel() for v in model.state_dict().values()))


def _load_here(path: Path) -> tuple[dict, list[str]]:
    """torch.load on the CPU, with torch.distributed's log lines and warnings collected."""
    logger, collect = logging.getLogger("torch.distributed"), _Collect()
    handlers, propagate = logger.handlers[:], logger.propagate
    logger.handlers, logger.propagate = [collect], False  # to us only, not to PyTorch's printers
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state = torch.load(path, map_location="cpu", weights_only=True)
    finally:
        logger.handlers, logger.propagate = handlers, propagate
    return state, collect.lines + [str(w.message) for w in caught]

