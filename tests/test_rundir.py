"""labkit._rundir: the run folder's one definition, and what a rank pays to import labkit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from labkit import _rundir

# What the course's other tools must never cost a rank before its script runs, nor a notebook
# that only reads a run: torch alone takes a second or more to import.
HEAVY = ("torch", "numpy", "pandas", "matplotlib", "IPython")
# Every module a rank imports before the script runs (python -m labkit._rank.entry SCRIPT), and
# what a torchrun agent runs before torchrun itself (python -m labkit._rank.agent ARGS); the
# rest of labkit/_rank/ is held to the same rule by tests/test_layout.py.
RANK_SIDE = ["labkit", "labkit.metrics", "labkit._rank.entry", "labkit._rank.proc", "labkit._rundir",
             "labkit._rank.layout", "labkit._rank.agent"]


def test_the_layout_is_the_one_reference_runs_are_shipped_in(tmp_path):
    """Exported runs are files on other people's disks: these names are a format, not a detail."""
    d = tmp_path
    assert _rundir.RUN_DIR_ENV == "LABKIT_RUN_DIR"
    assert (_rundir.RUN_INFO, _rundir.SWEEP_INFO, _rundir.DATA_FILE, _rundir.TORCHRUN_LOG) == (
        "run.json", "sweep.json", "data.json", "torchrun.log")
    assert _rundir.metrics_file(d, 3) == d / "metrics" / "rank3.jsonl"
    assert _rundir.pid_file(d, 3) == d / "pids" / "rank3.json"
    assert _rundir.error_file(d, 3, 1) == d / "errors" / "rank3-restart1.json"
    assert _rundir.torchrun_dir(d) == d / "torchrun"


def test_create_makes_unique_folders_with_their_subfolders(tmp_path):
    first = _rundir.create(tmp_path / "runs", "ddp-2")
    second = _rundir.create(tmp_path / "runs", "ddp-2")
    assert first != second and first.name.endswith("-ddp-2")
    assert sorted(p.name for p in first.iterdir()) == ["errors", "metrics", "pids", "torchrun"]
    assert list(_rundir.create(tmp_path / "runs", "sweep-x", subfolders=False).iterdir()) == []


def test_files_are_found_by_rank_and_attempt(tmp_path):
    for attempt, rank in [(1, 0), (0, 1), (0, 0), (1, 1)]:
        log = tmp_path / "torchrun" / "abc_x" / f"attempt_{attempt}" / str(rank) / "stdout.log"
        log.parent.mkdir(parents=True)
        log.write_text("")
    (tmp_path / "torchrun" / "abc_x" / "attempt_0" / "0" / "error.json").write_text("{}")
    assert [(a, r) for a, r, _ in _rundir.rank_logs(tmp_path)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for rank in (0, 10, 2):
        _rundir.pid_file(tmp_path, rank).parent.mkdir(exist_ok=True)
        _rundir.write_json(_rundir.pid_file(tmp_path, rank), {"pid": rank})
    (tmp_path / "pids" / "rank5.json.tmp123").write_text("half a file")
    assert sorted(_rundir.pid_files(tmp_path)) == [0, 2, 10]
    _rundir.metrics_file(tmp_path, 1).parent.mkdir()
    for rank in (1, 0):
        _rundir.metrics_file(tmp_path, rank).write_text("")
    assert [p.name for p in _rundir.metrics_files(tmp_path)] == ["rank0.jsonl", "rank1.jsonl"]


def test_write_json_leaves_no_temporary_file(tmp_path):
    _rundir.write_json(tmp_path / "run.json", {"a": 1, "when": tmp_path}, indent=2)
    assert json.loads((tmp_path / "run.json").read_text()) == {"a": 1, "when": str(tmp_path)}
    assert os.listdir(tmp_path) == ["run.json"]


def test_read_info_says_what_the_folder_lacks(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"is not a run folder: it has no run.json. HINT: look"):
        _rundir.read_info(tmp_path, "run.json", kind="run", hint="look elsewhere")
    (tmp_path / "run.json").write_text('{"name": "r"}')
    assert _rundir.read_info(tmp_path, "run.json", kind="run", hint="") == {"name": "r"}


def test_a_missing_or_garbled_data_note_reads_as_none(tmp_path):
    assert _rundir.read_data_note(tmp_path) is None
    (tmp_path / "data.json").write_text("[1, 2]")
    assert _rundir.read_data_note(tmp_path) is None
    (tmp_path / "data.json").write_text('{"source": "synthetic"}')
    assert _rundir.read_data_note(tmp_path) == {"source": "synthetic"}


# -- what importing costs --------------------------------------------------------------------
def imported_by(code: str, cwd=None) -> list[str]:
    """The top-level packages that ``code`` imports in a fresh interpreter (those that were
    already loaded when it started, by site or a .pth file, do not count)."""
    probe = ("import json, sys\n_before = set(sys.modules)\n" + code + "\n"
             "print(json.dumps(sorted({m.split('.')[0] for m in set(sys.modules) - _before})))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=cwd)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", RANK_SIDE)
def test_what_a_rank_imports_before_its_script_is_standard_library_only(module):
    new = imported_by(f"import {module}")
    assert not [m for m in HEAVY if m in new], f"importing {module} loads {new}"
    outside = [m for m in new if m not in sys.stdlib_module_names and m != "labkit"]
    assert not outside, f"{module} must use the standard library only, but imports {outside}"


def test_a_notebook_reads_a_run_without_importing_torch(tmp_path):
    run_dir = tmp_path / "runs" / "r"
    _rundir.metrics_file(run_dir, 0).parent.mkdir(parents=True)
    _rundir.metrics_file(run_dir, 0).write_text('{"rank": 0, "step": 1, "time": 1.0, "restart": 0}\n')
    (run_dir / "run.json").write_text('{"name": "r", "command": "", "nproc": 1}')
    (run_dir / "data.json").write_text('{"source": "synthetic"}')
    new = imported_by("import labkit\n"
                      "run = labkit.Run.load('runs/r')\n"
                      "assert run.data == 'synthetic', run.data\n"
                      "assert labkit.Run.load(run.export('shipped').run_dir).data == 'synthetic'\n"
                      "import labkit._launch.launch, labkit._launch.sweep, labkit._diagnose.doctor, "
                      "labkit._launch.supervise, labkit._launch.sbatch, labkit._results.elastic",
                      cwd=tmp_path)
    assert "torch" not in new, f"reading a run imported {[m for m in HEAVY if m in new]}"
