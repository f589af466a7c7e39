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


def _run_of(tmp_path, world_size):
    run_dir = _rundir.create(tmp_path, "fr")
    _rundir.write_json(run_dir / _rundir.RUN_INFO, {"name": "fr", "world_size": world_size})
    prefix = _rundir.flight_prefix(run_dir)
    return run_dir, lambda rank: prefix.with_name(prefix.name + str(rank))


def test_a_rank_stopped_mid_write_is_named_with_its_reason(tmp_path, capsys):
    """A killed rank leaves an empty or cut-short dump, or none: the others are still read,
    and each missing rank is named with why (issue 26: not an EOFError)."""
    run_dir, dump_of = _run_of(tmp_path, world_size=4)
    _dump(dump_of(0), [_entry(1, "all_reduce", 29)])
    dump_of(1).write_bytes(b"")
    whole = pickle.dumps({"entries": [_entry(1, "all_reduce", 29)] * 20})
    dump_of(2).write_bytes(whole[: len(whole) // 2])
    dump_of(3).with_suffix(".tmp").write_bytes(whole[:10])  # a temporary name: not a dump yet
    fr = labkit.flight_records(run_dir)
    assert sorted(set(fr["rank"])) == [0]
    missing = fr.attrs["missing"]
    assert sorted(missing) == [1, 2, 3]
    assert missing[1].startswith("its dump is empty: the rank was stopped before it wrote a byte")
    assert missing[2].startswith(f"its dump is cut short at {len(whole) // 2} bytes")
    assert missing[3].startswith("no dump: it was stopped before it wrote one")
    printed = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in printed] == ["rank 1", "rank 2", "rank 3"]


def test_no_readable_dump_names_every_ranks_reason(tmp_path):
    run_dir, dump_of = _run_of(tmp_path, world_size=2)
    dump_of(0).write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"no flight-recorder dump in .*; rank 0: its "
                                                r"dump is empty.*; rank 1: no dump: .*HINT: .*os.replace"):
        labkit.flight_records(run_dir)


def test_read_dump_says_torn_not_eoferror(tmp_path):
    from labkit._diagnose.flight import TornDump, read_dump
    path = tmp_path / "flight_rank0"
    path.write_bytes(pickle.dumps({"entries": []})[:-3])
    with pytest.raises(TornDump, match=r"cut short at \d+ bytes .*write it under a temporary name"):
        read_dump(path)
