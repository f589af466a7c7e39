"""labkit.metrics: the script-side logger."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import textwrap

import pytest


@pytest.fixture
def metrics(tmp_path, monkeypatch):
    """A fresh labkit.metrics logging into tmp_path as rank 1 of 2."""
    monkeypatch.setenv("LABKIT_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    import labkit.metrics as module
    module = importlib.reload(module)
    yield module
    if module._sink is not None:
        module._sink.file.close()


def read_lines(tmp_path, rank=1):
    return [json.loads(line) for line in (tmp_path / "metrics" / f"rank{rank}.jsonl").read_text().splitlines()]


def test_log_writes_one_stamped_line_per_call(metrics, tmp_path):
    metrics.log(0, loss=2.5, samples=64)
    metrics.log(10, loss=1.25, samples=64, note="ok")
    metrics.flush()
    first, second = read_lines(tmp_path)
    assert first["rank"] == 1 and first["world_size"] == 2 and first["restart"] == 3
    assert first["step"] == 0 and first["loss"] == 2.5 and first["samples"] == 64
    assert second["step"] == 10 and second["note"] == "ok"
    assert second["time"] >= first["time"] > 1e9


def test_tensors_become_numbers_and_nan_is_kept(metrics, tmp_path):
    import torch
    metrics.log(1, loss=torch.tensor(0.5), bad=float("nan"))
    metrics.flush()
    (line,) = read_lines(tmp_path)
    assert line["loss"] == 0.5
    assert line["bad"] != line["bad"]  # NaN stays a NaN: a diverging loss must show


def test_non_numbers_are_refused_with_a_hint(metrics):
    with pytest.raises(TypeError, match=r"metrics.log\(loss=...\) got a list.*HINT"):
        metrics.log(1, loss=[1.0, 2.0])


def test_lines_reach_disk_without_an_explicit_flush(metrics, tmp_path):
    """A rank that logs and then hangs must still show where it got to."""
    import time
    metrics.log(7, loss=1.0)
    deadline = time.time() + 3
    path = tmp_path / "metrics" / "rank1.jsonl"
    while time.time() < deadline and not (path.exists() and path.read_text()):
        time.sleep(0.05)
    assert json.loads(path.read_text())["step"] == 7


def test_without_a_run_folder_it_writes_nothing(tmp_path):
    code = textwrap.dedent("""
        import os
        os.environ.pop("LABKIT_RUN_DIR", None)
        from labkit import metrics
        metrics.log(0, loss=1.0)
        print(metrics.enabled())
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "False"
    assert list(tmp_path.iterdir()) == []
