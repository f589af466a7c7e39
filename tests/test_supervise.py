"""labkit._launch.supervise: after a timeout, wait for each rank's stack dump, not a fixed time."""

from __future__ import annotations

import time

from labkit._launch import supervise

HEAD = 'Current thread 0x1 (most recent call first):\n  File "/x/torch/distributed_c10d.py", line 3913 in all_reduce\n'


def _marks(tmp_path, *texts):
    """One log per rank holding ``texts[rank]`` before the dump was asked for: marks at its end."""
    marks = {}
    for rank, text in enumerate(texts):
        path = tmp_path / f"rank{rank}.log"
        path.write_text(text)
        marks[rank] = (str(path), len(text))
    return marks


def test_a_frame_line_still_being_written_is_not_read(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    marks = _marks(tmp_path, 'step 4\n  File "train.py", line 9 in <module>\n')   # before the mark
    path = marks[0][0]
    with open(path, "a") as f:
        f.write(HEAD + '  File "train.py", line 31 in train_st')       # half written
    assert supervise.read_stacks(marks, "train.py") == {}
    with open(path, "a") as f:
        f.write("ep\n")
    assert supervise.read_stacks(marks, "train.py") == {0: "train.py:31 in train_step, inside all_reduce (distributed_c10d.py)"}


def test_the_wait_ends_once_every_dump_is_written_and_still(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    marks = _marks(tmp_path, "", "")
    for path, _ in marks.values():
        with open(path, "a") as f:
            f.write(HEAD + '  File "train.py", line 7 in <module>\n')
    polls = []
    start = time.monotonic()
    found = supervise.wait_for_stacks(marks, "train.py", poll=lambda: polls.append(1), timeout_s=5)
    assert time.monotonic() - start < 1, "it waited although both dumps were there"
    assert found == {0: "train.py:7 in <module>, inside all_reduce (distributed_c10d.py)"} | {
        1: "train.py:7 in <module>, inside all_reduce (distributed_c10d.py)"}
    assert len(polls) == 2          # one read finds both, the next sees the logs unchanged


def test_a_dump_that_keeps_growing_is_waited_for(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    marks = _marks(tmp_path, "")
    path = marks[0][0]
    with open(path, "a") as f:
        f.write(HEAD + '  File "train.py", line 7 in <module>\n')
    grown = []

    def more_threads():          # the dump goes on with other threads for three reads
        if len(grown) < 3:
            with open(path, "a") as f:
                f.write('Thread 0x2 (most recent call first):\n  File "/x/threading.py", line 9 in run\n')
            grown.append(1)

    found = supervise.wait_for_stacks(marks, "train.py", poll=more_threads, timeout_s=5)
    assert len(grown) == 3 and found == {0: "train.py:7 in <module>, inside all_reduce (distributed_c10d.py)"}


def test_a_rank_that_never_says_costs_the_whole_wait_and_is_left_out(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    marks = _marks(tmp_path, "", "")
    with open(marks[0][0], "a") as f:
        f.write(HEAD + '  File "train.py", line 7 in <module>\n')
    start = time.monotonic()
    found = supervise.wait_for_stacks(marks, "train.py", timeout_s=0.3)    # rank 1 wrote nothing
    assert 0.3 <= time.monotonic() - start < 2
    assert set(found) == {0}
