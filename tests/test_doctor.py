"""labkit.doctor: a report of the machine, without a CUDA context."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

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
    assert report["NCCL"].status == "info" and "not used here" in report["NCCL"].value
    assert "CIFAR-10 not on disk" in report["data"].value
    html = report._repr_html_()
    assert "<table>" in html and "PyTorch" in html
    assert "✓ PyTorch" in str(report)


def _cifar_files(data_dir):
    """torchvision's CIFAR-10 file names in data_dir (contents do not matter to the doctor)."""
    from labkit.data import CIFAR_FILES, CIFAR_FOLDER

    (data_dir / CIFAR_FOLDER).mkdir(parents=True)
    for name in CIFAR_FILES:
        (data_dir / CIFAR_FOLDER / name).write_bytes(b"x")


def test_cifar_on_disk_is_reported(tmp_path):
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "cifar-10-batches-py").mkdir()
    (tmp_path / "half" / "cifar-10-batches-py" / "data_batch_1").write_bytes(b"x")  # extraction cut short
    assert labkit.doctor(data_dir=tmp_path / "half").dataset != "CIFAR-10"
    _cifar_files(tmp_path)
    assert labkit.doctor(data_dir=tmp_path).dataset == "CIFAR-10"


def test_smoke_mode_is_visible(monkeypatch, tmp_path):
    monkeypatch.setenv("LABKIT_SMOKE", "1")
    assert "smoke mode" in labkit.doctor(data_dir=tmp_path)["launches will use"].value


def test_one_gpu_says_that_multi_rank_lessons_use_cpu_ranks(monkeypatch, tmp_path):
    from labkit._diagnose import doctor as _doctor

    monkeypatch.setattr(_hardware, "gpus", lambda: [_hardware.Gpu(0, "Fake", 16384)])
    monkeypatch.setattr(_doctor, "_driver_cuda", lambda: None)
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)  # no version query on a CPU build
    monkeypatch.delenv("LABKIT_SMOKE", raising=False)
    report = labkit.doctor(data_dir=tmp_path)
    assert report.device == "cuda" and report.nproc == 1
    assert "2 CPU ranks" in report["launches will use"].value
    assert report["NCCL"].status == "warn", "a GPU without NCCL is worth a warning"


@pytest.mark.gpu  # on a CPU-only build CUDA can never be initialised: only a GPU box can fail this
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


def test_by_default_cifar_is_looked_for_where_the_lessons_keep_it(monkeypatch, tmp_path):
    from labkit._diagnose import doctor as _doctor

    monkeypatch.chdir(tmp_path)  # e.g. `make doctor` at the course's root
    lessons = tmp_path / "course"
    _cifar_files(lessons / "notebooks" / "data")
    monkeypatch.setattr(_doctor, "_REPO", lessons)
    report = labkit.doctor()
    assert report.dataset == "CIFAR-10" and "notebooks/data" in report["data"].value


@pytest.mark.parametrize("build, driver, status, words", [
    ("12.6", "12.8", "ok", "supports CUDA 12.8; PyTorch is built for 12.6"),
    ("12.8", "12.4", "info", "an older minor version usually works"),
    ("13.0", "12.4", "warn", "every GPU launch will fail"),
    (None, "12.4", "info", ""),
])
def test_the_driver_is_compared_with_pytorchs_cuda(build, driver, status, words):
    from labkit._diagnose.doctor import cuda_driver_check

    check = cuda_driver_check(build, driver)
    assert check.status == status and words in check.value + check.advice


@pytest.mark.launch
def test_the_seat_check_launches_a_real_all_reduce(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(_hardware, "gpus", lambda: [])
    report = labkit.doctor(data_dir=tmp_path, launch=True)
    assert report["a first launch"].status == "ok", report
    assert "2 rank(s) on CPU all-reduced correctly" in report["a first launch"].value
    assert not (tmp_path / "runs").exists(), "the seat check leaves no run folder behind"


def test_a_seat_whose_launch_fails_gets_a_warning(monkeypatch):
    from labkit import LaunchError
    from labkit._launch import launch as _launch

    def broken(*args, **kwargs):
        raise LaunchError("rank 0 failed: RuntimeError: connection refused\nHINT: a firewall?")
    monkeypatch.setattr(_launch, "launch", broken)
    check = labkit._diagnose.doctor.launch_check()
    assert check.status == "warn" and "connection refused" in check.advice


# -- is the kernel's labkit this course's? ------------------------------------------------------------
def _copy_of_the_course(folder):
    """A folder that looks like a copy of the course: labkit/ and exercises/."""
    (folder / "labkit").mkdir(parents=True)
    (folder / "labkit" / "__init__.py").write_text("")
    (folder / "exercises").mkdir()
    return folder


def test_the_course_environment_is_this_courses_labkit(monkeypatch):
    from conftest import ROOT

    monkeypatch.chdir(ROOT / "notebooks")  # where a lesson's kernel runs
    check = labkit._diagnose.doctor.environment_check()
    assert check.status == "ok" and "labkit from this course's folder" in check.value, check


def test_a_kernel_with_another_copys_labkit_gets_a_warning(monkeypatch, tmp_path):
    other = _copy_of_the_course(tmp_path / "my-course")
    (other / "notebooks").mkdir()
    monkeypatch.chdir(other / "notebooks")  # this course's lessons, but labkit comes from elsewhere
    check = labkit._diagnose.doctor.environment_check()
    assert check.status == "warn", check
    assert f"not from {other}" in check.value and "`make lab`" in check.advice
    assert not labkit.doctor(data_dir=tmp_path).ok, "make doctor fails on it"


def test_outside_a_course_there_is_nothing_to_compare(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    check = labkit._diagnose.doctor.environment_check()
    assert check.status == "info" and "not run from inside a course folder" in check.advice


def test_another_environments_labkit_is_caught_in_a_real_kernel(tmp_path):
    """A second interpreter whose labkit is another copy's, started in this course's lessons."""
    from conftest import ROOT

    other = tmp_path / "elsewhere"
    shutil.copytree(ROOT / "labkit", other / "labkit", ignore=shutil.ignore_patterns("__pycache__"))
    code = ("import labkit, labkit._diagnose.doctor as d; c = d.environment_check(); "
            "print(labkit.__file__); print(c.status); print(c.value)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT / "notebooks", capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(other)}, timeout=60, check=True).stdout.splitlines()
    assert out[0].startswith(str(other)), out
    assert out[1] == "warn" and f"labkit from {other}, not from {ROOT}" in out[2], out


@pytest.mark.parametrize("flags, value, advice", [
    ({"sse2", "avx512_bf16"}, "AVX-512 BF16 (bf16 dot products); no AMX; PyTorch's CPU kernels use AVX512", ""),
    ({"sse2", "amx_bf16", "avx512_bf16"}, "AMX-BF16 (matrix tiles in bf16), AVX-512 BF16 (bf16 dot products); "
                                          "PyTorch's CPU kernels use AVX512", ""),
    ({"sse2", "avx2"}, "no bf16 or AMX instructions found; PyTorch's CPU kernels use AVX512", "may be slower"),
    (None, "unknown (no CPU flags to read); PyTorch's CPU kernels use AVX512", ""),
])
def test_cpu_bf16_row_says_what_the_cpu_offers(flags, value, advice):
    from labkit._diagnose.doctor import cpu_bf16_check

    row = cpu_bf16_check(flags, "AVX512")
    assert row.what == "CPU bf16" and row.value == value and row.status == "info"
    assert advice in row.advice


def test_doctor_reports_the_cpu_bf16_row(tmp_path):
    assert "bf16" in labkit.doctor(data_dir=tmp_path)["CPU bf16"].value
