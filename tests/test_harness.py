"""The harness that executes notebooks (``conftest.execute``): the one failure it runs again.

glibc aborts a process whose heap it finds corrupted. CI met it once in lesson 11 (rank 1,
"malloc(): unaligned tcache chunk detected", inside PyTorch's gloo path), a memory bug in
native code that a second execution misses. ``execute`` runs a notebook again once on labkit's
HINT for it, says so in the session's summary, and fails on anything else, or on a second one.
These notebooks fake the crash's HINT; they launch nothing.
"""

from __future__ import annotations

import nbformat
import pytest

import conftest
from labkit._launch.failures import HEAP_CORRUPTED

# A cell that fails as a launch does when glibc aborts a rank, the first `times` executions
# (counted in a file beside the notebook), each leaving a run folder as a launch would.
CRASH = '''
from pathlib import Path
count = Path("attempts.txt")
n = int(count.read_text()) + 1 if count.exists() else 1
count.write_text(str(n))
run = Path("runs") / f"attempt-{n}"
run.mkdir(parents=True)
(run / "run.json").write_text("{}")
if n <= TIMES:
    raise RuntimeError('HINT: glibc HEAP and aborted rank 1 ("malloc(): unaligned tcache chunk detected")')
'''


def _notebook(folder, times: int, heap: str = HEAP_CORRUPTED):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(CRASH.replace("TIMES", str(times)).replace("HEAP", heap)),
                nbformat.v4.new_code_cell("print('the end')")]
    path = folder / "crash.ipynb"
    nbformat.write(nb, path)
    return path


@pytest.fixture
def own_records(monkeypatch):
    """execute() records into dicts of this test's own, emptied before the test's report is
    made (which would carry them into the session's summary)."""
    monkeypatch.setattr(conftest, "RERUNS", {})
    monkeypatch.setattr(conftest, "TIMINGS", {})
    return conftest.RERUNS, conftest.TIMINGS


def test_a_heap_crash_runs_the_notebook_again_once_and_says_so(tmp_path, own_records):
    path = _notebook(tmp_path, times=1)
    try:
        cells = conftest.execute(path)
        reruns = dict(conftest.RERUNS)
    finally:
        for record in own_records:
            record.clear()
    assert "".join(cells[1]["outputs"][0]["text"]) == "the end\n"
    assert (tmp_path / "attempts.txt").read_text() == "2"
    # The first attempt's run folder is gone (a lesson counts its launches), the second's stays.
    assert conftest.run_folders(tmp_path) == {"runs/attempt-2"}
    assert reruns[f"{tmp_path.name}/crash.ipynb"].startswith("malloc(): unaligned tcache chunk detected (")


@pytest.mark.parametrize("times, heap, attempts", [
    (2, HEAP_CORRUPTED, "2"),                  # a second crash fails: one rerun, no more
    (1, "found a bug in the script", "1"),     # any other failure fails at once
])
def test_anything_else_fails_the_notebook(tmp_path, own_records, times, heap, attempts):
    path = _notebook(tmp_path, times=times, heap=heap)
    try:
        with pytest.raises(AssertionError, match="crash.ipynb failed"):
            conftest.execute(path)
    finally:
        for record in own_records:
            record.clear()
    assert (tmp_path / "attempts.txt").read_text() == attempts
