"""labkit.flight_records: every rank's flight-recorder dump in one table (lesson 10)."""

from __future__ import annotations

import os
import pickle

import pytest

import labkit
from labkit import _rundir


def _entry(seq, op, line, script="/work/scripts/10_hang.py"):
    return {"collective_seq_id": seq, "p2p_seq_id": 0, "is_p2p": False,
            "profiling_name": f"gloo:{op}", "process_group": ("0", "default_pg"),
            "input_sizes": [[4]] if op == "all_reduce" else [],
            "frames": [{"name": op, "filename": "/venv/lib/torch/distributed/distributed_c10d.py", "line": 3913},
                       {"name": "<module>", "filename": script, "line": line}]}


def _dump(path, entries):
    path.write_bytes(pickle.dumps({"version": "2.10", "pg_config": {}, "pg_status": {},
                                   "entries": entries}))


def test_the_dumps_of_every_rank_in_one_table(tmp_path):
    run_dir = _rundir.create(tmp_path, "fr")
    prefix = _rundir.flight_prefix(run_dir)
    _dump(prefix.with_name(prefix.name + "0"), [_entry(1, "all_reduce", 29), _entry(2, "all_reduce", 29)])
    _dump(prefix.with_name(prefix.name + "1"), [_entry(1, "all_reduce", 29), _entry(2, "barrier", 40)])
    (run_dir / "flight_rank_notes.txt").write_text("not a dump")  # not <prefix><rank>: ignored
    fr = labkit.flight_records(run_dir)
    assert list(fr.columns) == ["rank", "seq", "op", "group", "where", "sizes"]
    calls = fr.pivot(index="seq", columns="rank", values="op")
    assert calls.loc[2].tolist() == ["all_reduce", "barrier"]
    assert fr.loc[(fr["rank"] == 1) & (fr["seq"] == 2), "where"].item() == "10_hang.py:40"
    assert set(fr["group"]) == {"default_pg"}


def test_a_dump_that_holds_a_class_is_refused(tmp_path):
    """A dump is plain data: a pickle that would build an object (and so run code) is refused."""
    run_dir = _rundir.create(tmp_path, "fr")
    evil = pickle.dumps({"entries": [os.system]})  # pickles a reference to a function
    _rundir.flight_prefix(run_dir).with_name(_rundir.FLIGHT_PREFIX + "0").write_bytes(evil)
    with pytest.raises(pickle.UnpicklingError, match="plain data only; refused"):
        labkit.flight_records(run_dir)


def test_no_dump_says_how_to_get_one(tmp_path):
    run_dir = _rundir.create(tmp_path, "fr")
    with pytest.raises(FileNotFoundError, match=r"no flight-recorder dump in .*HINT: launch with "
                                                r"env=\{'TORCH_FR_BUFFER_SIZE'"):
        labkit.flight_records(run_dir)


def test_a_launch_points_pytorchs_dump_prefix_into_the_run_folder(tmp_path, monkeypatch):
    from labkit._launch.command import rank_env
    from labkit._launch.plan import Plan
    p = Plan("x.py", 2, "cpu", 1, (), None, 0)
    run_dir = _rundir.create(tmp_path, "fr")
    env = rank_env(p, run_dir, None)
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == str(_rundir.flight_prefix(run_dir.resolve()))
    assert rank_env(p, run_dir, {"TORCH_FR_DUMP_TEMP_FILE": "/x/y_"})["TORCH_FR_DUMP_TEMP_FILE"] == "/x/y_"
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", "/kept/")
    assert rank_env(p, run_dir, None)["TORCH_FR_DUMP_TEMP_FILE"] == "/kept/"
