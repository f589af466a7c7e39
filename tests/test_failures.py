"""labkit._launch.failures: what failed in a launch, root cause first."""

from __future__ import annotations

import json

from labkit import RankFailure
from labkit import LaunchError
from labkit._launch.failures import collect_failures, failure_hint, split_crash
from labkit._launch.streams import Streams
from test_stacks import DUMP


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


# A rank's last lines as a native crash leaves them: its output, glibc's words, then the stacks
# its entry point's faulthandler printed (test_stacks.DUMP) and the list of extension modules.
CRASH = ("step 3 done\nfree(): double free detected in tcache 2\nFatal Python error: Aborted\n\n"
         + DUMP + "\nExtension modules: numpy._core._multiarray_umath, torch._C (total: 2)")


def test_a_native_crash_is_placed_on_the_scripts_line_and_keeps_what_came_before(tmp_path):
    """A rank killed by SIGABRT after faulthandler printed its stacks (the entry point asks
    for them): the message names the script's line, the traceback is the script's thread down
    to its outermost frame, and glibc's words stay in the output tail for the HINT."""
    (tmp_path / "torchrun.log").write_text(
        "E1123 07:30:46.912000 11330 api.py:882] failed (exitcode: -6) local_rank: 1 (pid: 1) of binary: python\n")
    streams = Streams(tmp_path, lambda line: None)
    for line in CRASH.splitlines():
        streams._line(1, line)
    [failure], _ = collect_failures(tmp_path, streams, "train.py")
    assert failure.message == ("killed by SIGABRT at train.py:6 in step, inside all_reduce "
                               "(distributed_c10d.py)")
    assert failure.output_tail == "step 3 done\nfree(): double free detected in tcache 2"
    assert failure.traceback.splitlines()[0].startswith("Current thread")
    assert failure.traceback.splitlines()[-1] == '  File "train.py", line 11 in <module>'
    assert "Extension modules" not in failure.traceback + failure.output_tail
    err = LaunchError("run 'x' failed", failures=[failure], run=None, returncode=1,
                      hint=failure_hint([failure]))
    text = str(err)
    assert text.index("its last output:") < text.index("its Python stack when it died")
    assert "glibc found its heap memory corrupted and aborted rank 1" in text


def test_without_a_crash_at_its_end_the_tail_is_left_whole():
    assert split_crash("a\nb") == ("a\nb", [])
    before, dump = split_crash("a\nFatal Python error: Segmentation fault\n\n"
                               'Current thread 0x1 (most recent call first):\n  File "x.py", line 2 in f')
    assert before == "a" and dump[-1] == '  File "x.py", line 2 in f'
    restarted = CRASH + "\ndata: synthetic CIFAR-like set\nstep 1 done"  # torchrun restarted it
    assert split_crash(restarted) == (restarted, [])
    assert split_crash(CRASH)[1][-1] == '  File "<frozen runpy>", line 88 in _run_code'
