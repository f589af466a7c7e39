"""Shared fixtures: a scratch folder with tiny scripts, and a check that no rank outlives a test."""

from __future__ import annotations

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
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible on this machine")
    for item in items:
        if "gpu" in item.keywords:
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
