"""What this machine has: GPUs (counted without a CUDA context), CPU cores, smoke mode.

The kernel never creates a CUDA context: a context in the notebook's process
holds GPU memory for as long as the kernel lives, and a process that has
initialised CUDA cannot safely fork. GPUs are counted with ``nvidia-smi``.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass

SMOKE_ENV = "LABKIT_SMOKE"
RANKS_ENV = "LABKIT_RANKS"
DEFAULT_CPU_RANKS = 2


def is_smoke() -> bool:
    """True when ``LABKIT_SMOKE`` asks for smoke mode: tiny data, few steps, 2 ranks at most.

    CI sets it; a learner may too, for a quick first pass through a lesson.

    Example (every lesson's first cell)::

        SMOKE = labkit.is_smoke()
    """
    return os.environ.get(SMOKE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def cpu_ranks() -> int:
    """How many CPU ranks a lesson launches where it has no GPU for every rank: ``LABKIT_RANKS``,
    else 2. ``make test-scale`` sets 4, so that every lesson and check is proven at the sizes
    learners run (two nodes of two, a 2 x 2 mesh, four pipeline stages); in smoke mode it also
    caps how many GPUs a lesson uses.

    Raises:
        ValueError: ``LABKIT_RANKS`` is set but is not an int >= 1.

    Example::

        LABKIT_RANKS=4 LABKIT_SMOKE=1 jupyter lab    # every lesson on 4 CPU ranks
    """
    text = os.environ.get(RANKS_ENV, "").strip()
    if not text:
        return DEFAULT_CPU_RANKS
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{RANKS_ENV} must be a whole number of ranks >= 1, got {text!r}. "
                         f"HINT: unset it for {DEFAULT_CPU_RANKS} ranks, or e.g. {RANKS_ENV}=4.")
    return int(text)


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
    """How many GPUs launches can use (CUDA_VISIBLE_DEVICES applied; no CUDA context made).

    Example::

        labkit.gpu_count()          # 0 on a laptop without an NVIDIA GPU
    """
    return len(gpus())


def cpu_count() -> int:
    """CPU cores this process may run on (the affinity mask, not the machine's total)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def describe() -> dict:
    """What a run or sweep records of this machine: CPU cores, platform and the visible GPUs."""
    return {"cpu_count": cpu_count(), "platform": sys.platform, "gpus": [asdict(g) for g in gpus()]}


#: CPU instructions that speed up bfloat16 maths, as Linux's /proc/cpuinfo names them.
BF16_FLAGS = {
    "amx_bf16": "AMX-BF16 (matrix tiles in bf16)",
    "avx512_bf16": "AVX-512 BF16 (bf16 dot products)",
    "avx_ne_convert": "AVX-NE-CONVERT (bf16 conversions)",
}


def cpu_flags(cpuinfo: str | None = None) -> set[str] | None:
    """The CPU's feature flags (Linux: /proc/cpuinfo; Apple silicon: sysctl), or None if unknown.

    Args:
        cpuinfo: the text of /proc/cpuinfo to read instead (tests).
    """
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            return _sysctl_flags()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):  # x86, ARM
            return set(value.split())
    return None


def _sysctl_flags() -> set[str] | None:
    """macOS on Apple silicon: hw.optional.arm.FEAT_BF16 = 1 means bf16 instructions."""
    exe = shutil.which("sysctl")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "-n", "hw.optional.arm.FEAT_BF16"], capture_output=True,
                             text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return {"bf16"} if out == "1" else set() if out == "0" else None


def cpu_bf16(flags: set[str] | None = None) -> list[str]:
    """What this CPU offers bfloat16, in words (lesson 08 times bf16 autocast on it); [] for
    nothing found. Without such instructions, bf16 on the CPU is emulated and may be slower
    than float32."""
    flags = cpu_flags() if flags is None else flags
    found = [words for flag, words in BF16_FLAGS.items() if flag in (flags or ())]
    if "bf16" in (flags or ()):  # ARM: FEAT_BF16 (Linux "bf16", macOS sysctl)
        found.append("ARM BF16 (bf16 dot products and matrix multiply)")
    return found


#: Dense peak TFLOP/s (no sparsity) from NVIDIA's datasheets, by the maths a model runs in:
#: "fp32" on CUDA cores; "tf32", float32 convolutions and matmuls on tensor cores (cuDNN's
#: default for convolutions); "bf16" under bf16 autocast. Lesson 08 divides by it for MFU.
DATASHEET_TFLOPS = {
    "A100": {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0},
    "H100 SXM": {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4},
    "H100 PCIe": {"fp32": 51.2, "tf32": 378.0, "bf16": 756.0},
    "H200 SXM": {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4},
    "L4": {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0},
}


def datasheet_model(gpu_name: str) -> str | None:
    """The DATASHEET_TFLOPS entry for a GPU as nvidia-smi names it ("NVIDIA H100 80GB HBM3"),
    or None for a GPU the table does not know (then measure its peak instead)."""
    name = gpu_name.upper().replace("-", " ")
    if "H100" in name:
        return "H100 PCIe" if "PCIE" in name else None if "NVL" in name else "H100 SXM"
    if "H200" in name:
        return None if "NVL" in name else "H200 SXM"
    if "A100" in name:
        return "A100"
    if re.search(r"\bL4\b", name):
        return "L4"
    return None


def datasheet_tflops(gpu_name: str, precision: str = "tf32") -> float | None:
    """A GPU's dense peak TFLOP/s from its datasheet, or None when the table does not know it.

    Args:
        gpu_name: the name nvidia-smi (or ``torch.cuda.get_device_name``) reports.
        precision: "fp32", "tf32" or "bf16".

    Raises:
        ValueError: an unknown precision.

    Example (lesson 08)::

        labkit.datasheet_tflops("NVIDIA A100-SXM4-80GB")   # 156.0 (TF32 tensor cores)
    """
    if precision not in ("fp32", "tf32", "bf16"):
        raise ValueError(f"precision must be 'fp32', 'tf32' or 'bf16', got {precision!r}")
    model = datasheet_model(gpu_name)
    return None if model is None else DATASHEET_TFLOPS[model][precision]


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
