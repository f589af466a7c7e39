"""Shared fixtures: a scratch folder with tiny scripts, the world size a launch test uses, and a
check that no rank outlives a test.

``--ranks N`` sets ``LABKIT_RANKS=N`` for the whole session: every lesson and exercise check
then launches N CPU ranks (``labkit.default_nproc``, the checks' ``_ranks``), nbmake's kernels
inherit it, and the launch tests whose claim holds at any world size (those that take the
``ranks`` fixture, marked ``ranks``) run at N. ``make test-scale`` runs the lessons and the
solutions' checks at 4 and those launch tests at 3 (an odd world size finds divisibility slips).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from labkit._launch.failures import HEAP_CORRUPTED
from labkit._rank import zygote

ROOT = Path(__file__).resolve().parent.parent


def _has_gpu() -> bool:
    from labkit import _hardware
    return _hardware.gpu_count() > 0


def _slurm_missing() -> str | None:
    """Why the Slurm tests cannot run here (None: a cluster answers)."""
    from labkit._launch.sbatch import slurm_status
    status = slurm_status()
    return None if status else status.reason  # it says what gives a cluster


def pytest_configure(config):
    """``--ranks N``: LABKIT_RANKS=N for this process and every process it starts."""
    ranks = config.getoption("--ranks")
    if ranks is not None:
        if ranks < 2:  # one rank shows nothing distributed, and the launch tests need a peer
            raise pytest.UsageError(f"--ranks must be 2 or more, got {ranks}")
        os.environ["LABKIT_RANKS"] = str(ranks)


@pytest.fixture
def ranks() -> int:
    """The world size of a launch test whose claim holds at any size: ``LABKIT_RANKS`` (what
    ``--ranks`` sets), else 2. A test that takes it is marked ``ranks`` (``make test-scale``
    runs those at 3). A test about exactly 2 ranks keeps its 2, and says why."""
    from labkit import _hardware
    return _hardware.cpu_ranks()


@pytest.hookimpl(tryfirst=True)  # before -m selects: `-m ranks` sees the mark
def pytest_collection_modifyitems(config, items):
    for item in items:
        parametrized = getattr(item, "callspec", None)
        if "ranks" in getattr(item, "fixturenames", ()) and "ranks" not in (
                parametrized.params if parametrized else {}):  # a parameter of that name is not it
            item.add_marker(pytest.mark.ranks)
    skips = {}
    if any("slurm" in item.keywords for item in items):
        reason = _slurm_missing()
        if reason:
            skips["slurm"] = pytest.mark.skip(reason=reason)
    if not _has_gpu():
        skips["gpu"] = pytest.mark.skip(reason="needs a CUDA GPU; none is visible on this machine")
    if not (ROOT / "solutions").is_dir():  # a workshop's hand-out, without the answers
        skips["solutions"] = pytest.mark.skip(reason="needs solutions/, which this copy of the course leaves out")
    if not config.getoption("--browser"):
        skips["browser"] = pytest.mark.skip(reason="drives JupyterLab in a real browser: make test-browser")
    for item in items:
        for marker, skip in skips.items():
            if marker in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def slurm_cluster():
    """The Slurm cluster the tests submit to: the one SLURM_CONF names (``make test-slurm``
    starts a one-host cluster and sets it), or the machine's own. Tests that use it are marked
    ``slurm`` and skipped, with the reason, where none answers."""
    from labkit._launch.sbatch import slurm_status
    status = slurm_status()
    if not status:
        pytest.skip(status.reason)
    return status


def pytest_report_header(config):
    """In a workshop's hand-out, say what it leaves out: its skipped tests are then no surprise."""
    if (ROOT / "solutions").is_dir():
        return None
    from labkit.handout import LEFT_OUT
    return ("a workshop's hand-out: left out " + "; ".join(f"{path} ({why})" for path, why in LEFT_OUT.items())
            + ". The tests that need them are skipped, each saying why.")


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A fresh folder as the current directory; scripts and runs/ go here."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def write_script(workdir):
    """write_script("name.py", source) -> path: a dedented script in the work folder."""
    def write(name: str, source: str) -> str:
        path = workdir / name
        path.write_text(textwrap.dedent(source).lstrip())
        return name
    return write


def entry_processes(under: Path | None = None) -> list[str]:
    """Command lines of labkit rank processes still running on this machine: started by
    torchrun (``python -u -m labkit._rank.entry``) or forked by an agent's zygote (named
    ``labkit-rank``; its command line is the agent's).

    ``under``: only those whose working folder lies there (this test session's temporary
    folder), so that a notebook a developer runs beside the tests does not count.
    """
    found = []
    for proc in psutil.process_iter(["cmdline", "cwd", "name"]):
        args = proc.info["cmdline"] or []
        if "labkit._rank.entry" not in args and proc.info["name"] != zygote.RANK_NAME:
            continue
        if under is not None:
            cwd = proc.info["cwd"]  # None: gone already, or not ours to read
            if cwd is None or not Path(cwd).is_relative_to(under):
                continue
        found.append(f"{proc.pid} {' '.join(args)}")
    return found


@pytest.fixture(autouse=True)
def no_figure_outlives_the_test():
    """Close every matplotlib figure a test drew: pyplot keeps them open until closed, and a
    worker that has run many plotting tests warns (and holds their memory)."""
    yield
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is not None:
        pyplot.close("all")


@pytest.fixture(autouse=True)
def no_rank_outlives_the_test(request, tmp_path_factory):
    """After every test, no rank process that a test started is left running (10 s of grace:
    the reliability bar is seconds). Scoped to this session's temporary folder."""
    yield
    if not any(request.node.get_closest_marker(m) for m in ("launch", "notebook")):
        return
    base = tmp_path_factory.getbasetemp().resolve()
    deadline = time.monotonic() + 10
    while (left := entry_processes(base)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, "rank processes outlived the test:\n" + "\n".join(left)


def python(code: str, **kwargs) -> subprocess.Popen:
    """Start `python -c code` (this interpreter) in its own session."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)],
                            start_new_session=True, **kwargs)


def copy_folder(name: str, dest: Path) -> Path:
    """A copy of ROOT/name (without runs, data or checkpoints) for nbmake to overwrite."""
    target = dest / name
    if not (ROOT / name).is_dir():  # solutions/ in a hand-out: the tests that need it are skipped
        return target
    shutil.copytree(ROOT / name, target,
                    ignore=shutil.ignore_patterns("runs", "data", ".ipynb_checkpoints", "backup"))
    return target


# Wall time of each notebook execute() ran, printed at the end of the session.
TIMINGS: dict[str, float] = {}
# Notebooks executed a second time because glibc aborted a rank for a corrupted heap (a bug in
# native code: CI met one in PyTorch's gloo path, once in hundreds of launches), with glibc's
# words from the first time: {name: words}. Printed at the end of the session, never silent.
RERUNS: dict[str, str] = {}


def run_folders(folder: Path) -> set[str]:
    """Every run folder under ``folder`` (a launch's, or each of a sweep's): it holds a run.json."""
    return {str(p.parent.relative_to(folder)) for p in folder.rglob("run.json")}


def execute(notebook: Path, *, timeout: int = 300, smoke: bool = True) -> list[dict]:
    """Execute ``notebook`` in place in smoke mode (or full mode: ``smoke=False``, what a learner
    runs by default), as nbmake does: nbclient starts a fresh ``python3`` kernel in the
    notebook's folder, runs every cell (each within ``timeout`` seconds) and the executed
    notebook is written back. Returns its executed cells.

    Driven from this process, not a ``pytest --nbmake`` of its own: that started a second
    pytest for every notebook, seconds each, for nothing the test reads. Fails the test with
    the cell and the error if a cell raised, and names any code cell that never ran. MPLBACKEND
    is unset so that charts are kept as images, as in JupyterLab. The wall time (kernel start
    included; its stop, at once after the last cell, too) goes to TIMINGS.

    One failure, and only one, earns a second execution: a launch whose rank glibc aborted for
    a corrupted heap (labkit's HINT then says ``HEAP_CORRUPTED``), which is a memory bug in
    native code, not in the lesson. The notebook starts again from its unexecuted text, the
    first attempt's run folders removed (lessons count their launches), and RERUNS records it
    for the session's summary. A second such crash fails the test.
    """
    name = f"{notebook.parent.name}/{notebook.name}" + ("" if smoke else " (full mode)")
    unexecuted, before = notebook.read_text(), run_folders(notebook.parent)
    failed = _execute_once(notebook, name, timeout, smoke)
    if failed is not None and HEAP_CORRUPTED in failed and name not in RERUNS:
        said = re.search(re.escape(HEAP_CORRUPTED) + r' and aborted rank \d+ \("([^"]*)"\)', failed)
        RERUNS[name] = f"{said.group(1) if said else 'heap corrupted'} ({TIMINGS[name]:.0f} s lost)"
        for folder in run_folders(notebook.parent) - before:
            shutil.rmtree(notebook.parent / folder)
        notebook.write_text(unexecuted)
        failed = _execute_once(notebook, name, timeout, smoke)
    assert failed is None, f"{notebook.name} failed:\n{failed[-6000:]}"
    cells = json.loads(notebook.read_text())["cells"]
    # An IPython UsageError (e.g. an empty %%writefile cell) goes to stderr and stops the
    # notebook there, yet the kernel reports no error: every code cell must have run.
    never_ran = [i for i, cell in enumerate(cells)
                 if cell["cell_type"] == "code" and cell.get("execution_count") is None]
    assert not never_ran, f"{notebook.name}: code cells {never_ran} never ran"
    return cells


def _execute_once(notebook: Path, name: str, timeout: int, smoke: bool) -> str | None:
    """One execution (``execute``'s); the error's text if a cell raised or timed out, else None."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError

    env = dict(os.environ, LABKIT_SMOKE="1" if smoke else "0")
    env.pop("MPLBACKEND", None)
    nb = nbformat.read(notebook, as_version=4)
    # The kernel is stopped at once after the last cell: a graceful shutdown took another second a
    # notebook (75 of them in CI) for nothing a test reads, and a learner never waits for it.
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                            shutdown_kernel="immediate")
    start = time.monotonic()
    failed = None
    try:
        client.execute(cwd=str(notebook.parent), env=env)
    except (CellExecutionError, CellTimeoutError) as err:
        failed = _ANSI.sub("", str(err))
    finally:
        TIMINGS[name] = time.monotonic() - start
        nbformat.write(nb, notebook)
    return failed


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true",
                     help="also execute every lesson in full mode, as a learner does by default "
                          "(tens of minutes on 2 CPU cores): make test-full")
    parser.addoption("--browser", action="store_true",
                     help="run the tests that drive JupyterLab in headless Chromium: make test-browser")
    parser.addoption("--ranks", type=int, default=None, metavar="N",
                     help="launch N CPU ranks wherever a lesson, a check or a launch test takes its "
                          "world size from LABKIT_RANKS (sets it): make test-scale")


_REPORTED: set[str] = set()
_REPORTED_RERUNS: set[str] = set()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Attach the notebook times a test added to its report: under pytest-xdist (make test's
    first pass) a worker's TIMINGS never reach the process that prints the summary."""
    report = yield
    new = {name: seconds for name, seconds in TIMINGS.items() if name not in _REPORTED}
    if new:
        report.user_properties.append(("notebook_seconds", new))
        _REPORTED.update(new)
    reruns = {name: said for name, said in RERUNS.items() if name not in _REPORTED_RERUNS}
    if reruns:
        report.user_properties.append(("notebook_reruns", reruns))
        _REPORTED_RERUNS.update(reruns)
    return report


def pytest_runtest_logreport(report):
    """In the process that prints the summary, gather the times every worker reported."""
    for name, value in report.user_properties:
        if name == "notebook_seconds":
            TIMINGS.update(value)
        elif name == "notebook_reruns":
            RERUNS.update(value)


def pytest_terminal_summary(terminalreporter):
    """Print how long each notebook took, so that the one-minute bar is seen on every run, and
    which notebooks ran twice (``execute``), so that a crash a second run hid is seen too."""
    if RERUNS:
        terminalreporter.section("notebooks executed twice: the first time, glibc aborted a rank "
                                 "for a corrupted heap (a bug in native code)", yellow=True)
        for name, said in sorted(RERUNS.items()):
            terminalreporter.write_line(f"  {name}: {said}")
    if not TIMINGS:
        return
    terminalreporter.section("notebooks: wall time (nbmake, kernel start included; smoke mode unless "
                             "marked)")
    for name, seconds in sorted(TIMINGS.items()):
        terminalreporter.write_line(f"{seconds:6.1f} s  {name}")
