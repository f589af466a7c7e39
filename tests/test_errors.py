"""LaunchError's message and HINT: what each kind of failure usually means."""

from __future__ import annotations

import pytest

from labkit import LaunchError, LaunchTimeout, RankFailure
from labkit._launch.failures import HEAP_CORRUPTED, failure_hint, timeout_hint

ABORT_TAIL = ("terminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
              "  what():  [enforce fail at gloo/transport/tcp/pair.cc:464] op.preamble.length <= "
              "op.nbytes. 1000 vs 4. Received data size doesn't match expected size. Is there a "
              "distributed collective mismatch in your code?")
PEER_GONE = "[gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:33687."


def failure(rank, *, code=1, exc_type="", message="", tail="", secondary=False, time=None):
    return RankFailure(rank=rank, exit_code=code, exc_type=exc_type, message=message,
                       traceback=f"Traceback ...\n{exc_type}: {message}\n" if exc_type else "",
                       output_tail=tail, time=time, secondary=secondary)


@pytest.mark.parametrize("code, words", [
    (-9, "killed by SIGKILL, most often by the out-of-memory killer"),
    (-6, "aborted (SIGABRT) by PyTorch's C++ runtime, not by a Python exception: its last lines"),
    (-11, "crashed inside native code"),
    (-15, "stopped from outside"),
    (3, "exited with code 3 without a Python exception"),
])
def test_a_rank_without_an_exception_gets_the_hint_of_its_signal(code, words):
    hint = failure_hint([failure(0, code=code, message="killed", tail="last words")])
    assert words in hint
    assert "out of memory" not in hint or code == -9


@pytest.mark.parametrize("said", [
    "malloc(): unaligned tcache chunk detected",          # CI saw it: lesson 11, rank 1
    "[rank1] free(): double free detected in tcache 2",
    "double free or corruption (out)",
    "corrupted size vs. prev_size",
    "munmap_chunk(): invalid pointer",
])
def test_a_rank_that_glibc_aborted_for_a_corrupted_heap_is_told_apart(said):
    """glibc aborts a process whose heap it finds corrupted: a bug in native code, which a rerun
    usually misses. The HINT says so, quotes glibc, and holds HEAP_CORRUPTED (the tests' harness
    runs a notebook again once on it, and says so)."""
    tail = f"rank 1: blocks.0.fc2.weight (256, 1024)\n{said}"
    failures = [failure(1, code=-6, message="killed by SIGABRT", tail=tail),
                failure(0, exc_type="RuntimeError", message=PEER_GONE, secondary=True)]
    hint = failure_hint(failures)
    assert hint.startswith(f"glibc {HEAP_CORRUPTED} and aborted rank 1 (\"{said.removeprefix('[rank1] ')}\")")
    assert "not in your Python" in hint and "run the cell again" in hint


@pytest.mark.parametrize("code, tail", [
    (-6, "we free(): nothing here; a print that names malloc(): not glibc"),  # not at a line's start
    (-11, "malloc(): unaligned tcache chunk detected"),                        # not an abort
])
def test_heap_words_count_only_from_glibc_in_an_abort(code, tail):
    hint = failure_hint([failure(0, code=code, message="killed", tail=tail)])
    assert HEAP_CORRUPTED not in hint


def test_a_collective_mismatch_in_a_ranks_output_says_what_to_look_for():
    failures = [failure(0, code=-6, message="killed by SIGABRT", tail=ABORT_TAIL),
                failure(1, exc_type="RuntimeError", message=PEER_GONE, secondary=True)]
    hint = failure_hint(failures)
    assert hint.startswith("rank 0's output says the ranks' collectives did not match: every rank "
                           "must call the same collectives in the same order")
    assert "`if rank == 0:`" in hint
    text = str(LaunchError("run 'x' failed.", failures=failures, hint=hint))
    assert "its last output:" in text and "Is there a distributed collective mismatch" in text


def test_a_rank_that_only_lost_its_peer_is_not_called_the_root_cause():
    """A peer that skipped a collective and finished leaves one rank waiting, then cut off."""
    hint = failure_hint([failure(0, exc_type="RuntimeError", message=PEER_GONE, secondary=True)])
    assert "rank 0 lost its connection to a peer, but no rank reported an error of its own" in hint
    assert "root cause" not in hint and "Every rank must call the same collectives" in hint


def test_a_rank_that_only_timed_out_waiting_is_told_so():
    """Its peer may still be alive, waiting in another collective: "lost its connection" would
    send the learner looking for a rank that left."""
    timed_out = ("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv "
                 "operation to complete")
    hint = failure_hint([failure(0, exc_type="RuntimeError", message=timed_out, secondary=True),
                         failure(1, code=-15, message="killed by SIGTERM", secondary=True)])
    assert hint.startswith("rank 0 gave up waiting for a peer (its collective timed out), but no rank "
                           "reported an error of its own: a peer most likely waited elsewhere")
    assert "lost its connection" not in hint and "`if rank == 0:`" in hint


def test_ranks_that_raised_the_same_error_are_not_called_secondary():
    failures = [failure(r, exc_type="ValueError", message="bad --lr", time=1.0 + r) for r in range(3)]
    err = LaunchError("run 'x' failed.", failures=failures, hint=failure_hint(failures))
    text = str(err)
    assert "also: ranks 1 and 2 failed with the same error" in text
    assert "peer went away" not in text and "because it went away" not in text
    assert "HINT: every rank that failed raised the same error, so its cause is in code they all run" in text


def test_a_root_cause_and_its_secondary_peers():
    failures = [failure(1, exc_type="ValueError", message="rank 1 is unhappy"),
                failure(0, exc_type="RuntimeError", message=PEER_GONE, secondary=True)]
    text = str(LaunchError("run 'x' failed.", failures=failures, hint=failure_hint(failures)))
    assert "also: rank 0 failed (exit code 1): RuntimeError" in text
    assert "(most likely because a peer went away)" in text
    assert "HINT: read rank 1's traceback above: it is the root cause; the other ranks stopped" in text


def test_a_timeout_with_ranks_in_different_collectives_names_the_mismatch():
    stacks = {0: "x.py:6 in <module>, inside all_reduce (distributed_c10d.py)",
              1: "x.py:8 in <module>, inside barrier (distributed_c10d.py)"}
    hint = timeout_hint(stacks)
    assert hint.startswith("the ranks wait in different places (rank 0 at x.py:6 in <module>, inside "
                           "all_reduce; rank 1 at x.py:8 in <module>, inside barrier): every rank must")
    assert "waits in a collective the others never reach" in timeout_hint(
        {0: "x.py:6 in <module>, inside all_reduce (distributed_c10d.py)", 1: "x.py:9 in <module>"})
    assert "HINT: the ranks wait in different places" in str(
        LaunchTimeout("run 'x' passed its timeout.", stacks=stacks, hint=hint))


def test_sweep_is_declared_and_none_outside_a_sweep():
    """labkit.sweep sets .sweep on the error of the run that stopped it (test_sweep checks the
    runs it holds); any other error says None rather than lacking the attribute."""
    from labkit import LabkitError, NoMetricsError

    assert LabkitError("x").sweep is None and NoMetricsError("x").sweep is None
    assert LaunchError("failed").sweep is None and LaunchTimeout("timed out").sweep is None


# -- what IPython shows ---------------------------------------------------------------------------
def ipython_output(cell: str) -> str:
    """What IPython prints for ``cell``, as a notebook would show it (colours stripped)."""
    import re
    import subprocess
    import sys

    code = ("from IPython.core.interactiveshell import InteractiveShell\n"
            f"InteractiveShell.instance().run_cell({cell!r})\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return re.sub(r"\x1b\[[0-9;]*m", "", out.stdout)


CALL_THROUGH_THE_WRAPPER = """
from labkit._launch.tracebacks import hide_labkit_frames
from labkit._launch.keywords import refuse_keywords

def stop(error):
    try:
        raise error
    except BaseException as err:
        if HIDE:
            hide_labkit_frames(err)
        raise

refuse_keywords(nprocs="")(stop)(ERROR)
"""


def test_ipython_leaves_the_keyword_wrapper_out_of_a_traceback():
    shown = ipython_output(CALL_THROUGH_THE_WRAPPER.replace("HIDE", "False")
                           .replace("ERROR", "ValueError('bad nproc')"))
    assert "ValueError: bad nproc" in shown and "Cell In[1]" in shown
    assert "_plan.py" not in shown and "skipping hidden 1 frame" in shown, shown


def test_an_interrupt_shows_no_labkit_frame_in_ipython():
    shown = ipython_output(CALL_THROUGH_THE_WRAPPER.replace("HIDE", "True")
                           .replace("ERROR", "KeyboardInterrupt()"))
    assert "KeyboardInterrupt" in shown and "Cell In[1]" in shown and "in stop" in shown
    assert "_plan.py" not in shown and "hidden" not in shown, shown


def test_ranks_that_timed_out_in_different_collectives_get_the_mismatch_hint():
    """Every rank raised the same timeout; where each waited is what tells the story."""
    def waited(rank, line, call):
        return RankFailure(
            rank=rank, exit_code=1, exc_type="RuntimeError", secondary=True, output_tail="", time=None,
            message="[gloo/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation",
            traceback=(f'Traceback (most recent call last):\n  File "x.py", line {line}, in <module>\n'
                       f'    dist.{call}()\n  File "/venv/lib/python3.11/site-packages/torch/distributed/'
                       f'distributed_c10d.py", line 3913, in {call}\n    work.wait()\nRuntimeError: x\n'))
    hint = failure_hint([waited(0, 29, "all_reduce"), waited(1, 40, "barrier")])
    assert hint.startswith("the ranks waited in different places (rank 0 at x.py:29 in <module>, inside "
                           "all_reduce; rank 1 at x.py:40 in <module>, inside barrier): every rank must")
    same = failure_hint([waited(0, 29, "all_reduce"), waited(1, 29, "all_reduce")])
    assert not same.startswith("the ranks waited")
