"""labkit._launch.streams: every rank's output followed, prefixed, and a timeout's dump cut short."""

from __future__ import annotations

from labkit._launch.streams import Streams
from test_stacks import DUMP


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
