"""The Makefile's set-up, run by the real make on a stub .venv: nothing is installed.

The stub's `python` writes down each command it is given, so a test sees exactly what
`make` would have pip do, and when.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT

MAKE = shutil.which("make")
pytestmark = pytest.mark.skipif(MAKE is None, reason="needs make, which this machine lacks")
CPU = "torch==2.14.1 torchvision==0.29.1 --index-url https://download.pytorch.org/whl/cpu"


@pytest.fixture
def seat(tmp_path):
    """A course folder with the real Makefile, pyproject.toml and lock, and a stub .venv."""
    for name in ("Makefile", "pyproject.toml", "requirements.lock"):
        shutil.copy(ROOT / name, tmp_path / name)
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text('#!/bin/sh\necho "$*" >> "$(dirname "$0")/../commands.log"\n')
    python.chmod(0o755)
    return tmp_path


def set_up(seat: Path, *variables: str) -> list[str]:
    """Run make's set-up (the stamp `make lab` and `make test` depend on); return the commands
    the stub python was given."""
    log = seat / ".venv" / "commands.log"
    log.unlink(missing_ok=True)
    subprocess.run([MAKE, "-C", str(seat), ".venv/.installed", *variables], check=True,
                   capture_output=True, text=True, timeout=60)
    return log.read_text().splitlines() if log.exists() else []


def test_the_set_up_installs_the_pinned_torch_then_the_course(seat):
    assert set_up(seat) == ["-m pip install --upgrade pip",
                            "-m pip install -c requirements.lock torch==2.14.1 torchvision==0.29.1",
                            "-m pip install -c requirements.lock -e .[test]"]
    assert set_up(seat) == [], "done once, it is not done again"


def test_a_torch_with_its_own_index_is_pinned_from_the_next_step_on(seat):
    """The CPU index holds other versions of torch's dependencies than PyPI: its step is not
    held to the lock, the course's step is, and that brings every package to its locked version."""
    assert set_up(seat, f"TORCH={CPU}")[1:] == [f"-m pip install {CPU}",
                                               "-m pip install -c requirements.lock -e .[test]"]


def test_without_a_lock_the_set_up_still_works(seat):
    (seat / "requirements.lock").unlink()
    assert set_up(seat)[1:] == ["-m pip install torch==2.14.1 torchvision==0.29.1",
                                "-m pip install -e .[test]"]


def test_make_lock_writes_the_lock_with_the_courses_python(seat):
    subprocess.run([MAKE, "-C", str(seat), "lock"], check=True, capture_output=True, timeout=60)
    assert (seat / ".venv" / "commands.log").read_text().splitlines() == ["tools/lock.py requirements.lock"]
    (seat / ".venv" / "bin" / "python").unlink()
    out = subprocess.run([MAKE, "-C", str(seat), "lock"], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "no .venv yet: run make test first" in out.stderr


def test_a_newer_file_with_the_same_content_installs_nothing(seat):
    """A fresh clone next to an existing .venv: every file is newer than the stamp."""
    set_up(seat)
    later = time.time() + 3600
    for name in ("Makefile", "pyproject.toml"):
        (seat / name).write_bytes((seat / name).read_bytes())
        os.utime(seat / name, (later, later))
    assert set_up(seat) == []


def test_a_changed_pyproject_or_torch_installs_again(seat):
    set_up(seat)
    pyproject = seat / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('"pandas",', '"pandas",\n    "rich",'))
    assert set_up(seat) == ["-m pip install --upgrade pip",
                            "-m pip install -c requirements.lock torch==2.14.1 torchvision==0.29.1",
                            "-m pip install -c requirements.lock -e .[test]"]
    assert set_up(seat) == []
    assert set_up(seat, f"TORCH={CPU}")[1] == f"-m pip install {CPU}", "TORCH reaches pip word for word"
    assert set_up(seat, f"TORCH={CPU}") == []
    lock = seat / "requirements.lock"
    lock.write_text(lock.read_text().replace("pandas==", "pandas==0"))
    assert len(set_up(seat, f"TORCH={CPU}")) == 3, "a new lock installs again"


def test_a_wheelhouse_is_installed_from_alone(seat):
    assert set_up(seat, "WHEELS=/media/usb/wheelhouse") == [
        "-m pip install --upgrade --no-index --find-links /media/usb/wheelhouse pip",
        "-m pip install --no-index --find-links /media/usb/wheelhouse -c requirements.lock "
        "torch==2.14.1 torchvision==0.29.1",
        "-m pip install --no-index --find-links /media/usb/wheelhouse -c requirements.lock -e .[test]"]


def test_make_wheelhouse_downloads_torch_from_its_index_and_the_rest_from_pypi(seat):
    subprocess.run([MAKE, "-C", str(seat), "wheelhouse", f"TORCH={CPU}"], check=True,
                   capture_output=True, timeout=60)
    assert (seat / ".venv" / "commands.log").read_text().splitlines() == [
        f"-m pip download -d wheelhouse {CPU}",
        "-m pip download -d wheelhouse --find-links wheelhouse -c requirements.lock pip "
        "setuptools>=77 torch==2.14.1 torchvision==0.29.1 .[test]"]


def test_make_lab_passes_the_cpu_wheels_through(seat):
    """`make -n` prints what `make lab` would run, without running it."""
    out = subprocess.run([MAKE, "-n", "-C", str(seat), "lab", f"TORCH={CPU}"], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    assert f".venv/bin/python -m pip install   {CPU}" in out
    assert ".venv/bin/jupyter lab --ServerApp.root_dir=." in out


def test_make_reads_the_makefile_without_a_warning(seat):
    """Two recipes for one target (a merge can leave both) make GNU make warn and silently run
    only the last: every target the README or CI names must be defined once."""
    out = subprocess.run([MAKE, "-C", str(seat), "-n", "test", "test-scale", "test-repeat", "test-browser",
                          "test-slurm", "lab", "lock"], capture_output=True, text=True, timeout=60)
    assert "warning" not in out.stderr.lower(), out.stderr


def test_make_test_scale_runs_the_lessons_and_checks_at_4_ranks_then_the_launch_tests_at_3(seat):
    set_up(seat)
    (seat / ".venv" / "commands.log").unlink(missing_ok=True)
    subprocess.run([MAKE, "-C", str(seat), "test-scale"], check=True, capture_output=True, timeout=60)
    assert (seat / ".venv" / "commands.log").read_text().splitlines() == [
        "-m pytest --ranks 4 tests/test_notebooks.py::test_executes_in_smoke_mode "
        "tests/test_exercises.py::test_a_solution_passes_every_check",
        "-m pytest -n 2 --ranks 3 -m ranks tests"]


def test_make_test_repeat_runs_the_lessons_that_kill_ranks_in_turn_and_stops_at_the_first_failure(seat):
    set_up(seat)
    log = seat / ".venv" / "commands.log"
    log.unlink(missing_ok=True)
    subprocess.run([MAKE, "-C", str(seat), "test-repeat", "REPEAT=2"], check=True, capture_output=True, timeout=60)
    smoke = "-m pytest -q tests/test_notebooks.py::test_executes_in_smoke_mode[{}]"
    lessons = ["05_checkpointing", "09_multinode", "10_faults"]   # the ones that kill, time out or stop ranks
    assert all((ROOT / "notebooks" / f"{stem}.ipynb").exists() for stem in lessons)
    assert log.read_text().splitlines() == [smoke.format(stem) for stem in lessons] * 2
    log.unlink()
    python = seat / ".venv" / "bin" / "python"
    python.write_text('#!/bin/sh\necho "$*" >> "$(dirname "$0")/../commands.log"\n'
                      'case "$*" in *09_multinode*) exit 1;; esac\n')
    out = subprocess.run([MAKE, "-C", str(seat), "test-repeat", "RANKS=4"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0 and "09_multinode failed in run 1 of 10" in out.stderr
    assert log.read_text().splitlines() == [smoke.format(stem).replace("-q ", "-q --ranks 4 ")
                                            for stem in lessons[:2]]


@pytest.mark.parametrize("target, first_part", [("test-scale", "--ranks 4"), ("test", "not alone")])
def test_a_failed_first_part_still_runs_the_second_and_fails(seat, target, first_part):
    set_up(seat)
    (seat / ".venv" / "commands.log").unlink(missing_ok=True)
    python = seat / ".venv" / "bin" / "python"
    python.write_text('#!/bin/sh\necho "$*" >> "$(dirname "$0")/../commands.log"\n'
                      f'case "$*" in *"{first_part}"*) exit 1;; esac\n')
    out = subprocess.run([MAKE, "-C", str(seat), target], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert len((seat / ".venv" / "commands.log").read_text().splitlines()) == 2


def test_make_test_runs_everything_in_two_workers_then_the_lessons_alone(seat):
    """The lessons are timed against their bar: nothing may run beside them."""
    set_up(seat)
    (seat / ".venv" / "commands.log").unlink(missing_ok=True)
    subprocess.run([MAKE, "-C", str(seat), "test"], check=True, capture_output=True, timeout=60)
    assert (seat / ".venv" / "commands.log").read_text().splitlines() == [
        '-m pytest -n 2 -m not alone', "-m pytest -m alone"]


def test_every_notebook_test_but_the_lessons_own_runs_is_in_the_parallel_pass():
    """Marked `alone`: exactly the tests that run a lesson and time it (its bar, its launches)."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "alone", "tests"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    ids = [line for line in out.stdout.splitlines() if "::" in line]
    tests = {i.split("[")[0] for i in ids}
    assert tests == {f"tests/test_notebooks.py::{name}" for name in (
        "test_executes_in_smoke_mode", "test_a_lesson_launches_at_most_six_runs",
        "test_executes_in_full_mode")}, tests
    lessons = sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert sorted(i for i in ids if "smoke_mode" in i) == [
        f"tests/test_notebooks.py::test_executes_in_smoke_mode[{stem}]" for stem in lessons]
    assert len(ids) == 3 * len(lessons)


def test_ci_runs_the_test_targets_the_readme_says_it_runs():
    """CI runs make test, test-browser, test-slurm and test-scale, each to its end, and the README
    says what each does and that CI runs it."""
    text = (ROOT / ".ci" / "run").read_text()
    assert "for target in test test-browser test-slurm test-scale; do" in text
    readme = (ROOT / "README.md").read_text()
    for target in ("make test-scale", "make test-browser", "make test-slurm"):
        assert target in readme, f"the README does not say what `{target}` does"
    assert "CI runs `make test-scale`" in readme
    assert "CI does not run" not in readme
