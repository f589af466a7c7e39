"""labkit._diagnose.stacks: every "where is a rank" format, parsed once and said in one form."""

from __future__ import annotations

from labkit._diagnose.stacks import FAULTHANDLER, PY_SPY, excerpt, waiting_place, where

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


def test_a_faulthandler_dump_names_the_scripts_innermost_line_and_the_call(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert where(DUMP, "train.py", FAULTHANDLER) == "train.py:6 in step, inside all_reduce (distributed_c10d.py)"


def test_a_faulthandler_dump_in_the_scripts_own_code(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    dump = 'Current thread 0x1 (most recent call first):\n  File "train.py", line 3 in <module>\n'
    assert where(dump, "train.py", FAULTHANDLER) == "train.py:3 in <module>"
    assert where("garbage", "train.py", FAULTHANDLER) is None


PY_SPY_DUMP = """\
Process 4242: /venv/bin/python -u -m labkit._rank.entry scripts/10_hang.py --steps 5
Python v3.11.7 (/usr/bin/python3.11)

Thread 4242 (idle): "MainThread"
    all_reduce (torch/distributed/distributed_c10d.py:3913)
    _exception_logger.<locals>.wrapper (torch/distributed/c10d_logger.py:83)
    train_step (10_hang.py:29)
    <module> (10_hang.py:39)
    _run_code (<frozen runpy>:88)
    main (labkit/_entry.py:211)
Thread 4250 (idle): "labkit-watch"
    _watch (labkit/_entry.py:46)
    Thread.run (threading.py:982)
"""


def test_where_a_rank_waits_is_read_from_a_py_spy_dump():
    assert where(PY_SPY_DUMP, "scripts/10_hang.py", PY_SPY) == (
        "scripts/10_hang.py:29 in train_step, inside all_reduce (distributed_c10d.py)")
    assert where(PY_SPY_DUMP, "scripts/other.py", PY_SPY) is None


def test_a_py_spy_dump_is_shown_down_to_the_scripts_outermost_frame():
    shown = excerpt(PY_SPY_DUMP.splitlines(), "scripts/10_hang.py", PY_SPY)
    assert shown[0].startswith("Process 4242") and shown[-1].strip() == "<module> (10_hang.py:39)"
    assert not any("labkit-watch" in line or "runpy" in line for line in shown)


TRACEBACK = """Traceback (most recent call last):
  File "scripts/10_hang.py", line 40, in <module>
    train_step(batch)
  File "scripts/10_hang.py", line 29, in train_step
    dist.all_reduce(grad)
  File "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 83, in wrapper
    return func(*args, **kwargs)
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 3913, in all_reduce
    work.wait()
RuntimeError: Connection closed by peer
"""


def test_a_traceback_says_where_the_script_waited_in_the_same_form():
    assert waiting_place(TRACEBACK) == "scripts/10_hang.py:29 in train_step, inside all_reduce"
    own = TRACEBACK.split("  File \"/venv")[0] + "ValueError: x\n"
    assert waiting_place(own) == "", "a traceback that ends in the script's own code waits in nothing"
    assert waiting_place("") == ""


def test_one_excerpt_cutter_serves_both_dump_formats(tmp_path, monkeypatch):
    """The same rule for a timeout's faulthandler dump and a py-spy dump: the script's thread,
    down to its outermost frame in the script; a limit keeps the thread's first lines."""
    monkeypatch.chdir(tmp_path)
    shown = excerpt(DUMP.splitlines(), "train.py", FAULTHANDLER, limit=3)
    assert shown == DUMP.splitlines()[4:7], "the current thread, cut to 3 lines"
    assert excerpt(["no thread here", "", "at all"], "train.py", FAULTHANDLER, limit=1) == ["no thread here"]
    shown = excerpt(PY_SPY_DUMP.splitlines(), "elsewhere.py", PY_SPY)
    assert shown[-1].strip().startswith("main (labkit"), "no thread runs the script: the first thread, whole"
