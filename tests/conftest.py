"""Shared fixtures: a scratch folder with tiny scripts, and a check that no rank outlives a test."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _has_gpu() -> bool:
    from labkit import _hardware
    return _hardware.gpu_count() > 0


def pytest_collection_modifyitems(config, items):
    skips = {}
    if not _has_gpu():
        skips["gpu"] = pytest.mark.skip(reason="needs a CUDA GPU; none is visible on this machine")
    if not (ROOT / "solutions").is_dir():  # a workshop's hand-out, without the answers
        skips["solutions"] = pytest.mark.skip(reason="needs solutions/, which this copy of the course leaves out")
    for item in items:
        for marker, skip in skips.items():
            if marker in item.keywords:
                item.add_marker(skip)


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A fresh folder as the current directory; scripts and runs/ go here."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def write_script(workdir):
    """write_script("name.py", source) -> path: a dedented script in the work folder."""
    def write(name: str, source: str) -> str:
        path = workdir / name
        path.write_text(textwrap.dedent(source).lstrip())
        return name
    return write


def entry_processes() -> list[str]:
    """Command lines of labkit rank processes still running on this machine."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines()
            if "labkit._entry" in line and "ps -eo" not in line]


def python(code: str, **kwargs) -> subprocess.Popen:
    """Start `python -c code` (this interpreter) in its own session."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)],
                            start_new_session=True, **kwargs)


def copy_folder(name: str, dest: Path) -> Path:
    """A copy of ROOT/name (without runs, data or checkpoints) for nbmake to overwrite."""
    target = dest / name
    if not (ROOT / name).is_dir():  # solutions/ in a hand-out: the tests that need it are skipped
        return target
    shutil.copytree(ROOT / name, target,
                    ignore=shutil.ignore_patterns("runs", "data", ".ipynb_checkpoints", "backup"))
    return target


def execute(notebook: Path, *, timeout: int = 300) -> list[dict]:
    """Execute ``notebook`` in place with nbmake in smoke mode; return its executed cells.

    Fails the test with the end of nbmake's report if a cell raised, and names any code
    cell that never ran. MPLBACKEND is unset
    so that charts are kept as images, as in JupyterLab.
    """
    env = dict(os.environ, LABKIT_SMOKE="1")
    env.pop("MPLBACKEND", None)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbmake",
         "--overwrite", f"--nbmake-timeout={timeout}", str(notebook)],
        cwd=notebook.parent, env=env, capture_output=True, text=True, timeout=3 * timeout,
    )
    assert result.returncode == 0, f"nbmake failed on {notebook.name}:\n{result.stdout[-6000:]}"
    cells = json.loads(notebook.read_text())["cells"]
    # An IPython UsageError (e.g. an empty %%writefile cell) goes to stderr and stops the
    # notebook there, yet nbmake reports a pass: every code cell must have run.
    never_ran = [i for i, cell in enumerate(cells)
                 if cell["cell_type"] == "code" and cell.get("execution_count") is None]
    assert not never_ran, f"{notebook.name}: code cells {never_ran} never ran"
    return cells
