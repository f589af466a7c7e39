"""What this machine has: GPUs (counted without a CUDA context), CPU cores, smoke mode.

The kernel never creates a CUDA context: a context in the notebook's process
holds GPU memory for as long as the kernel lives, and a process that has
initialised CUDA cannot safely fork. GPUs are counted with ``nvidia-smi``.
"""

from __future__ import annotations

import functools
import os
import shutil
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass

SMOKE_ENV = "LABKIT_SMOKE"


def is_smoke() -> bool:
    """True when ``LABKIT_SMOKE`` asks for smoke mode: tiny data, few steps, 2 ranks at most.

    CI sets it; a learner may too, for a quick first pass through a lesson.
    """
    return os.environ.get(SMOKE_ENV, "").strip().lower() not in ("", "0", "false", "no")


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    memory_mib: int


def _visible(indices: list[int]) -> list[int]:
    """Apply CUDA_VISIBLE_DEVICES (numeric form) to the indices nvidia-smi reports."""
    mask = os.environ.get("CUDA_VISIBLE_DEVICES")
    if mask is None:
        return indices
    mask = mask.strip()
    if mask in ("", "-1"):
        return []
    chosen = []
    for item in mask.split(","):
        item = item.strip()
        if not item.isdigit():  # UUID or MIG forms: trust nvidia-smi's list as is
            return indices
        if int(item) in indices:
            chosen.append(int(item))
        else:
            break  # CUDA stops at the first invalid entry
    return chosen


@functools.lru_cache(maxsize=1)
def _query_gpus() -> tuple[Gpu, ...]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return ()
    try:
        out = subprocess.run(
            [exe, "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    gpus = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[0].isdigit():
            memory = int(parts[2]) if parts[2].isdigit() else 0
            gpus.append(Gpu(int(parts[0]), parts[1], memory))
    return tuple(gpus)


def gpus() -> list[Gpu]:
    """The GPUs this process may use (CUDA_VISIBLE_DEVICES applied), without touching CUDA."""
    found = _query_gpus()
    keep = set(_visible([g.index for g in found]))
    return [g for g in found if g.index in keep]


def gpu_count() -> int:
    """How many GPUs launches can use (CUDA_VISIBLE_DEVICES applied; no CUDA context made)."""
    return len(gpus())


def cpu_count() -> int:
    """CPU cores this process may run on (the affinity mask, not the machine's total)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def describe() -> dict:
    """What a run or sweep records of this machine: CPU cores, platform and the visible GPUs."""
    return {"cpu_count": cpu_count(), "platform": sys.platform, "gpus": [asdict(g) for g in gpus()]}


def loopback_interface() -> str | None:
    """The loopback interface's name ("lo" on Linux, "lo0" on macOS), if found."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (OSError, AttributeError):
        return None
    for candidate in ("lo", "lo0"):
        if candidate in names:
            return candidate
    return None
