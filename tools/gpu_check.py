"""make test-gpu: every GPU path of the course that one CUDA GPU can run, in one script, without
Jupyter (issue 26): ``doctor``, the tests marked ``gpu``, and the lessons' GPU paths from their
committed scripts (the steps: ``tools/gpu_steps.py``), then a summary of what ran, what
skipped and why, and the torch, CUDA and GPU it ran on.

    PYTHONPATH=. python3 tools/gpu_check.py               # on the GPU machine (make test-gpu)
    PYTHONPATH=. python3 tools/gpu_check.py --rehearse    # anywhere: every step's plumbing on CPU
    PYTHONPATH=. python3 tools/gpu_check.py --only doctor,mfu --budget-s 300

The GPU machine needs ``python3`` with torch (CUDA), pytest, pandas and matplotlib; no Jupyter,
no network. What else labkit needs (psutil) comes as wheels: ``make gpu-wheels`` downloads
them into ``gpu-wheels/`` here; copy the course folder with it, and the check unpacks each
wheel whose module is missing into ``<out>/site``, first on its path and on the ranks'.

Without a GPU (and without ``--rehearse``) it says so for every step and exits 0. Otherwise
the exit code is 1 when a step failed. The summary is printed and written to
``<out>/summary.md`` (default ``build/gpu-check``), with every run folder in ``<out>/runs``.
Test tooling, not part of labkit.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import subprocess
import sys
import time
import traceback
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: What the GPU machine's Python must have (they are not brought as wheels: torch is its own).
REQUIRED = ("torch", "pytest", "pandas", "matplotlib")
#: What labkit imports beyond those: {module: its wheel's name}.
WHEELS = {"psutil": "psutil"}
BUDGET_S = 450  # under 8 minutes, with room for the start


def bring_wheels(folder: Path, site: Path, needed: dict = WHEELS) -> list[str]:
    """Unpack the wheel of each missing module from ``folder`` into ``site``, and put ``site``
    first on this process's path and on the ranks' (PYTHONPATH); one note per module."""
    notes = []
    for module, name in needed.items():
        if importlib.util.find_spec(module) is not None:
            continue
        found = sorted(folder.glob(f"{name}-*.whl"))
        if not found:
            notes.append(f"{module}: missing, and no wheel in {folder} (make gpu-wheels)")
            continue
        with zipfile.ZipFile(found[-1]) as wheel:
            wheel.extractall(site)
        notes.append(f"{module}: from {found[-1].name}")
    if site.is_dir():
        sys.path.insert(0, str(site))
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(site)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
        importlib.invalidate_caches()
    return notes


@dataclass
class Context:
    """What a step needs: where it runs, on what, and how much time is left."""

    root: Path
    gpu: bool
    runs_dir: Path
    deadline: float

    @property
    def device(self) -> str:
        return "cuda" if self.gpu else "cpu"

    @property
    def launch_device(self) -> str:
        return "auto" if self.gpu else "cpu"

    def left_s(self) -> float:
        return max(5.0, self.deadline - time.monotonic())

    def args(self, gpu_args: list[str], tiny: list[str]) -> list[str]:
        """The lesson's GPU arguments; in a rehearsal, small sizes after them (the last wins)."""
        return list(gpu_args) if self.gpu else [*gpu_args, *tiny]

    def env(self, *, cpu: bool = False) -> dict:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(self.root)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        if cpu:
            env["CUDA_VISIBLE_DEVICES"] = ""
        return env

    def launch(self, script: str, *, nproc: int, args: list[str], name: str):
        import labkit
        return labkit.launch(script, nproc=nproc, device=self.launch_device, args=args, name=name,
                             runs_dir=self.runs_dir, timeout_s=self.left_s())


@dataclass
class Result:
    step: str
    lesson: str
    status: str     # "passed", "failed", "skipped" or "rehearsed"
    seconds: float
    detail: str


def missing_modules() -> list[str]:
    """What this Python cannot import of what the check and labkit need."""
    return [m for m in (*REQUIRED, *WHEELS) if importlib.util.find_spec(m) is None]


def blocker() -> tuple[str, int] | None:
    """Why the GPU steps cannot run here, and the exit code that says it: 0 where there is no
    GPU (nothing to test), 2 where a GPU is there but this Python cannot use it. None: go."""
    from labkit import _hardware
    if _hardware.gpu_count() == 0:
        return "no CUDA GPU is visible here (nvidia-smi lists none)", 0
    missing = missing_modules()
    if missing:
        return (f"{sys.executable} cannot import {', '.join(missing)}. HINT: install them, or name "
                f"a Python that has them: make test-gpu PYTHON=/path/to/python", 2)
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # ask without a CUDA context
    import torch
    if not torch.cuda.is_available():
        return (f"torch {torch.__version__} cannot use the GPU (a CPU-only build, or the driver is "
                f"too old). HINT: install a CUDA build of torch (README: Start)", 2)
    return None


def no_gpu_reason() -> str | None:
    """Why the GPU steps cannot run here (None: a CUDA GPU is there and torch can use it)."""
    found = blocker()
    return found[0] if found else None


def machine() -> list[str]:
    """Lines that say what the check ran on: Python, torch, CUDA, the GPUs and their driver."""
    from labkit import _hardware
    from labkit._diagnose.doctor import _driver_cuda
    if importlib.util.find_spec("torch") is None:
        torch_line = f"torch: {sys.executable} cannot import it"
    else:
        import torch
        torch_line = f"torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}"
    driver = _driver_cuda()
    gpus = ", ".join(f"{g.name} ({g.memory_mib / 1024:.0f} GiB)" for g in _hardware.gpus()) or "none"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() if (ROOT / ".git").exists() else ""
    return [f"Python {platform.python_version()} ({sys.executable}) on {platform.platform(terse=True)}, "
            f"{_hardware.cpu_count()} CPU cores",
            torch_line + (f", driver supports CUDA {driver}" if driver else ", no NVIDIA driver"),
            f"GPUs: {gpus}", f"course: {ROOT}" + (f" at {commit}" if commit else "")]


def rehearsal_blocker() -> tuple[str, int] | None:
    """A rehearsal runs on CPU anywhere this Python has what the steps import."""
    missing = missing_modules()
    if missing:
        return (f"{sys.executable} cannot import {', '.join(missing)}, so it cannot rehearse. HINT: "
                f"name the course's Python: make test-gpu REHEARSE=1 PYTHON=.venv/bin/python", 2)
    return None


def intro(steps, rehearse: bool, reason: str | None) -> str:
    """What this run does, said before it does it."""
    names = "; ".join(name for name, _, _ in steps)
    if reason is None and rehearse:
        return (f"make test-gpu, rehearsal: {len(steps)} steps ({names}) run on CPU ranks with small "
                f"sizes, to check their flags, columns and checks; no GPU is used.")
    if reason is None:
        return f"make test-gpu: {len(steps)} steps ({names}) on the GPU, then a summary."
    lines = [f"make test-gpu: {len(steps)} steps ({names}), each on a CUDA GPU. "
             f"Not {'rehearsed' if rehearse else 'run'} here: {reason}"]
    if not rehearse and reason.startswith("no CUDA GPU"):
        lines.append("Each step is listed below as skipped. To check their plumbing on this machine, "
                     "run `make test-gpu REHEARSE=1` (CPU ranks, small sizes, a few minutes).")
    return "\n".join(lines)


def run_steps(steps, ctx: Context | None, reason: str | None, budget_s: float) -> list[Result]:
    """Each step in turn: passed, failed (its error), or skipped (why)."""
    from gpu_steps import Skip

    results = []
    for number, (name, lesson, step) in enumerate(steps, 1):
        if ctx is None or ctx.deadline - time.monotonic() < 5:
            why = reason or f"out of time: the budget of {budget_s:g} s is spent"
            results.append(Result(name, lesson, "skipped", 0.0, why))
            continue
        print(f"\n=== [{number}/{len(steps)}] {name} (lesson {lesson})", flush=True)
        start = time.monotonic()
        try:
            detail, status = step(ctx), "passed" if ctx.gpu else "rehearsed"
        except Skip as skip:
            detail, status = str(skip), "skipped"
        except Exception as err:  # noqa: BLE001 - a failed step is reported, and the next one runs
            traceback.print_exc()
            detail, status = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"[:300], "failed"
        results.append(Result(name, lesson, status, time.monotonic() - start, detail))
        print(f"{status}: {detail}", flush=True)
    return results


def summary(results: list[Result], header: list[str], mode: str) -> str:
    width = max(len(r.step) for r in results)
    lines = [f"make test-gpu ({mode})", *header, "",
             f"{'step':<{width}}  lesson  {'status':<9}  {'s':>5}  found / why", "-" * (width + 60)]
    lines += [f"{r.step:<{width}}  {r.lesson:^6}  {r.status:<9}  {r.seconds:5.0f}  {r.detail}" for r in results]
    counts = {s: sum(r.status == s for r in results) for s in ("passed", "rehearsed", "failed", "skipped")}
    lines += ["", ", ".join(f"{n} {s}" for s, n in counts.items() if n)]
    return "\n".join(lines)


def parse(argv):
    parser = argparse.ArgumentParser(description="make test-gpu: the course's GPU paths on one GPU")
    parser.add_argument("--rehearse", action="store_true", help="every step's plumbing on CPU, tiny sizes")
    parser.add_argument("--only", default="", help="comma-separated step functions, e.g. doctor,mfu")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="seconds for every step together")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "gpu-check")
    parser.add_argument("--wheels", type=Path, default=ROOT / "gpu-wheels")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    out = args.out.resolve()
    notes = bring_wheels(args.wheels, out / "site")
    sys.path.insert(0, str(ROOT / "tools"))
    from gpu_steps import STEPS

    known = {step.__name__: (name, lesson, step) for name, lesson, step in STEPS}
    chosen = [c for c in args.only.split(",") if c]
    unknown = [c for c in chosen if c not in known]
    if unknown:
        print(f"unknown step(s) {unknown}. HINT: --only takes some of {', '.join(known)}", file=sys.stderr)
        return 2
    steps = [known[c] for c in chosen] or STEPS
    blocked = rehearsal_blocker() if args.rehearse else blocker()
    reason, code = blocked or (None, 0)
    print(intro(steps, args.rehearse, reason), flush=True)
    ctx = None
    if reason is None:
        os.chdir(ROOT / "notebooks")  # where the lessons run: their scripts are scripts/...
        ctx = Context(ROOT, not args.rehearse, out / "runs", time.monotonic() + args.budget_s)
    mode = "not run" if reason else ("rehearsal on CPU" if args.rehearse else "GPU")
    results = run_steps(steps, ctx, reason and reason.split(". HINT")[0], args.budget_s)
    text = summary(results, machine() + [f"wheels: {n}" for n in notes], mode)
    print("\n" + text)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.md").write_text("```\n" + text + "\n```\n")
    print(f"\nsummary written to {out / 'summary.md'}")
    return 1 if any(r.status == "failed" for r in results) else code

if __name__ == "__main__":
    sys.exit(main())
