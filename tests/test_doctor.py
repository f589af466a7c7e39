"""labkit.doctor: a report of the machine, without a CUDA context."""

from __future__ import annotations

import subprocess
import sys

import labkit
from labkit import _hardware


def test_report_on_a_machine_without_gpus(monkeypatch, tmp_path):
    monkeypatch.setattr(_hardware, "gpus", lambda: [])
    monkeypatch.delenv("LABKIT_SMOKE", raising=False)
    report = labkit.doctor(data_dir=tmp_path)
    assert report.device == "cpu" and report.backend == "gloo" and report.nproc == 2
    assert report.dataset == "synthetic"
    assert report["gloo"].value == "available"
    assert report["launches will use"].value == "2 rank(s) on CPU, backend gloo"
    assert "CIFAR-10 not on disk" in report["data"].value
    html = report._repr_html_()
    assert "<table>" in html and "PyTorch" in html
    assert "✓ PyTorch" in str(report)


def test_cifar_on_disk_is_reported(tmp_path):
    (tmp_path / "cifar-10-batches-py").mkdir()
    (tmp_path / "cifar-10-batches-py" / "data_batch_1").write_bytes(b"x")
    assert labkit.doctor(data_dir=tmp_path).dataset == "CIFAR-10"


def test_smoke_mode_is_visible(monkeypatch, tmp_path):
    monkeypatch.setenv("LABKIT_SMOKE", "1")
    assert "smoke mode" in labkit.doctor(data_dir=tmp_path)["launches will use"].value


def test_doctor_never_initialises_cuda():
    code = ("import labkit, torch; labkit.doctor(); "
            "print(torch.cuda.is_initialized())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_cuda_visible_devices_is_applied(monkeypatch):
    monkeypatch.setattr(_hardware, "_query_gpus", lambda: tuple(
        _hardware.Gpu(i, "Fake", 1024) for i in range(4)))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert [g.index for g in _hardware.gpus()] == [0, 2]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert _hardware.gpu_count() == 0
