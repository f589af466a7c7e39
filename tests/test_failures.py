"""labkit._launch.failures: what failed in a launch, root cause first."""

from __future__ import annotations

import json

from labkit import RankFailure
from labkit._launch.failures import collect_failures
from labkit._launch.streams import Streams


def test_peer_failures_are_recognised_as_secondary():
    assert RankFailure.looks_secondary("[gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:1")
    assert RankFailure.looks_secondary("NCCL error: remote process exited or there was a network error")
    assert not RankFailure.looks_secondary("ValueError: rank 1 is unhappy")


TORCHRUN_SUMMARY = """\
E1123 07:30:46.912000 11330 api.py:882] failed (exitcode: 1) local_rank: 1 (pid: 11337) of binary: python
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
labkit._rank.entry FAILED
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
