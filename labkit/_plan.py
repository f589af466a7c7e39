"""Checks at the door: every argument of a launch is validated before anything starts."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from labkit import _hardware
from labkit._errors import ScriptError

_DEVICES = ("auto", "cpu")


@dataclass(frozen=True)
class Plan:
    """A validated launch: everything needed to start it."""

    script: str
    nproc: int
    device: str          # "cuda" or "cpu": what the ranks will use
    threads_per_rank: int
    args: tuple
    timeout: float | None
    max_restarts: int


# -- checks at the door -------------------------------------------------------------
def check_script(script) -> str:
    """The script's path if it exists and compiles; FileNotFoundError or ScriptError if not."""
    if not isinstance(script, (str, os.PathLike)):
        raise TypeError(f"script must be a path like 'scripts/02_ddp.py', got {type(script).__name__}")
    path = Path(script)
    if not path.is_file():
        where = "is a folder, not a file" if path.is_dir() else "does not exist"
        raise FileNotFoundError(
            f"script {os.fspath(script)!r} {where} (looked in {Path.cwd()}). "
            f"HINT: paths are relative to the notebook's folder; run the %%writefile cell first."
        )
    source = path.read_bytes()
    try:
        compile(source, os.fspath(path), "exec")
    except SyntaxError as err:
        line = (err.text or "").rstrip()
        pointer = f"\n    {line}" if line else ""
        raise ScriptError(
            f"{os.fspath(path)}, line {err.lineno}: {err.msg}{pointer}\n"
            f"HINT: fix the script (nothing was launched)."
        ) from None
    return os.fspath(path)


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def resolve_device(device: str) -> str:
    if device not in _DEVICES:
        raise ValueError(
            f"device must be one of {_DEVICES}, got {device!r}. "
            f"HINT: 'auto' uses the GPUs when there are any; 'cpu' hides them for this run."
        )
    if device == "cpu":
        return "cpu"
    return "cuda" if _hardware.gpu_count() > 0 else "cpu"


def default_nproc(device: str = "auto") -> int:
    """Ranks a launch uses when nproc is not given: every visible GPU, else 2 CPU ranks.

    Smoke mode (LABKIT_SMOKE=1) caps it at 2.
    """
    kind = resolve_device(device)
    n = _hardware.gpu_count() if kind == "cuda" else 2
    return min(n, 2) if _hardware.is_smoke() else n


def check_nproc(nproc, device: str) -> int:
    _check_int("nproc", nproc, 1)
    if device == "cuda":
        available = _hardware.gpu_count()
        if nproc > available:
            raise ValueError(
                f"nproc={nproc} but only {available} GPU(s) are visible "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}). "
                f"HINT: nproc={available}, or device='cpu' for CPU ranks."
            )
    return nproc


def check_args(args) -> tuple:
    if isinstance(args, (str, bytes)):
        raise TypeError(
            f"args must be a list of strings, e.g. ['--epochs', '2'], not one string: {args!r}"
        )
    out = []
    for item in args or ():
        if isinstance(item, bool) or not isinstance(item, (str, int, float, os.PathLike)):
            raise TypeError(f"args must hold strings (or numbers), got {item!r} in {list(args)!r}")
        out.append(os.fspath(item) if isinstance(item, os.PathLike) else str(item))
    return tuple(out)


def plan(script, *, nproc=None, args=(), timeout=600, max_restarts=0, device="auto",
         threads_per_rank=None) -> Plan:
    """Check every argument of a launch; raise before anything starts."""
    kind = resolve_device(device)
    nproc = default_nproc(device) if nproc is None else check_nproc(nproc, kind)
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    _check_int("max_restarts", max_restarts, 0)
    if threads_per_rank is None:
        threads_per_rank = max(1, _hardware.cpu_count() // nproc)
    _check_int("threads_per_rank", threads_per_rank, 1)
    return Plan(check_script(script), nproc, kind, threads_per_rank, check_args(args),
                timeout, max_restarts)
