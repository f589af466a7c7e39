"""labkit.predict: a guess before a launch, graded after it, kept in the run folder (no kernel needed)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

import labkit
from labkit import _rundir
from labkit._interact import guesses as _guesses
from labkit._interact.predict import gap_words, number
from test_rundir import imported_by


def make_run(folder, name="ddp-2"):
    """A run folder as labkit.launch leaves one (run.json is what makes it a run)."""
    folder.mkdir(parents=True)
    (folder / "run.json").write_text(json.dumps({"name": name, "command": "", "nproc": 2}))
    return labkit.Run.load(folder)


# -- outside JupyterLab: one line of text -----------------------------------------------------
def test_outside_a_kernel_the_question_is_one_line_of_text(capsys):
    p = labkit.predict("bytes all-reduced per step", unit="MB")
    out = capsys.readouterr().out
    assert out == "predict · bytes all-reduced per step (MB) · no guess yet (type one in JupyterLab, " \
                  "or pass guess=...)\n"
    assert p.guess is None and p.question == "bytes all-reduced per step" and p.unit == "MB"


def test_a_guess_set_from_code_is_shown_and_kept(capsys):
    p = labkit.predict("bytes all-reduced per step", unit="MB", guess=1.2)
    assert capsys.readouterr().out.endswith("· your guess: 1.2 MB\n")
    assert p.guess == 1.2
    p.guess = 3
    assert p.guess == 3.0 and "your guess: 3 MB" in p.text()
    assert repr(p) == "Prediction('bytes all-reduced per step', unit='MB', guess=3.0)"


def test_python_c_prints_the_question_and_never_loads_ipywidgets():
    code = ("import labkit\n"
            "p = labkit.predict('loss gap without SyncBN', unit='%', guess=2)\n"
            "p.grade(2.5)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "predict · loss gap without SyncBN (%) · your guess: 2%",
        "loss gap without SyncBN: you said 2%, measured 2.5%: 20% too low."]
    assert "ipywidgets" not in imported_by(code)


def test_importing_labkit_loads_no_widget_library():
    new = imported_by("import labkit\nlabkit.predict\nlabkit.Prediction")
    assert not {"ipywidgets", "IPython", "pandas"} & set(new), new


# -- grading ---------------------------------------------------------------------------------
@pytest.mark.parametrize("guess, measured, words", [
    (1.2, 1.23, "within 3%"),
    (1.23, 1.23, "exactly"),
    (100, 95, "within 6%"),
    (0.6, 1.0, "40% too low"),
    (2.5, 1.0, "2.5× too high"),
    (0.1, 1.0, "10.0× too low"),
    (-1.0, 1.0, "200% off (the opposite sign)"),
    (1.0, 0.0, "the measurement is 0"),
])
def test_the_gap_in_words(guess, measured, words):
    assert gap_words(guess, measured) == words


def test_figures_read_as_a_person_reads_them():
    assert [number(x) for x in (1.2, 1.23456, 1234.5, 1234567.0, 0.0437, 5e-7, 2.0)] == [
        "1.2", "1.235", "1234", "1,234,567", "0.0437", "5e-07", "2"]


def test_grade_prints_one_line_with_the_gap_and_why(capsys):
    p = labkit.predict("bytes all-reduced per step", unit="MB", guess=1.2)
    capsys.readouterr()
    graded = p.grade(1.23, why="DDP all-reduces every gradient once per step.")
    line = ("bytes all-reduced per step: you said 1.2 MB, measured 1.23 MB: within 3%. "
            "DDP all-reduces every gradient once per step.")
    assert capsys.readouterr().out == line + "\n"
    assert graded.line == str(graded) == line and repr(graded) == f"Grade({line!r})"
    assert graded.guess == 1.2 and graded.measured == 1.23
    assert math.isclose(graded.gap, 0.03 / 1.23)


def test_a_grade_as_a_cells_last_value_is_not_shown_twice(capsys):
    """In a notebook, ``p.grade(...)`` as a cell's last line printed its line; the Grade it
    returns then shows nothing more (no ``Grade('...')`` echo under the line)."""
    from IPython.core.interactiveshell import InteractiveShell
    shell = InteractiveShell.instance()
    try:
        graded = labkit.predict("buckets per step", unit="buckets", guess=2).grade(2)
        capsys.readouterr()
        # What a kernel publishes for a cell's last value: nothing for a Grade (ipykernel
        # sends no result with no data), an ordinary value's repr for anything else.
        assert shell.display_formatter.format(graded) == ({}, {})
        assert capsys.readouterr().out == ""
        assert "text/plain" in shell.display_formatter.format(object())[0]
    finally:
        InteractiveShell.clear_instance()


def test_no_guess_is_one_line_and_never_an_error(capsys):
    p = labkit.predict("all-reduces saved by no_sync", unit="all-reduces")
    capsys.readouterr()
    graded = p.grade(12, why="one per micro-step but the last")
    assert capsys.readouterr().out == ("all-reduces saved by no_sync: no guess; measured 12 "
                                       "all-reduces. one per micro-step but the last\n")
    assert graded.guess is None and graded.gap is None


def test_a_position_reads_with_its_unit_first(capsys):
    """A question "at which step" is answered by step 16, not by "16 step"."""
    p = labkit.predict("at which step does the restarted job resume", unit="step", guess=15)
    assert "your guess: step 15" in p.text()
    assert p.grade(16).line == ("at which step does the restarted job resume: you said step 15, "
                                "measured step 16: within 7%.")
    graded = labkit.predict("after which step do all the ranks stop", unit="step").grade(20)
    assert graded.line == "after which step do all the ranks stop: no guess; measured step 20."
    ratio = labkit.predict("DDP's speedup", unit="×", guess=2).grade(1.5)
    assert ratio.line == "DDP's speedup: you said 2×, measured 1.5×: 33% too high."


def test_a_figure_worked_out_rather_than_measured_says_what_gave_it(capsys, tmp_path):
    """Lesson 12 grades a guess of the ideal bubble against a replay, not a measurement."""
    run = make_run(tmp_path / "r")
    p = labkit.predict("the bubble", unit="%", guess=10)
    graded = p.grade(11.11, run=run, source="the ideal replay gave", why="(p-1)/(m+p-1)")
    assert graded.line == "the bubble: you said 10%, the ideal replay gave 11.11%: within 10%. (p-1)/(m+p-1)"
    assert labkit.predict("the bubble", unit="%").grade(50, source="the replay gave").line == (
        "the bubble: no guess; the replay gave 50%.")
    capsys.readouterr()
    with pytest.raises(ValueError, match=r"source must be a non-empty string, got ''\. HINT"):
        p.grade(1.0, run=run, source="")
    assert capsys.readouterr().out == "" and len(run.predictions()) == 1


def test_numpy_numbers_are_measurements_too(capsys):
    np = pytest.importorskip("numpy")
    graded = labkit.predict("buckets per step", unit="buckets", guess=4).grade(np.int64(4))
    assert graded.line == "buckets per step: you said 4 buckets, measured 4 buckets: exactly."


# -- kept in the run folder, read back -------------------------------------------------------
def test_each_grade_is_a_line_in_the_run_folder_read_back_by_run_and_by_folder(tmp_path, capsys):
    runs = tmp_path / "runs"
    ddp = make_run(runs / "20250101-000000-ddp-2")
    sweep_dir = runs / "20250101-000100-sweep-x"
    make_run(sweep_dir / "run-1")
    (sweep_dir / "sweep.json").write_text(json.dumps({"name": "x", "runs": ["run-1"]}))
    first = labkit.predict("bytes all-reduced per step", unit="MB", guess=1.2)
    first.grade(1.23, run=ddp, why="every gradient")
    first.grade(1.5, run=str(ddp.run_dir))
    labkit.predict("speedup on 2 ranks", unit="×").grade(1.7, run=labkit.Sweep.load(sweep_dir))

    lines = _rundir.predictions_file(ddp.run_dir).read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[0])["guess"] == 1.2
    mine = ddp.predictions()
    assert list(mine.columns) == _guesses.COLUMNS
    assert mine["measured"].tolist() == [1.23, 1.5] and mine["why"].tolist() == ["every gradient", ""]
    assert (mine["run"] == ddp.run_dir.name).all()

    room = labkit.predictions(runs)
    assert room["run"].tolist() == ["20250101-000000-ddp-2"] * 2 + ["20250101-000100-sweep-x"]
    assert room["guess"].isna().tolist() == [False, False, True]
    assert math.isclose(room["gap"][1], 0.3 / 1.5)


def test_a_torn_line_is_skipped_and_an_export_keeps_the_guesses(tmp_path, capsys):
    run = make_run(tmp_path / "runs" / "r")
    labkit.predict("q", unit="s", guess=1).grade(2, run=run)
    with open(_rundir.predictions_file(run.run_dir), "a") as f:
        f.write('{"question": "half a li')
    assert len(run.predictions()) == 1
    (run.run_dir / "metrics").mkdir()
    (run.run_dir / "metrics" / "rank0.jsonl").write_text('{"rank": 0, "step": 0, "time": 1.0}\n')
    assert run.export(tmp_path / "shipped").predictions()["guess"].tolist() == [1.0]


def test_no_predictions_is_an_empty_table(tmp_path):
    assert labkit.predictions(tmp_path).empty
    assert list(labkit.predictions(tmp_path).columns) == _guesses.COLUMNS
    assert make_run(tmp_path / "r").predictions().empty


# -- bad input, at the door --------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    (dict(question="", unit="MB"), r"question must be a non-empty string, got ''\. HINT: labkit\.predict"),
    (dict(question=3, unit="MB"), r"question must be a non-empty string, got 3"),
    (dict(question="bytes", unit=" "), r"unit must be a non-empty string, got ' '\. HINT: the unit"),
    (dict(question="bytes", unit=None), r"unit must be a non-empty string, got None"),
    (dict(question="bytes", unit="MB", guess=float("nan")), r"guess must be a finite number, got nan"),
    (dict(question="bytes", unit="MB", guess="1.2"), r"guess must be a finite number, got '1\.2' \(str\)"),
    (dict(question="bytes", unit="MB", guess=True), r"guess must be a finite number, got True"),
])
def test_predict_refuses_bad_input_with_a_hint(kwargs, message, capsys):
    with pytest.raises(ValueError, match=message):
        labkit.predict(**kwargs)
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("measured, message", [
    (float("inf"), r"measured must be a finite number, got inf \(float\)\. HINT: pass the measurement in MB"),
    ("1.23", r"measured must be a finite number, got '1\.23' \(str\)"),
    (None, r"measured must be a finite number, got None"),
    (False, r"measured must be a finite number, got False"),
])
def test_grade_refuses_a_measurement_that_is_not_a_number(measured, message, capsys, tmp_path):
    run = make_run(tmp_path / "r")
    p = labkit.predict("bytes", unit="MB", guess=1)
    capsys.readouterr()
    with pytest.raises(ValueError, match=message):
        p.grade(measured, run=run)
    assert capsys.readouterr().out == "" and run.predictions().empty


def test_grade_refuses_what_is_not_a_run(tmp_path, capsys):
    p = labkit.predict("bytes", unit="MB", guess=1)
    with pytest.raises(ValueError, match=r"is not a run or sweep folder \(no run\.json\)\. HINT: pass"):
        p.grade(1.0, run=tmp_path)
    with pytest.raises(ValueError, match=r"run must be a Run, a Sweep or a run folder, got a int\. HINT"):
        p.grade(1.0, run=3)
    with pytest.raises(ValueError, match=r"why must be a string, got 3\. HINT"):
        p.grade(1.0, why=3)
    with pytest.raises(FileNotFoundError, match=r"is not a folder\. HINT: pass the folder"):
        labkit.predictions(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=r"guess must be a finite number"):
        p.guess = float("nan")
    assert not list(tmp_path.iterdir())


# -- in a kernel: the widget, with the text as its fallback -------------------------------------
@pytest.fixture
def in_kernel(monkeypatch):
    """As in a Jupyter kernel: every display(...) bundle is kept instead of shown."""
    pytest.importorskip("ipywidgets")
    import IPython.display

    from labkit._launch import live

    shown = []
    monkeypatch.setattr(live, "in_notebook", lambda: True)
    monkeypatch.setattr(IPython.display, "display", lambda bundle, raw=False: shown.append(bundle))
    return shown


def test_in_a_kernel_a_widget_is_shown_with_the_line_as_its_text_fallback(in_kernel, capsys):
    p = labkit.predict("buckets per step", unit="buckets")
    assert capsys.readouterr().out == "" and len(in_kernel) == 1
    bundle = in_kernel[0]
    assert bundle["text/plain"] == p.text()
    assert "model_id" in bundle["application/vnd.jupyter.widget-view+json"]


def test_what_is_typed_in_the_box_is_the_guess(in_kernel, capsys):
    p = labkit.predict("buckets per step", unit="buckets")
    p._box.value = " 1,200 "                       # as the front end syncs what the learner typed
    assert p.guess == 1200.0 and p._note.value == "your guess: 1200 buckets"
    assert p.grade(1000).line == "buckets per step: you said 1200 buckets, measured 1000 buckets: 20% too high."
    p._box.value = "lots"
    assert p.guess is None and p._note.value == "✗ not a number: 'lots'"
    assert p.grade(1000).line == "buckets per step: could not read 'lots' as a number; measured 1000 buckets."
    p.guess = 7                                     # from code: the box shows it
    assert p._box.value == "7" and p.guess == 7.0
    assert labkit.predict("q", unit="s", guess=2.5)._box.value == "2.5"
