"""make test-gpu (tools/gpu_check.py): it skips and says why without a GPU, brings the wheels
it needs, and its rehearsal runs every step's plumbing on CPU ranks on a machine without
Jupyter, as the GPU machine is (the heavy part is marked launch)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import gpu_check  # noqa: E402
import gpu_steps  # noqa: E402

#: A machine without Jupyter: these cannot be imported, by the check nor by its ranks.
NO_JUPYTER = '''
import importlib.abc, sys
BLOCKED = {"IPython", "ipywidgets", "ipykernel", "jupyter_client", "jupyter_core", "jupyterlab",
           "nbformat", "nbclient", "nbmake", "matplotlib_inline", "notebook"}
class NoJupyter(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (no Jupyter here)", name=name)
sys.meta_path.insert(0, NoJupyter())
'''


@pytest.fixture
def no_jupyter(tmp_path):
    """An environment whose Python (kernel and ranks alike) cannot import Jupyter's packages.
    pytest's plugins are not loaded by entry point: nbmake, which needs Jupyter, is one."""
    folder = tmp_path / "no-jupyter"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(NO_JUPYTER)
    path = os.pathsep.join([str(ROOT), str(folder), os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, PYTHONPATH=path, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", MPLBACKEND="agg")


def _check(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), *args],
                          env=env or dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_without_a_gpu_every_step_says_it_skipped_and_why(tmp_path):
    if gpu_check.no_gpu_reason() is None:
        pytest.skip("a GPU is visible here: make test-gpu runs the steps")
    done = _check("--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert f"{len(gpu_steps.STEPS)} skipped" in done.stdout
    for name, _, _ in gpu_steps.STEPS:
        assert any(line.startswith(name) and "skipped" in line and "no CUDA GPU is visible" in line
                   for line in done.stdout.splitlines()), name
    assert "To check their plumbing on this machine, run `make test-gpu REHEARSE=1`" in done.stdout
    assert "torch " in done.stdout and "GPUs: none" in done.stdout  # what it ran on
    assert (tmp_path / "summary.md").read_text().count("skipped") >= len(gpu_steps.STEPS)


def test_a_gpu_this_python_cannot_use_is_an_error_not_a_skip(monkeypatch):
    """No GPU: nothing to test, exit 0. A GPU, but a Python without torch (or a CPU-only torch):
    the check was meant to run there, so it exits 2 and names what to install."""
    from labkit import _hardware
    monkeypatch.setattr(_hardware, "gpu_count", lambda: 0)
    assert gpu_check.blocker() == ("no CUDA GPU is visible here (nvidia-smi lists none)", 0)
    monkeypatch.setattr(_hardware, "gpu_count", lambda: 1)
    monkeypatch.setattr(gpu_check, "missing_modules", lambda: ["torch", "pandas"])
    reason, code = gpu_check.blocker()
    assert code == 2 and "cannot import torch, pandas. HINT: " in reason and "PYTHON=" in reason
    monkeypatch.setattr(gpu_check, "missing_modules", lambda: [])
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    reason, code = gpu_check.blocker()
    assert code == 2 and "cannot use the GPU" in reason and "HINT: install a CUDA build" in reason
    monkeypatch.setattr(gpu_check, "missing_modules", lambda: ["psutil"])
    assert gpu_check.rehearsal_blocker()[1] == 2 and "PYTHON=.venv/bin/python" in gpu_check.rehearsal_blocker()[0]


def test_an_unknown_step_is_refused_with_the_names():
    done = _check("--only", "doctor,mfuu")
    assert done.returncode == 2 and "unknown step(s) ['mfuu']. HINT: --only takes some of doctor," in done.stderr


def test_a_missing_module_comes_from_its_wheel(tmp_path, monkeypatch):
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "gpucheckfake-1.0-py3-none-any.whl", "w") as wheel:
        wheel.writestr("gpucheckfake/__init__.py", "ANSWER = 42\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "/x")
    notes = gpu_check.bring_wheels(wheels, site, {"gpucheckfake": "gpucheckfake", "gpucheckgone": "gone",
                                                  "json": "json"})
    assert notes == ["gpucheckfake: from gpucheckfake-1.0-py3-none-any.whl",
                     f"gpucheckgone: missing, and no wheel in {wheels} (make gpu-wheels)"]
    import gpucheckfake
    assert gpucheckfake.ANSWER == 42 and os.environ["PYTHONPATH"] == f"{site}{os.pathsep}/x"
    monkeypatch.delitem(sys.modules, "gpucheckfake")


def test_every_step_launches_a_committed_script_with_the_lessons_gpu_arguments():
    """The steps copy each lesson's GPU arguments: if a lesson changes them, this says where."""
    source = (ROOT / "tools" / "gpu_steps.py").read_text()
    for script in {s for s in __import__("re").findall(r'"(scripts/[\w/]+\.py)"', source)}:
        assert (ROOT / "notebooks" / script).is_file(), script
    cells = {nb: "".join("".join(c["source"]) for c in json.loads((ROOT / "notebooks" / nb).read_text())["cells"])
             for nb in ("01_single_device.ipynb", "05_checkpointing.ipynb", "08_speed.ipynb",
                        "11_tensor_parallel.ipynb")}
    for notebook, text in [
        ("01_single_device.ipynb", 'ARGS = ["--epochs", "5"]'),
        ("05_checkpointing.ipynb", 'ACT_WIDTH, ACT_ARGS = 32, ["--batch-sizes", "128,256,512", "--repeats", "20"]'),
        ("08_speed.ipynb", 'WIDTH, BATCH = (8, 32) if SMOKE else (32, 128)'),
        ("08_speed.ipynb", '["--steps", "2", "--repeats", "2"] if SMOKE else ["--steps", "5", "--repeats", "5"]'),
        ("08_speed.ipynb", 'ARGS = COMMON + ["--workers", "2" if DEVICE == "cpu" else "8"]'),
        ("11_tensor_parallel.ipynb", "DIM, DEPTH, STEPS = 1024, max(8, RANKS), 20"),
    ]:
        assert text in cells[notebook], f"{notebook} no longer says {text}: update tools/gpu_steps.py"


@pytest.mark.launch
def test_labkit_imports_and_launches_without_jupyter(workdir, write_script, no_jupyter):
    write_script("where.py", """
        import importlib.util
        try:
            import IPython
        except ImportError:
            print("rank has no IPython", flush=True)
        from labkit import metrics
        metrics.log(0, ok=1)
    """)
    code = textwrap.dedent("""
        import labkit
        try:
            import ipywidgets
        except ImportError:
            print("kernel has no ipywidgets")
        run = labkit.launch("where.py", nproc=1, device="cpu", timeout_s=120)
        print("status", run.status, int(run.metrics()["ok"].sum()))
    """)
    done = subprocess.run([sys.executable, "-c", code], env=no_jupyter, cwd=workdir,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "kernel has no ipywidgets" in done.stdout and "[rank0] rank has no IPython" in done.stdout
    assert "status ok 1" in done.stdout


@pytest.mark.launch
def test_the_rehearsal_runs_every_step_on_cpu_without_jupyter(tmp_path, no_jupyter):
    """Every step's plumbing, as on the GPU machine but on CPU ranks with small sizes: a typo
    in a flag, a column or a check fails here. About 2 minutes on 2 cores."""
    done = _check("--rehearse", "--out", str(tmp_path), env=no_jupyter, timeout=900)
    print(done.stdout[-6000:], done.stderr[-3000:])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = done.stdout.split("found / why", 1)[1]
    for name, _, _ in gpu_steps.STEPS:
        assert any(line.startswith(name) and " rehearsed " in line for line in table.splitlines()), name
    assert f"{len(gpu_steps.STEPS)} rehearsed" in table
    assert (tmp_path / "summary.md").is_file() and list((tmp_path / "runs").iterdir())
