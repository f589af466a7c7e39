"""The course as a learner sees it: JupyterLab in headless Chromium, driven by Playwright.

nbmake runs the kernel without a front end, so it cannot see what a person sees: the live
chart updating in place, ``[rankN]`` lines streaming, the toolbar's interrupt and restart,
a check's findings. These tests click and type as a learner does and assert what the page
shows. Each step leaves a screenshot in build/browser/<test>/ for a person to look at.

Run them with ``make test-browser`` (JupyterLab in smoke mode on a copy of the course under
/tmp; the server, its kernels, every rank and the browser are stopped at the end). Without
``--browser`` they are skipped, with that reason.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest

from _lab import CELL_S, CHROMIUM_FLAGS, VIEWPORT, Lab, Notebook, find_chromium, processes_naming, \
    processes_under, wait_for
from conftest import entry_processes

ROOT = Path(__file__).resolve().parent.parent
SHOTS = ROOT / "build" / "browser"
pytestmark = pytest.mark.browser

INTERRUPT_BAR_S = 5.0   # the toolbar's interrupt: no rank left within this
RESTART_BAR_S = 10.0    # a kernel restart: no rank left within this (seconds, not minutes: a run
                        # left behind would end by itself one day, so "gone" alone proves nothing)
GONE_S = 60             # how long to wait for ranks to go before failing (a shared machine is slow)
# A learner trying longer runs of lesson 02's script: long enough for the live chart to be
# redrawn several times, or to be stopped mid-training, on any machine.
MORE_EPOCHS = ('more = labkit.launch("scripts/02_ddp.py", nproc=NPROC, args=BASE + ["--epochs", "20"],\n'
               '                     device=DEVICE, name="more-epochs", timeout_s=900)')
LONGER = ('longer = labkit.launch("scripts/02_ddp.py", nproc=NPROC, args=BASE + ["--epochs", "60"],\n'
          '                       device=DEVICE, name="longer", timeout_s=900)')


# -- the server, the browser, a copy of the course per test --------------------------------
@pytest.fixture(scope="session")
def lab(tmp_path_factory):
    """JupyterLab serving a folder under /tmp; stopped by pid at the end, and then no kernel
    or rank of it may be left."""
    root = Path(tempfile.mkdtemp(prefix="labkit-browser-"))
    state = tmp_path_factory.mktemp("jupyter-state")
    server = Lab(root / "course", state, ROOT)
    server.root.mkdir()
    try:
        server.start()
        yield server
    finally:
        server.stop()
        left = stop_leftovers(lambda: processes_under(server.root))
        shutil.rmtree(root, ignore_errors=True)
        assert not left, f"processes outlived JupyterLab (now killed): {left}"


@pytest.fixture(scope="session")
def browser():
    """Debian's Chromium (Playwright cannot download browsers here), headless, with a new empty
    profile; closed at the end, and then no process of it may be left."""
    playwright_api = pytest.importorskip(
        "playwright.sync_api", reason="the playwright package is missing: make test-browser installs it")
    chromium = find_chromium()
    if chromium is None:
        pytest.skip(f"no browser at {os.environ['CHROMIUM']!r} ($CHROMIUM)" if os.environ.get("CHROMIUM")
                    else "no chromium on this machine: make test-browser installs it with apt when run "
                         "as root; else install it (Debian/Ubuntu: apt-get install chromium)")
    profile = tempfile.mkdtemp(prefix="labkit-chromium-")
    with playwright_api.sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            profile, executable_path=chromium, headless=True, args=CHROMIUM_FLAGS,
            viewport=VIEWPORT)
        try:
            yield context
        finally:
            context.close()
    left = stop_leftovers(lambda: processes_naming(profile))
    shutil.rmtree(profile, ignore_errors=True)
    assert not left, f"chromium processes outlived the tests (now killed): {left}"


def wait_for_gone(find, timeout: float) -> list:
    """Wait until ``find()`` returns nothing; return what is still there after ``timeout``."""
    deadline = time.monotonic() + timeout
    while (left := find()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def stop_leftovers(find, timeout: float = GONE_S) -> list:
    """Wait for the processes ``find()`` lists ((pid, command) pairs, all started by these tests)
    to end; kill, by pid, any still there after ``timeout`` and return them for the failure."""
    left = wait_for_gone(find, timeout)
    for pid, _ in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def ranks(course: Path) -> list[tuple[int, str]]:
    """(pid, command) of every rank still running for this test's copy of the course."""
    return [(int(line.split()[0]), line) for line in entry_processes(course)]


@pytest.fixture
def course(lab, request):
    """A fresh copy of notebooks/ and exercises/ for this test, under the served folder."""
    folder = lab.root / request.node.name
    for name in ("notebooks", "exercises"):
        shutil.copytree(ROOT / name, folder / name, ignore=shutil.ignore_patterns(
            "runs", "data", ".ipynb_checkpoints", "backup", "variants", "*.pt"))
    return folder


@pytest.fixture
def shots(request):
    folder = SHOTS / request.node.name
    shutil.rmtree(folder, ignore_errors=True)
    return folder


@pytest.fixture
def open_notebook(browser, lab, course, shots):
    """open_notebook("notebooks/02_ddp.ipynb") -> Notebook. At the end the page is closed and
    its kernel shut down, and no rank of this test may be left."""
    opened = []

    def open_(relative: str) -> Notebook:
        notebook = Notebook(lab, browser, course / relative, shots)
        opened.append(notebook)
        return notebook

    yield open_
    for notebook in opened:
        notebook.shot("at the end")
        notebook.close()
    lab.shut_down_kernels()
    left = stop_leftovers(lambda: ranks(course))
    assert not left, "ranks outlived the test (now killed):\n" + "\n".join(c for _, c in left)


# -- lesson 00: Run All Cells ----------------------------------------------------------------
def test_lesson_00_run_all(open_notebook):
    """Run > Run All Cells: every cell runs, no error box, the rank lines, the ✓ checks and the
    charts are on the page."""
    nb = open_notebook("notebooks/00_setup.ipynb")
    nb.run_all()
    nb.shot("run all finished")

    seen = {}
    for index in nb.code_cells():
        cell = nb.cell(index)
        seen[index] = (nb.prompt(cell), nb.outputs(cell), nb.errors(cell))
    never_ran = [i for i, (prompt, _, _) in seen.items() if not re.fullmatch(r"\[\d+\]:", prompt)]
    assert not never_ran, f"code cells at {never_ran} show no execution count: {seen}"
    errors = {i: e for i, (_, _, e) in seen.items() if e}
    assert not errors, f"error boxes on the page: {errors}"

    launch = nb.cell("hello = labkit.launch(")
    text = nb.text(launch)
    assert re.search(r"^\[rank0\] ", text, re.M) and re.search(r"^\[rank1\] ", text, re.M), text
    nb.shot("the launch and its rank lines", at=launch)

    timeline = nb.cell("fig, ax = plt.subplots(figsize=(7, 1.4")
    assert [src for o in nb.outputs(timeline) for src in o["images"]], "the timeline chart is missing"
    nb.shot("the timeline chart", at=timeline)

    checks = [i for i, (_, outputs, _) in seen.items()
              if any(re.search(r"^✓ ", o["text"], re.M) for o in outputs)]
    assert len(checks) >= 2, f"the ✓ lines of the lesson's checks are not on the page: {seen}"
    nb.shot("a check passed", at=nb.cell(checks[-1]))

    saved = nb.save()
    code = [c for c in saved["cells"] if c["cell_type"] == "code"]
    assert all(c["execution_count"] for c in code), "a code cell did not run"
    assert not [o for c in code for o in c["outputs"] if o["output_type"] == "error"]


# -- lesson 02: the live chart ---------------------------------------------------------------
def watch(nb: Notebook, cell, name: str) -> dict:
    """Follow a launch cell until it has run, sampling what it shows ten times a second: the
    live view's frames (images in its HTML display), its progress lines, the most images shown
    at once, the rank lines. A screenshot of each new frame."""
    seen = {"frames": [], "progress": [], "most_images": 0, "rank_lines": 0}
    running = re.compile(rf"^{re.escape(name)}: running\b.*$", re.M)
    while not re.fullmatch(r"\[\d+\]:", nb.prompt(cell)):
        outputs = nb.outputs(cell)
        seen["most_images"] = max(seen["most_images"], sum(len(o["images"]) for o in outputs))
        seen["rank_lines"] = max(seen["rank_lines"], sum(
            len(re.findall(r"^\[rank\d+\] ", o["text"], re.M)) for o in outputs))
        for line in running.findall("\n".join(o["text"] for o in outputs)):
            if line not in seen["progress"]:
                seen["progress"].append(line)
        for src in (s for o in outputs if o["mime"] == "text/html" for s in o["images"]):
            if src not in seen["frames"]:
                seen["frames"].append(src)
                nb.shot(f"{name} live frame {len(seen['frames'])}", at=cell)
        time.sleep(0.1)
    nb.shot(f"{name} finished", at=cell)
    return seen


def assert_live_view(nb: Notebook, cell, name: str, seen: dict) -> None:
    """What holds for every launch, however fast: rank lines streamed, one display updated in
    place (never two images at once), the progress line moved on, and at the end one static
    chart (a PNG, not a live frame) in its place."""
    print(f"{name}: {len(seen['frames'])} live frame(s), {len(seen['progress'])} progress lines, "
          f"{seen['rank_lines']} rank lines")
    assert seen["rank_lines"] >= 2, "no [rankN] lines streamed into the cell while it ran"
    assert seen["most_images"] <= 1, (
        f"{seen['most_images']} images at once: the live view adds images instead of updating one")
    assert len(seen["progress"]) >= 2, f"the progress line did not move on: {seen['progress']}"
    outputs = nb.outputs(cell)
    charts = [(o["mime"], src) for o in outputs for src in o["images"]]
    assert len(charts) == 1 and charts[0][0] == "image/png", (
        f"the finished cell should show one static chart (image/png), it shows: {charts}")
    assert charts[0][1] not in seen["frames"], "the last live frame was left in place of the chart"
    assert not re.search(rf"^{re.escape(name)}: running", nb.text(cell), re.M), (
        "the live progress line is still shown after the run")


def test_lesson_02_live_chart(open_notebook):
    """Lesson 02's first launch, then a longer one a learner adds below it: rank lines stream,
    the live chart changes in place while the ranks run (at least twice in the longer run),
    its progress text moves on, and a static chart replaces it at the end."""
    nb = open_notebook("notebooks/02_ddp.ipynb")
    first = "ddp = labkit.launch("
    nb.run_all_above(first)
    nb.shot("the cells above the first launch ran")
    cell = nb.run(first, wait=False)
    name = "ddp-2"   # the lesson names it ddp-{NPROC}; smoke mode launches 2 ranks
    assert_live_view(nb, cell, name, watch(nb, cell, name))

    # In smoke mode the first run trains for about a second on an idle machine: too short for
    # the chart (redrawn every 2 s) to change twice. A longer run, as a learner might try:
    index = nb.insert_below(first, MORE_EPOCHS)
    cell = nb.run(index, wait=False)
    seen = watch(nb, cell, "more-epochs")
    assert_live_view(nb, cell, "more-epochs", seen)
    assert len(seen["frames"]) >= 3, (
        f"the live chart changed {len(seen['frames']) - 1} time(s) while the ranks ran; at least 2 "
        f"expected")


# -- interrupt and restart from the toolbar ---------------------------------------------------
def start_longer_run(nb: Notebook, course: Path):
    """Run lesson 02's set-up cell, then a longer launch of its script in a new cell below it;
    return that cell once its ranks train (the live view shows a step)."""
    setup = "BATCH = 32 if SMOKE else 128"
    nb.run(setup)
    index = nb.insert_below(setup, LONGER)
    cell = nb.run(index, wait=False)
    wait_for("the ranks to train", lambda: re.search(r"longer: running .*step \d+", nb.text(cell)), CELL_S)
    assert len(ranks(course)) >= 2, ranks(course)
    nb.shot("a longer run, training", at=cell)
    return cell


def test_interrupt_from_the_toolbar(open_notebook, course):
    """The toolbar's interrupt during a launch: every rank is gone within seconds, the cell says
    in one plain line what was stopped, and the next cell runs."""
    nb = open_notebook("notebooks/02_ddp.ipynb")
    cell = start_longer_run(nb, course)
    clicked = time.monotonic()
    nb.toolbar("interrupt")
    left = wait_for_gone(lambda: ranks(course), GONE_S)
    took = time.monotonic() - clicked
    nb.wait_done(cell)
    nb.shot("interrupted", at=cell)
    print(f"interrupt: ranks {'still running' if left else 'gone'} {took:.1f} s after the click")
    assert not left, f"ranks still running {GONE_S} s after the interrupt: {left}"
    assert took <= INTERRUPT_BAR_S, f"the ranks took {took:.1f} s to go (bar {INTERRUPT_BAR_S} s)"

    text = nb.text(cell)
    line = re.compile(r"^interrupted: (\d+) ranks? stopped, run folder (runs/\S+)$", re.M)
    said = line.findall(text)
    assert len(said) == 1, f"the cell should say once, plainly, what was stopped:\n{text[-3000:]}"
    assert said[0][0] == "2" and re.fullmatch(r"runs/\S+-longer", said[0][1]), said
    after = text[line.search(text).end():]
    assert not re.search(r"^\[(rank\d+|torchrun)\]", after, re.M), (
        f"rank lines after the interrupted line (they belong in the ranks' logs):\n{after[:3000]}")
    boxes = nb.errors(cell)
    assert len(boxes) <= 1 and all("KeyboardInterrupt" in b for b in boxes), boxes
    assert not any("labkit/_" in b for b in boxes), f"labkit's own frames in the traceback: {boxes}"

    nxt = nb.run('layers = ["head", "block 3"')  # the lesson's next code cell: a small figure
    assert not nb.errors(nxt) and [s for o in nb.outputs(nxt) for s in o["images"]], nb.outputs(nxt)
    nb.shot("the next cell ran", at=nxt)


def test_restart_during_a_launch(open_notebook, course):
    """Kernel restart from the toolbar during a launch: no rank is left, the kernel comes back."""
    nb = open_notebook("notebooks/02_ddp.ipynb")
    start_longer_run(nb, course)
    nb.toolbar("restart")
    confirm = nb.page.locator(".jp-Dialog .jp-mod-accept")   # "Restart" in "Restart Kernel?"
    confirm.wait_for()
    clicked = time.monotonic()
    confirm.click()
    left = wait_for_gone(lambda: ranks(course), GONE_S)
    took = time.monotonic() - clicked
    print(f"restart: ranks {'still running' if left else 'gone'} {took:.1f} s after the click")
    assert not left, f"ranks still running {GONE_S} s after the restart: {left}"
    assert took <= RESTART_BAR_S, f"the ranks took {took:.1f} s to go (bar {RESTART_BAR_S} s)"
    nb.wait_idle()
    nb.shot("restarted")
    cell = nb.run("BATCH = 32 if SMOKE else 128")   # the fresh kernel runs the set-up again
    assert not nb.errors(cell), nb.text(cell)


# -- an exercise's check and a hint ----------------------------------------------------------
def test_exercise_check_and_hint(open_notebook):
    """Run All on the untouched exercise: its check shows what is not done yet and the
    `Stuck? labkit.hint(...)` line; that call, typed into a new cell, renders the hint."""
    nb = open_notebook("exercises/02_ddp.ipynb")
    nb.run_all()
    check = nb.cell("labkit.check_ddp(")
    text = nb.text(check)
    nb.shot("the check on the untouched exercise", at=check)
    assert not nb.errors(check), text
    assert re.search(r"^Exercise 02-ddp: ", text, re.M), text
    findings = re.findall(r"^\s*([✓✗…]) (.+)$", text, re.M)
    assert [f for f in findings if f[0] != "✓"], f"no finding says what is wrong or unfinished:\n{text}"
    call = re.search(r"^Stuck\? (labkit\.hint\('02-ddp', \d\))", text, re.M)
    assert call, f"no hint line:\n{text}"

    index = nb.insert_below("labkit.check_ddp(", call.group(1))
    cell = nb.run(index)
    outputs = nb.outputs(cell)
    nb.shot("the hint", at=cell)
    assert [o for o in outputs if o["mime"] == "text/html" and re.match(r"Hint \d of \d for 02-ddp", o["text"])], (
        outputs)


# -- the interactive layer: predict, the planner, progress -------------------------------------
def write_notebook(path: Path, cells: list[str]) -> Path:
    """A small notebook of code cells (the interactive layer's own page, before the lessons
    carry its cells), written into this test's copy of the course."""
    import nbformat

    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(source) for source in cells]
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, path)
    return path


def test_a_prediction_typed_and_graded(open_notebook, course):
    """The question is a box, not text: the learner types a number, the note beside it repeats
    it, and the check cell grades that guess against the measurement, in one line."""
    write_notebook(course / "notebooks" / "predict.ipynb", [
        'import labkit\np = labkit.predict("bytes all-reduced per step", unit="MB")',
        'graded = p.grade(1.23, why="every gradient, once per step")',
    ])
    nb = open_notebook("notebooks/predict.ipynb")
    ask = nb.run("p = labkit.predict(")
    box = ask.locator(".labkit-predict-guess input")
    box.wait_for()
    assert "Predict · bytes all-reduced per step" in nb.text(ask), nb.text(ask)
    assert "no guess yet" not in nb.text(ask), "the text fallback is shown instead of the widget"
    nb.shot("the question, as a box", at=ask)
    box.click()
    box.press_sequentially("1.2")
    wait_for("the note to repeat the guess", lambda: "your guess: 1.2 MB" in nb.text(ask), 30)
    nb.shot("a guess typed", at=ask)
    graded = nb.run("graded = p.grade(")
    nb.shot("the grade", at=graded)
    assert nb.text(graded).strip() == ("bytes all-reduced per step: you said 1.2 MB, measured 1.23 MB: "
                                       "within 3%. every gradient, once per step"), nb.text(graded)

