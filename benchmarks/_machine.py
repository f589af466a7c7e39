"""One line that says what machine a benchmark ran on, for its report.

Timings mean little without it: the CPU model (from /proc/cpuinfo on Linux), the cores
this process may use, Python and PyTorch versions, and the load average, since a
benchmark on a busy machine measures the other work too.
"""
from __future__ import annotations

import os
import platform
import sys
from labkit import _hardware
from labkit._launch.command import _torch_version


def cpu_model() -> str:
    """'AMD EPYC (family 26, model 2)': the model name, with family and model when known."""
    fields = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor is enough
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        return platform.processor() or platform.machine()
    name = fields.get("model name", platform.machine())
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return name


def describe() -> str:
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    return (f"{cpu_model()}, {_hardware.cpu_count()} CPU cores, {_hardware.gpu_count()} GPU(s); "
            f"{platform.system()}, Python {sys.version.split()[0]}, "
            f"torch {_torch_version()}; load average {load} (1, 5, 15 min)")
