"""Checks at the door: every argument of a launch is validated before anything starts.

Also the defaults a lesson asks for (``default_nproc``, ``lesson_device``). Kernel side,
standard library.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from labkit import _hardware
from labkit._errors import ScriptError

_DEVICES = ("auto", "cpu")
#: CPU ranks per core above which a launch is refused: each rank starts its own Python and
#: torch, so far more ranks than cores spend the timeout starting up and then flood the cell.
MAX_RANKS_PER_CORE = 4
_WRITEFILE = re.compile(r"^%%writefile\s+(?:(?:-a|--append)\s+)?(\S+)")


@dataclass(frozen=True)
class Plan:
    """A validated launch: everything needed to start it."""

    script: str
    nproc: int
    device: str          # "cuda" or "cpu": what the ranks will use
    threads_per_rank: int
    args: tuple
    timeout_s: float | None
    max_restarts: int
    nnodes: int = 1      # torchrun agents, one per "node", all on this machine
    min_nodes: int | None = None    # elastic: the fewest nodes the job runs on (--nnodes=MIN:MAX)
    hang_timeout_s: float | None = None   # stop a run in which no rank printed or logged for this long

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes


# -- checks at the door -------------------------------------------------------------
def check_script(script) -> str:
    """The script's path if it is a .py file that compiles; FileNotFoundError, ValueError or
    ScriptError if not."""
    if not isinstance(script, (str, os.PathLike)):
        raise TypeError(f"script must be a path like 'scripts/02_ddp.py', got {type(script).__name__}")
    path = Path(script)
    if not path.is_file():
        where = "is a folder, not a file" if path.is_dir() else "does not exist"
        raise FileNotFoundError(
            f"script {os.fspath(script)!r} {where} (looked in {Path.cwd()}). "
            f"HINT: paths are relative to the notebook's folder; run the %%writefile cell first."
        )
    if path.suffix == ".ipynb":
        written = _written_scripts(path)
        example = f", e.g. {written[0]}" if written else ""
        raise ValueError(
            f"{os.fspath(path)} is a notebook, not a script: torchrun runs Python scripts. "
            f"HINT: launch the script its %%writefile cell writes{example}."
        )
    if path.suffix != ".py":
        raise ValueError(
            f"{os.fspath(path)} is not a Python script (.py): labkit launches .py files only. "
            f"HINT: pass the path of the script, e.g. 'scripts/02_ddp.py'."
        )
    source = path.read_bytes()
    if b"\0" in source:
        raise ScriptError(
            f"{os.fspath(path)} is not Python source: it contains null bytes.\n"
            f"HINT: a binary file, or text saved as UTF-16? Save it as UTF-8 text "
            f"(nothing was launched)."
        )
    try:
        compile(source, os.fspath(path), "exec")
    except SyntaxError as err:
        line = (err.text or "").rstrip()
        pointer = f"\n    {line}" if line else ""
        where = f", line {err.lineno}" if err.lineno else ""
        raise ScriptError(
            f"{os.fspath(path)}{where}: {err.msg}{pointer}\n"
            f"HINT: fix the script (nothing was launched)."
        ) from None
    return os.fspath(path)


def _written_scripts(notebook: Path) -> list[str]:
    """The .py files that a notebook's %%writefile cells write, as paths from here, each once
    (a lesson writes its script in steps: ``%%writefile`` and then ``%%writefile -a`` cells)."""
    try:
        cells = json.loads(notebook.read_text(encoding="utf-8")).get("cells", [])
    except (OSError, ValueError, AttributeError):
        return []
    found = []
    for cell in cells:
        source = cell.get("source", "") if isinstance(cell, dict) else ""
        match = _WRITEFILE.match("".join(source) if isinstance(source, list) else source)
        if match and match.group(1).endswith(".py"):
            path = os.path.join(os.path.dirname(os.fspath(notebook)), match.group(1))
            if path not in found:
                found.append(path)
    return found


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
    """Ranks a launch uses when nproc is not given: every visible GPU, else 2 CPU ranks
    (``LABKIT_RANKS`` CPU ranks when it is set; ``make test-scale`` sets 4).

    Smoke mode (LABKIT_SMOKE=1) caps the GPUs at the same number (2 unless ``LABKIT_RANKS``).

    Example::

        NPROC = labkit.default_nproc(DEVICE)     # every GPU, else 2 CPU ranks
    """
    kind = resolve_device(device)
    ranks = _hardware.cpu_ranks()
    n = _hardware.gpu_count() if kind == "cuda" else ranks
    return min(n, ranks) if _hardware.is_smoke() else n


def lesson_device(ranks: int = 2) -> str:
    """The ``device`` a lesson's multi-rank launches pass: "auto" with a GPU for every rank,
    else "cpu".

    NCCL needs one GPU per rank. With fewer GPUs than ``ranks`` (one GPU on a laptop, or none),
    a lesson that needs ``ranks`` processes runs them as CPU ranks with gloo instead; with
    enough GPUs, "auto" gives every rank its own GPU. GPUs are counted without a CUDA context.

    Args:
        ranks: the fewest ranks the lesson needs to show anything (2 for data parallelism).

    Returns:
        "auto" when at least ``ranks`` GPUs are visible, else "cpu".

    Raises:
        TypeError, ValueError: ``ranks`` is not an int >= 1.

    Example (lessons 00, 02 to 06)::

        DEVICE = labkit.lesson_device()          # "auto" on 2+ GPUs, else "cpu"
        NPROC = labkit.default_nproc(DEVICE)     # every GPU, else 2 CPU ranks
        labkit.launch("scripts/02_ddp.py", nproc=NPROC, device=DEVICE)
    """
    _check_int("ranks", ranks, 1)
    return "auto" if _hardware.gpu_count() >= ranks else "cpu"


def check_nproc(nproc, device: str, nnodes: int = 1) -> int:
    _check_int("nproc", nproc, 1)
    cores = _hardware.cpu_count()
    ranks = nproc * nnodes
    what = f"nproc={nproc}" if nnodes == 1 else f"nnodes={nnodes} × nproc={nproc} = {ranks}"
    if device == "cpu" and ranks > MAX_RANKS_PER_CORE * cores:
        raise ValueError(
            f"{what} CPU ranks on {cores} core(s) is too many: labkit launches at most "
            f"{MAX_RANKS_PER_CORE} CPU ranks per core ({MAX_RANKS_PER_CORE * cores} here). Each rank "
            f"starts its own Python and torch, so the run would spend its time starting up. "
            f"HINT: {'nproc' if nnodes == 1 else 'nnodes × nproc'}={cores} or fewer; ranks beyond "
            f"{cores} share cores, so they add no speed."
        )
    if device == "cuda":
        available = _hardware.gpu_count()
        if ranks > available:
            per_node = "" if nnodes == 1 else " (every node gets GPUs of its own, as on a cluster)"
            raise ValueError(
                f"{what} but only {available} GPU(s) are visible{per_node} "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}). "
                f"HINT: nproc={max(1, available // nnodes)}, or device='cpu' for CPU ranks."
            )
    return nproc


def check_nnodes(nnodes) -> int:
    """How many torchrun agents ("nodes") a launch starts on this machine: an int >= 1."""
    if isinstance(nnodes, str):
        raise TypeError(
            f"nnodes must be an int, e.g. nnodes=2, got the string {nnodes!r}. HINT: torchrun's "
            f"elastic form '--nnodes=MIN:MAX' is nnodes=MAX, min_nodes=MIN.")
    return _check_int("nnodes", nnodes, 1)


def check_min_nodes(min_nodes, nnodes: int) -> int | None:
    """``min_nodes``: None (a fixed number of nodes) or an int from 1 to ``nnodes``."""
    if min_nodes is None:
        return None
    if isinstance(min_nodes, bool) or not isinstance(min_nodes, int):
        raise TypeError(f"min_nodes must be an int or None, got {min_nodes!r}")
    if not 1 <= min_nodes <= nnodes:
        raise ValueError(
            f"min_nodes={min_nodes} with nnodes={nnodes}: torchrun's --nnodes=MIN:MAX needs "
            f"1 <= MIN <= MAX. HINT: nnodes is the most nodes, min_nodes the fewest the job runs on.")
    return min_nodes


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


def check_timeout(timeout, *, name: str = "timeout_s") -> float | None:
    """A positive, finite number of seconds, or None (no limit)."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"{name} must be a positive number of seconds or None, got {timeout!r}")
    if math.isinf(timeout):
        raise ValueError(f"{name} must be a positive number of seconds or None, got {timeout!r}. "
                         f"HINT: {name}=None means no limit.")
    return timeout


def check_env(env) -> dict:
    """Extra environment variables for the ranks: names and values are strings (a number is
    written as one). None is refused rather than guessed at: it is not "unset"."""
    if env is None:
        return {}
    if not isinstance(env, dict):
        raise TypeError(f"env must be a dict of strings, e.g. {{'NCCL_DEBUG': 'INFO'}}, "
                        f"got {type(env).__name__}")
    out = {}
    for key, value in env.items():
        if not isinstance(key, str) or not key or "=" in key:
            raise ValueError(f"env names must be non-empty strings without '=', got {key!r}")
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise TypeError(
                f"env[{key!r}] must be a string, got {value!r}. HINT: ranks get text; leave {key} "
                f"out to keep the kernel's own value, or pass '' for an empty one."
            )
        out[key] = str(value)
    return out


def plan(script, *, nproc=None, args=(), timeout_s=600, max_restarts=0, device="auto",
         threads_per_rank=None, nnodes=1, min_nodes=None, hang_timeout_s=None) -> Plan:
    """Check every argument of a launch; raise before anything starts."""
    nnodes = check_nnodes(nnodes)
    min_nodes = check_min_nodes(min_nodes, nnodes)
    kind = resolve_device(device)
    if nproc is None:
        nproc = default_nproc(device)
        if nnodes > 1:  # the default is for the whole machine: share it between the nodes
            nproc = max(1, nproc // nnodes) if kind == "cuda" else 1
    check_nproc(nproc, kind, nnodes)
    timeout_s = check_timeout(timeout_s)
    hang_timeout_s = check_timeout(hang_timeout_s, name="hang_timeout_s")
    _check_int("max_restarts", max_restarts, 0)
    if threads_per_rank is None:
        threads_per_rank = max(1, _hardware.cpu_count() // (nproc * nnodes))
    _check_int("threads_per_rank", threads_per_rank, 1)
    return Plan(check_script(script), nproc, kind, threads_per_rank, check_args(args),
                timeout_s, max_restarts, nnodes, min_nodes, hang_timeout_s)
