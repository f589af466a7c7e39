"""The lesson notebooks: stored clean, scripts in sync, executed by nbmake in smoke mode.

Execution runs nbmake with --overwrite on a *copy* of the notebooks folder and
then reads the executed copy: a notebook must not only run without error, its
launch cells must show every rank's lines and keep a chart image. Output that
rank processes wrote directly would be lost under nbmake; this is the test
that would notice.
"""

from __future__ import annotations

import ast
import json
import os
import re
from pathlib import Path

import pytest

from conftest import TIMINGS, copy_folder, execute, run_folders

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
WRITEFILE = re.compile(r"^%%writefile(?P<append>\s+(?:-a|--append))?\s+(?P<path>\S+)[ \t]*\n")
WRITEFILE_MAX_LINES = 60   # a script is told in steps: aim for 15-40 lines a cell
LESSON_BAR_S = 60   # quality.md: each lesson runs in smoke mode in under a minute on 2 CPU cores
SLACK = 1.5         # CI's shared cores are noisy: fail at 1.5x the bar; the summary prints each time


def _cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def _source(cell: dict) -> str:
    src = cell["source"]
    return "".join(src) if isinstance(src, list) else src


def test_there_are_lessons():
    assert [p.name[:2] for p in NOTEBOOKS][:3] == ["00", "01", "02"]


STORED = NOTEBOOKS + [p for folder in ("exercises", "solutions")   # solutions/: absent from a hand-out
                     for p in sorted((ROOT / folder).glob("[0-9][0-9]_*.ipynb"))]


@pytest.mark.parametrize("path", STORED, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_stored_clean(path):
    nb = json.loads(path.read_text())
    assert nb["metadata"]["kernelspec"]["name"] == "python3"
    ids = [cell.get("id") for cell in nb["cells"]]
    assert len(set(ids)) == len(ids), (
        f"{path.name} repeats cell ids {sorted({i for i in ids if ids.count(i) > 1})}: Jupyter renames "
        f"them at random on every load, and the diffs fill with noise")
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            assert cell.get("outputs") == [] and cell.get("execution_count") is None, (
                f"{path.name} is stored with outputs; clear them before committing")


def _writefile_cells(path: Path) -> list[tuple[str, bool, str, int]]:
    """(target, appends, body, cell index) of each %%writefile cell, in order. The body is what
    IPython writes: the cell after its first line, with a final newline added if missing."""
    found = []
    for index, cell in enumerate(_cells(path)):
        match = WRITEFILE.match(_source(cell))
        if cell["cell_type"] == "code" and match:
            body = _source(cell)[match.end():]
            found.append((match.group("path"), bool(match.group("append")),
                          body if body.endswith("\n") else body + "\n", index))
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_writefile_cells_match_scripts(path):
    """The committed copy of each script in notebooks/scripts/ is exactly what the notebook
    writes: its first ``%%writefile`` cell, then every ``%%writefile -a`` cell, in order."""
    written: dict[str, str] = {}
    for target, appends, body, index in _writefile_cells(path):
        if appends:
            assert target in written, (
                f"{path.name} cell {index} appends to {target} before any cell writes it: start the "
                f"script with a plain %%writefile, so that running the notebook again starts afresh")
            written[target] += body
        else:
            assert target not in written, (
                f"{path.name} cell {index} writes {target} again without -a, which throws away the "
                f"steps above it: use %%writefile -a {target}")
            written[target] = body
    assert written, f"{path.name} writes no script"
    for target, text in written.items():
        committed = path.parent / target
        assert committed.is_file(), f"{path.name} writes {target}, which is not committed"
        assert text == committed.read_text(), (
            f"{path.name}'s %%writefile cells for {target} and the committed file differ")


@pytest.mark.parametrize("path", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=lambda p: p.stem)
def test_writefile_cells_are_short(path):
    """A lesson builds its script one short step at a time, prose between the steps."""
    for cell in _cells(path):
        source = _source(cell)
        if cell["cell_type"] == "code" and source.startswith("%%writefile"):
            lines = len(source.rstrip("\n").splitlines())
            assert lines <= WRITEFILE_MAX_LINES, (
                f"{path.name}: {source.splitlines()[0]!r} is a cell of {lines} lines, over "
                f"{WRITEFILE_MAX_LINES}: split it into steps (%%writefile -a), prose between them")


#: The lesson scripts whose runs are compared with each other: across world sizes (02-04),
#: across a resume (05), DDP against FSDP (06), each hook (07) and each knob (08) against plain
#: float32. Lesson 01 trains alone and keeps augmentation.
COMPARED = ["02_ddp.py", "03_syncbn.py", "04_accumulation.py", "05_checkpointing.py", "06_fsdp.py",
            "07_profiling.py", "08_speed.py"]


@pytest.mark.parametrize("script", COMPARED)
def test_compared_runs_read_unaugmented_data(script):
    """On real CIFAR-10 each process draws its own random crops and flips, so two runs of a
    comparison would not see the same images; the smoke data set has no augmentation to hide it."""
    tree = ast.parse((ROOT / "notebooks" / "scripts" / script).read_text())
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
             and getattr(node.func, "id", None) == "get_datasets"]
    assert len(calls) == 1, f"{script} calls get_datasets {len(calls)} times"
    augment = {k.arg: k.value for k in calls[0].keywords}.get("augment")
    assert isinstance(augment, ast.Constant) and augment.value is False, (
        f"{script}: get_datasets(..., augment=False), or its runs differ on CIFAR-10")


LESSON_MAX_CELLS = 64      # curriculum.md: each lesson is one sitting; one that outgrows it splits
MARKDOWN_MAX_LINES = 40    # prose comes in short cells, a step or an idea each


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_a_lesson_is_one_sitting(path):
    cells = _cells(path)
    assert len(cells) <= LESSON_MAX_CELLS, (
        f"{path.name} has {len(cells)} cells, over {LESSON_MAX_CELLS}: split the lesson in two "
        f"(as 07/08 and 11/12 were), or move helper code into labkit")
    for index, cell in enumerate(cells):
        lines = len(_source(cell).rstrip("\n").splitlines())
        assert cell["cell_type"] != "markdown" or lines <= MARKDOWN_MAX_LINES, (
            f"{path.name} cell {index} is {lines} lines of markdown, over {MARKDOWN_MAX_LINES}: "
            f"split it where its topic changes")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_lesson_spine(path):
    """Every lesson ends with a summary that points at its exercises."""
    text = "\n".join(_source(c) for c in _cells(path) if c["cell_type"] == "markdown")
    assert "## Summary" in text, f"{path.name} has no '## Summary' section"
    assert "exercises/" in text, f"{path.name} does not point to its exercises"


@pytest.fixture(scope="module")
def notebook_copy(tmp_path_factory):
    """A copy of notebooks/ for nbmake to overwrite."""
    return copy_folder("notebooks", tmp_path_factory.mktemp("executed"))


LESSON_MAX_LAUNCHES = 6   # one sitting: a launch costs seconds of start-up (count a sweep's runs)


#: Each lesson's smoke execution, shared by the tests that read it: {name: (cells or the error
#: that stopped it, the run folders it made)}.
_SMOKE: dict[str, tuple[object, list[str]]] = {}


def _smoke(path: Path, copy: Path) -> tuple[object, list[str]]:
    """Execute the lesson in smoke mode once per session: (its cells, or the AssertionError that
    stopped it; the run folders it left in the copy, one per launch)."""
    if path.name not in _SMOKE:
        before = run_folders(copy)
        try:
            outcome = execute(copy / path.name)
        except AssertionError as err:
            outcome = err
        _SMOKE[path.name] = (outcome, sorted(run_folders(copy) - before))
    return _SMOKE[path.name]


def _bar_s() -> float:
    """The smoke bar: 60 s at 2 ranks. ``--ranks N`` (LABKIT_RANKS) runs N processes on the same
    cores, so the bar grows with them (4 ranks: 120 s); make test-scale holds its own total."""
    ranks = int(os.environ.get("LABKIT_RANKS") or 2)
    return LESSON_BAR_S * max(1.0, ranks / 2)


@pytest.mark.notebook
@pytest.mark.alone
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_executes_in_smoke_mode(path, notebook_copy):
    launched = images = 0
    cells, _ = _smoke(path, notebook_copy)
    if isinstance(cells, AssertionError):
        raise cells
    seconds = TIMINGS[f"{notebook_copy.name}/{path.name}"]
    assert seconds < _bar_s() * SLACK, (
        f"{path.name} took {seconds:.0f} s in smoke mode; the bar is {_bar_s():.0f} s on 2 CPU cores "
        f"(failing at {SLACK}x)")
    for cell in cells:
        if cell["cell_type"] != "code":
            continue
        outputs = cell.get("outputs", [])
        text = "".join("".join(o.get("text", "")) for o in outputs if o.get("output_type") == "stream")
        src = _source(cell)
        if "labkit.launch(" in src and "LaunchError" not in src and "quiet=True" not in src:
            if text.startswith("skipped:"):  # a GPU-only launch that said why it skipped here
                assert "torch.distributed.run" not in text, f"{path.name}: 'skipped' but launched"
                continue
            launched += 1
            assert "[rank0]" in text, f"{path.name}: a launch cell shows no [rank0] lines:\n{src}"
        images += sum("image/png" in o.get("data", {}) for o in outputs)
    if launched:
        assert images, f"{path.name} launched runs but kept no chart image"


@pytest.mark.notebook
@pytest.mark.alone
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_a_lesson_launches_at_most_six_runs(path, notebook_copy):
    """Counted from what the smoke execution above left in the copy (one run folder per launch,
    one per run of a sweep; a GPU-only launch that skips on CPU makes none)."""
    outcome, made = _smoke(path, notebook_copy)
    assert len(made) <= LESSON_MAX_LAUNCHES, (
        f"{path.name} launched {len(made)} runs in smoke mode, over {LESSON_MAX_LAUNCHES} (each costs "
        f"seconds of start-up; a sweep counts its runs): {', '.join(Path(m).name for m in made)}")
    if isinstance(outcome, AssertionError):
        pytest.fail(f"{path.name} stopped before its end (test_executes_in_smoke_mode says why), so "
                    f"its launches could not all be counted: {len(made)} so far")


@pytest.mark.notebook
@pytest.mark.alone
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_executes_in_full_mode(path, request, tmp_path):
    """Full mode is what a learner without LABKIT_SMOKE runs: real sizes, longer training, so
    checks meet what smoke runs never reach (loss spikes, rounding amplified over hundreds of
    steps). Too slow for every run; make test-full runs it before a release."""
    if not request.config.getoption("--full"):
        pytest.skip("full mode takes tens of minutes on 2 CPU cores: make test-full runs it")
    copy = copy_folder("notebooks", tmp_path)
    execute(copy / path.name, timeout=3600, smoke=False)


def _falls_back_below_two_gpus(expression: str) -> bool:
    """True for ``labkit.lesson_device()`` asking for 2 GPUs or more (its default is 2), or the
    spelled-out ``"auto" if GPUS >= 2 else "cpu"``."""
    if expression == "'auto' if GPUS >= 2 else 'cpu'":
        return True
    call = ast.parse(expression, mode="eval").body
    if not (isinstance(call, ast.Call) and ast.unparse(call.func) == "labkit.lesson_device"):
        return False
    given = [*call.args, *(k.value for k in call.keywords if k.arg == "ranks")]
    return not given or (isinstance(given[0], ast.Constant) and given[0].value >= 2)


MULTI_RANK = [p for p in NOTEBOOKS if not p.name.startswith("01")]   # 01 is the one-device lesson


@pytest.mark.parametrize("path", MULTI_RANK, ids=lambda p: p.stem)
def test_multi_rank_launches_fall_back_to_cpu_ranks_below_two_gpus(path):
    """With one GPU, default_nproc() is 1: a lesson that launched 2 ranks on it would ask NCCL
    for a second GPU (lesson 02's sweep did), and lesson 00's failing rank 1 would not exist. Every launch at NPROC takes the lesson's DEVICE,
    which is 'cpu' below 2 GPUs. Read from the code, since no test machine has exactly one GPU."""
    import ast

    code = "\n".join(_source(c) for c in _cells(path)
                     if c["cell_type"] == "code" and not _source(c).startswith("%%"))
    tree = ast.parse(code)
    choices = [ast.unparse(node.value) for node in ast.walk(tree) if isinstance(node, ast.Assign)
               and [ast.unparse(t) for t in node.targets] == ["DEVICE"]]
    assert len(choices) == 1 and _falls_back_below_two_gpus(choices[0]), (
        f"{path.name}: DEVICE = {choices}; expected DEVICE = labkit.lesson_device()")
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
             and ast.unparse(node.func) in ("labkit.launch", "labkit.sweep")]
    at_nproc = [c for c in calls if any(k.arg in ("nproc", "nprocs") and "1" != ast.unparse(k.value)
                                        for k in c.keywords)]
    assert at_nproc, f"{path.name} launches nothing on several ranks"
    for call in at_nproc:
        device = {k.arg: ast.unparse(k.value) for k in call.keywords}.get("device")
        assert device == "DEVICE", f"{path.name}: {ast.unparse(call)[:120]} has device={device}"


def test_lessons_03_and_04_keep_their_names():
    """README's lesson table and the exercises point at these exact files."""
    assert {"03_syncbn.ipynb", "04_accumulation.ipynb"} <= {p.name for p in NOTEBOOKS}
