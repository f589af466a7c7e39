"""labkit.doctor: what this machine offers the course, checked, in one table (lesson 00)."""

from __future__ import annotations

import html
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from labkit import _hardware
from labkit._course.folder import find_root, package_root

_REPO = Path(__file__).resolve().parents[2]


@dataclass
class Check:
    what: str
    value: str
    status: str = "ok"   # "ok", "info" or "warn"
    advice: str = ""


@dataclass
class Checks:
    """Rows of checks: a table in Jupyter, text elsewhere; ``ok`` when none warns.

    Example::

        report = labkit.doctor()          # or labkit.preflight(nnodes=2)
        report.ok, [c.what for c in report.checks if c.status == "warn"]
    """

    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when nothing needs fixing (warnings mean: read the advice)."""
        return all(c.status != "warn" for c in self.checks)

    def __getitem__(self, what: str) -> Check:
        for check in self.checks:
            if check.what == what:
                return check
        raise KeyError(what)

    def __str__(self) -> str:
        width = max((len(c.what) for c in self.checks), default=0)
        mark = {"ok": "✓", "info": "·", "warn": "!"}
        lines = [f"{mark[c.status]} {c.what:<{width}}  {c.value}"
                 + (f"\n  {'':<{width}}  → {c.advice}" if c.advice else "") for c in self.checks]
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        color = {"ok": "#1a7f37", "info": "#57606a", "warn": "#bc4c00"}
        rows = "".join(
            f"<tr><td style='color:{color[c.status]}'>{c.status}</td><td>{html.escape(c.what)}</td>"
            f"<td style='text-align:left'>{html.escape(c.value)}"
            + (f"<br><i>{html.escape(c.advice)}</i>" if c.advice else "") + "</td></tr>"
            for c in self.checks)
        return ("<table><thead><tr><th></th><th>check</th><th style='text-align:left'>found</th>"
                f"</tr></thead><tbody>{rows}</tbody></table>")


@dataclass(repr=False)
class Report(Checks):
    """What ``labkit.doctor()`` found. Renders as a table in Jupyter, as text elsewhere.

    Attributes:
        checks: the rows.
        device: "cuda" or "cpu", what launches will use.
        backend: "nccl" or "gloo".
        nproc: ranks a launch uses by default.
        gpus: the visible GPUs.
        dataset: "CIFAR-10" or "synthetic".

    Example (lesson 00)::

        report = labkit.doctor()
        report.ok, report.device, report["CPU cores"].value
    """

    device: str = "cpu"
    backend: str = "gloo"
    nproc: int = 2
    gpus: list = field(default_factory=list)
    dataset: str = "synthetic"


def _topology() -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        return subprocess.run([exe, "topo", "-m"], capture_output=True, text=True,
                              timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _data_dirs(data_dir) -> list[Path]:
    """Where lessons look for CIFAR-10: ``data/`` next to the notebook that runs (the folder a
    launch starts in), so both this folder's and the course's lesson folder's."""
    if data_dir is not None:
        return [Path(data_dir)]
    return list(dict.fromkeys([Path("data").resolve(), (_REPO / "notebooks" / "data").resolve()]))


def _driver_cuda() -> str | None:
    """The newest CUDA the NVIDIA driver supports ("12.4"), from nvidia-smi; None without one."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"CUDA Version:\s*(\d+\.\d+)", out)
    return found[1] if found else None


def cuda_driver_check(build: str | None, driver: str | None) -> Check:
    """Does the driver run this PyTorch's CUDA build? A driver older than the build's major
    version cannot; an older minor version usually can (CUDA's minor version compatibility)."""
    if not build or not driver:
        return Check("CUDA driver", driver or "not found", "info")
    have, need = (tuple(int(x) for x in v.split(".")[:2]) for v in (driver, build))
    if have >= need:
        return Check("CUDA driver", f"supports CUDA {driver}; PyTorch is built for {build}")
    if have[0] == need[0]:
        return Check("CUDA driver", f"supports CUDA {driver}; PyTorch is built for {build}", "info",
                     "an older minor version usually works; if kernels fail to load, update the "
                     "driver or install PyTorch built for your CUDA")
    return Check("CUDA driver", f"supports CUDA {driver}, but PyTorch is built for {build}", "warn",
                 f"every GPU launch will fail: update the NVIDIA driver, or install a PyTorch built "
                 f"for CUDA {driver} or older (README: the TORCH= option of make)")


def environment_check(course: Path | None = None, imported: Path | None = None) -> Check:
    """Is this kernel the course's? The labkit it imported must be the course folder's own.

    A kernel from another environment imports another copy of labkit (another clone's, or one
    installed without ``-e``), whose checks and hints may not match these notebooks.

    Args:
        course: the course folder (default: the one the kernel runs in, found from its folder).
        imported: the folder that holds the imported labkit (default: this one's).
    """
    course = find_root() if course is None else course
    imported = package_root() if imported is None else imported
    if course is None:
        return Check("course environment", f"{sys.prefix}; labkit from {imported}", "info",
                     "not run from inside a course folder: nothing to compare labkit's folder with")
    if Path(imported).resolve() == Path(course).resolve():
        return Check("course environment", f"{sys.prefix}; labkit from this course's folder")
    return Check("course environment", f"{sys.prefix}; labkit from {imported}, not from {course}",
                 "warn", f"this kernel runs another environment's labkit: start JupyterLab with "
                         f"`make lab` in {course}, or pick the kernel of {Path(course) / '.venv'}")


def cpu_bf16_check(flags: set[str] | None, capability: str | None) -> Check:
    """Does the CPU have bfloat16 (or AMX) instructions? bf16 autocast is fast only with them."""
    used = f"; PyTorch's CPU kernels use {capability}" if capability else ""
    if flags is None:
        return Check("CPU bf16", f"unknown (no CPU flags to read){used}", "info")
    found = _hardware.cpu_bf16(flags)
    x86 = "sse2" in flags
    if found:
        no_amx = "; no AMX" if x86 and "amx_bf16" not in flags else ""
        return Check("CPU bf16", f"{', '.join(found)}{no_amx}{used}", "info")
    return Check("CPU bf16", f"no bf16 {'or AMX ' if x86 else ''}instructions found{used}", "info",
                 "bf16 autocast on this CPU is emulated and may be slower than float32 (lesson 08 "
                 "measures it)")


def launch_check(timeout_s: float = 120) -> Check:
    """Launch a tiny all-reduce on the ranks lessons use: loopback, rendezvous and backend in one."""
    from labkit._errors import LabkitError
    from labkit._launch.launch import launch

    script = Path(__file__).resolve().parents[1] / "_rank" / "selftest.py"
    with tempfile.TemporaryDirectory(prefix="labkit-doctor-") as runs:  # leaves nothing behind
        try:
            run = launch(script, timeout_s=timeout_s, name="doctor", quiet=True, runs_dir=runs)
            sums = run.metrics()["rank_sum"].dropna().tolist()
        except LabkitError as err:
            lines = [line for line in str(err).splitlines() if line.strip()]
            return Check("a first launch", "failed", "warn", " ".join(lines[:3])[:400])
    expected = run.nproc * (run.nproc - 1) / 2
    if len(sums) != run.nproc or any(v != expected for v in sums):
        return Check("a first launch", f"the ranks' all-reduce gave {sums}, not {expected:g} on each",
                     "warn", "the backend returned a wrong sum: check the installation of PyTorch")
    return Check("a first launch", f"{run.nproc} rank(s) on {run.info.get('device', '?').upper()} "
                                   f"all-reduced correctly in {run.wall_s:.1f} s")


def _backend_checks(gpus: list) -> list[Check]:
    """NCCL (its version, without a CUDA context) and gloo: the two backends lessons use."""
    import torch
    import torch.distributed as dist

    nccl = dist.is_nccl_available()
    nccl_text = "available" if nccl else "not in this build"
    if nccl and gpus:
        version = torch.cuda.nccl.version()  # reads the library version; no CUDA context
        nccl_text = "available, " + ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    if not gpus:  # present or not, NCCL needs GPUs: on this machine it plays no part
        found = [Check("NCCL", f"{nccl_text} (NCCL needs GPUs: not used here)", "info")]
    else:
        found = [Check("NCCL", nccl_text, "ok" if nccl else "warn",
                       "" if nccl else "GPUs without NCCL: install a CUDA build of PyTorch")]
    gloo = dist.is_gloo_available()
    return found + [Check("gloo", "available" if gloo else "missing", "ok" if gloo else "warn")]


def doctor(data_dir: str | os.PathLike | None = None, *, launch: bool = False) -> Report:
    """Check this machine for the course; returns a Report (a table in Jupyter).

    Reports Python, torch, CUDA (the build and what the driver supports), NCCL and
    gloo, the GPUs (and their topology), the CPU cores, whether this kernel runs the
    course folder's own labkit (a kernel from another environment does not), the backend and nproc that launches will use, and
    which data set lessons get. It never creates a CUDA context in this process.

    Args:
        data_dir: where to look for CIFAR-10 (default: ``data/`` here and in ``notebooks/``).
        launch: also launch a tiny all-reduce on those ranks (a few seconds): the seat
            check of a workshop (``make doctor``).

    Example (lesson 00)::

        report = labkit.doctor()
        report
    """
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch

    from labkit._launch.plan import default_nproc
    from labkit.data import cifar10_on_disk  # torch is loaded by now; labkit.data needs it

    report = Report()
    add = report.checks.append
    add(Check("Python", f"{sys.version.split()[0]} ({platform.platform(terse=True)})",
              "ok" if sys.version_info >= (3, 11) else "warn",
              "" if sys.version_info >= (3, 11) else "the course needs Python 3.11 or newer"))
    add(Check("PyTorch", torch.__version__))
    add(environment_check())
    gpus = _hardware.gpus()
    report.gpus = gpus
    cuda_build = torch.version.cuda
    add(Check("CUDA (build)", cuda_build or "none (CPU-only build)", "info"))
    if gpus:
        add(cuda_driver_check(cuda_build, _driver_cuda()))
        for g in gpus:
            add(Check(f"GPU {g.index}", f"{g.name}, {g.memory_mib / 1024:.0f} GiB"))
        topo = _topology()
        if topo and len(gpus) > 1:
            add(Check("GPU topology", topo, "info"))
    else:
        add(Check("GPUs", "none visible: lessons run on CPU ranks with gloo", "info"))
    report.checks += _backend_checks(gpus)
    cores = _hardware.cpu_count()
    add(Check("CPU cores", f"{cores} usable by this process", "ok" if cores >= 2 else "warn",
              "" if cores >= 2 else "one core: 2 ranks will share it, so timings mean little"))
    add(cpu_bf16_check(_hardware.cpu_flags(), torch.backends.cpu.get_cpu_capability()))
    report.device = "cuda" if gpus else "cpu"
    report.backend = "nccl" if gpus else "gloo"
    report.nproc = default_nproc()
    smoke = " (smoke mode: LABKIT_SMOKE is set)" if _hardware.is_smoke() else ""
    one_gpu = " (lessons that need several ranks run 2 CPU ranks with gloo instead)" if len(gpus) == 1 else ""
    add(Check("launches will use",
              f"{report.nproc} rank(s) on {report.device.upper()}, backend {report.backend}{smoke}{one_gpu}"))
    found = [d for d in _data_dirs(data_dir) if cifar10_on_disk(d)]
    report.dataset = "CIFAR-10" if found else "synthetic"
    if found:
        add(Check("data", f"CIFAR-10 found in {found[0]}"))
    else:
        add(Check("data", f"CIFAR-10 not on disk (looked in {', '.join(map(str, _data_dirs(data_dir)))}): "
                          f"full runs try to download it, smoke runs and offline machines use the "
                          f"synthetic set", "info"))
    if launch:
        add(launch_check())
    return report
