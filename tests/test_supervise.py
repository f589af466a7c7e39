"""Reading what ranks left behind: stack dumps, peer failures, torchrun's log lines."""

from __future__ import annotations

import json

from labkit import RankFailure
from labkit._supervise import Streams, collect_failures, parse_stack

DUMP = '''Thread 0x00007f7cc4b526c0 (most recent call first):
  File "/x/labkit/_entry.py", line 49 in _watch
  File "/usr/lib/python3.11/threading.py", line 982 in run

Current thread 0x00007f7cc57f6b80 (most recent call first):
  File "/x/torch/distributed/distributed_c10d.py", line 3913 in all_reduce
  File "/x/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "train.py", line 6 in step
  File "train.py", line 11 in <module>
  File "<frozen runpy>", line 88 in _run_code
'''


def test_parse_stack_names_the_scripts_innermost_line_and_the_call(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert parse_stack(DUMP, "train.py") == "train.py:6 in step, inside all_reduce (distributed_c10d.py)"


def test_parse_stack_in_the_scripts_own_code(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    dump = 'Current thread 0x1 (most recent call first):\n  File "train.py", line 3 in <module>\n'
    assert parse_stack(dump, "train.py") == "train.py:3 in <module>"
    assert parse_stack("garbage", "train.py") is None


def test_peer_failures_are_recognised_as_secondary():
    assert RankFailure.looks_secondary("[gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:1")
    assert RankFailure.looks_secondary("NCCL error: remote process exited or there was a network error")
    assert not RankFailure.looks_secondary("ValueError: rank 1 is unhappy")


def test_torchrun_lines_lose_their_log_prefix_and_noise(tmp_path):
    lines = []
    streams = Streams(tmp_path, lines.append)
    streams._torchrun_line("W1122 04:01:27.719000 2582 .venv/x/api.py:753] Received 15 death signal")
    streams._torchrun_line("E1122 04:01:18.192000 2564 x/error_handler.py:157] no error file defined for parent, to copy")
    streams._torchrun_line("Traceback (most recent call last):")
    streams._torchrun_line("  ChildFailedError: ...")
    assert lines == ["[torchrun] warning: Received 15 death signal"]


def test_rank_lines_are_prefixed_across_restarts(tmp_path):
    lines = []
    for attempt in (0, 1):
        folder = tmp_path / "torchrun" / "id_x" / f"attempt_{attempt}" / "1"
        folder.mkdir(parents=True)
        (folder / "stdout.log").write_text(f"attempt {attempt}\nunfinished")
    streams = Streams(tmp_path, lines.append)
    streams.finish()
    assert lines == ["[rank1] attempt 0", "[rank1] unfinished",
                     "── torchrun restarted the workers (restart 1) ──",
                     "[rank1] attempt 1", "[rank1] unfinished"]


def test_a_timeouts_stack_dump_is_cut_to_the_scripts_thread_and_says_where_the_rest_is(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "torchrun" / "id_x" / "attempt_0" / "0"
    folder.mkdir(parents=True)
    log = folder / "stdout.log"
    log.write_text("epoch 0\n")
    lines = []
    streams = Streams(tmp_path, lines.append)
    streams.poll()
    assert lines == ["[rank0] epoch 0"]
    streams.hold("train.py")
    noise = "".join(f'Thread 0x{i:04x} (most recent call first):\n  File "/x/threading.py", line 982 in run\n\n'
                    for i in range(30))
    log.write_text(log.read_text() + noise + DUMP)
    streams.poll()
    assert lines == ["[rank0] epoch 0"], "nothing of a dump is shown before the run has ended"
    streams.finish()
    assert lines[1:] == [
        "[rank0] Current thread 0x00007f7cc57f6b80 (most recent call first):",
        '[rank0]   File "/x/torch/distributed/distributed_c10d.py", line 3913 in all_reduce',
        '[rank0]   File "/x/torch/distributed/c10d_logger.py", line 83 in wrapper',
        '[rank0]   File "train.py", line 6 in step',
        '[rank0]   File "train.py", line 11 in <module>',
        f"[rank0] … 64 more line(s) of its stack dump are in {log}",
    ]


TORCHRUN_SUMMARY = """\
E1123 07:30:46.912000 11330 api.py:882] failed (exitcode: 1) local_rank: 1 (pid: 11337) of binary: python
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
labkit._entry FAILED
------------------------------------------------------------
Failures:
[0]:
  time      : 2026-11-23_07:30:47
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -6 (pid: 11336)  (SIGABRT)
  error_file: <N/A>
  traceback : Signal 6 (SIGABRT) received by PID 11336
------------------------------------------------------------
Root Cause (first observed failure):
[1]:
  time      : 2026-11-23_07:30:46
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 11337)
============================================================
"""


def test_a_rank_torchrun_saw_fail_second_is_still_reported(tmp_path):
    """gloo aborts rank 0; rank 1, cut off, raises first, and torchrun's first line names only it."""
    (tmp_path / "errors").mkdir()
    (tmp_path / "errors" / "rank1-restart0.json").write_text(json.dumps({
        "rank": 1, "restart": 0, "pid": 11337, "time": 1.0, "exit_code": 1, "type": "RuntimeError",
        "message": "Read error [127.0.0.1]:18307: Connection reset by peer", "traceback": "..."}))
    (tmp_path / "torchrun.log").write_text(TORCHRUN_SUMMARY)
    streams = Streams(tmp_path, lambda line: None)
    streams._line(0, "  what():  [enforce fail] Is there a distributed collective mismatch in your code?")
    failures, restarts = collect_failures(tmp_path, streams)
    assert [(f.rank, f.exit_code, f.message, f.secondary) for f in failures] == [
        (0, -6, "killed by SIGABRT", False),
        (1, 1, "Read error [127.0.0.1]:18307: Connection reset by peer", True)]
    assert failures[0].says_mismatch and restarts == 0
