"""Exercises from solutions: the generator, the committed copies in sync, and both executed.

Solutions executed by nbmake must pass every check; exercises executed unmodified must run
to their check cells, which report the unfinished work (a TODO) and nothing broken.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from labkit import exercises
from labkit._course.feedback import MIME
from conftest import ROOT, copy_folder, execute

SOLUTIONS = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))
LESSONS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
NAMES = [p.name for p in LESSONS]  # every lesson has an exercise, and (but in a hand-out) a solution


def _edited() -> set[str]:
    """Exercise notebooks that differ from the last commit: a learner's work in progress. The
    tests of the exercises as handed out skip them, saying so, rather than fail on them."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--", "exercises"], cwd=ROOT,
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):  # no git: nothing to tell work from hand-out
        return set()
    return {Path(line[3:].strip('"')).name for line in out.splitlines()} & set(NAMES)


# -- the generator ---------------------------------------------------------------------------
def test_a_region_becomes_a_stub_with_its_todo_at_its_indent():
    source = ("def f():\n"
              "    ### BEGIN SOLUTION: return the answer\n"
              "    return 42\n"
              "    ### END SOLUTION\n"
              "print(f())")
    assert exercises.strip_solutions(source) == (
        "def f():\n"
        "    # TODO: return the answer\n"
        '    raise NotImplementedError("TODO: return the answer")\n'
        "print(f())")


def test_a_region_without_a_todo_gets_a_plain_one_and_markdown_gets_an_answer_line():
    assert exercises.strip_solutions("### BEGIN SOLUTION\nx = 1\n### END SOLUTION") == (
        '# TODO: write this part\nraise NotImplementedError("TODO: write this part")')
    text = "**Answer:**\n\n### BEGIN SOLUTION\nThree.\n### END SOLUTION"
    assert exercises.strip_solutions(text, markdown=True) == "**Answer:**\n\n*Your answer here.*"


@pytest.mark.parametrize("source, match", [
    ("### BEGIN SOLUTION\nx = 1", r"line 1: BEGIN SOLUTION is never closed"),
    ("x = 1\n### END SOLUTION", r"line 2: END SOLUTION without a BEGIN"),
    ("### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION", r"line 2: BEGIN SOLUTION inside another"),
])
def test_unbalanced_markers_are_a_clear_error(source, match):
    with pytest.raises(ValueError, match=match):
        exercises.strip_solutions(source, where="02_ddp.ipynb, cell 3")


def _notebook(*cells):
    return {"cells": [{"cell_type": kind, "metadata": {}, "source": text,
                       **({"outputs": [{"output_type": "stream", "name": "stdout", "text": "x"}],
                           "execution_count": 3} if kind == "code" else {})}
                      for kind, text in cells],
            "metadata": {"kernelspec": {"name": "python3"}}, "nbformat": 4, "nbformat_minor": 5}


def test_a_region_outside_a_script_is_refused():
    nb = _notebook(("code", "### BEGIN SOLUTION\nanswer = 3\n### END SOLUTION"))
    with pytest.raises(ValueError, match=r"cell 0: a solution region outside a %%writefile script"):
        exercises.exercise_notebook(nb)


def test_exercise_notebooks_have_no_outputs_and_say_where_they_come_from():
    nb = _notebook(("code", "%%writefile s.py\n### BEGIN SOLUTION\nx = 1\n### END SOLUTION\n"),
                   ("code", "print(1)"))
    out = exercises.exercise_notebook(nb, name="09_x.ipynb")
    assert all(c["outputs"] == [] and c["execution_count"] is None for c in out["cells"])
    assert nb["cells"][1]["outputs"], "the solution itself is left untouched"
    assert out["metadata"]["labkit"]["generated_from"] == "solutions/09_x.ipynb"


@pytest.fixture
def course(tmp_path):
    """A course folder with one solution notebook."""
    (tmp_path / "solutions").mkdir()
    nb = _notebook(("markdown", "# Exercise 07\n\n*Exercise id: `07-demo`.*"),
                   ("code", "%%writefile s.py\n### BEGIN SOLUTION: add\nx = 1 + 1\n### END SOLUTION\n"))
    (tmp_path / "solutions" / "07_demo.ipynb").write_text(json.dumps(nb))
    return tmp_path


def test_generating_twice_gives_the_same_bytes(course):
    assert exercises.generate(course) == [course / "exercises" / "07_demo.ipynb"]
    first = (course / "exercises" / "07_demo.ipynb").read_bytes()
    assert exercises.generate(course) == []
    assert (course / "exercises" / "07_demo.ipynb").read_bytes() == first
    assert b"TODO: add" in first and b"1 + 1" not in first


def test_a_learners_work_is_backed_up_before_it_is_replaced(course):
    exercises.generate(course)
    mine = course / "exercises" / "07_demo.ipynb"
    mine.write_text(mine.read_text().replace("TODO: add", "TODO: add (I tried x = 2)"))
    assert exercises.stale(course) == [mine]
    backup = exercises.restore("07", course)
    assert "I tried x = 2" in backup.read_text() and backup.parent.name == "backup"
    assert exercises.stale(course) == []
    assert exercises.restore("07", course) is None, "nothing to back up when unchanged"


def test_a_hand_out_without_solutions_restores_from_git(course):
    import subprocess

    exercises.generate(course)
    shutil.rmtree(course / "solutions")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(course)]
    subprocess.run(git[:5] + ["init", "-q", str(course)], check=True)
    subprocess.run(git + ["add", "exercises"], check=True)
    subprocess.run(git + ["commit", "-qm", "hand-out"], check=True)
    mine = course / "exercises" / "07_demo.ipynb"
    original = mine.read_text()
    mine.write_text(original.replace("TODO: add", "my attempt"))
    backup = exercises.restore("07", course)
    assert mine.read_text() == original and "my attempt" in backup.read_text()


def test_without_solutions_or_git_restore_says_what_to_do(course):
    exercises.generate(course)
    shutil.rmtree(course / "solutions")
    with pytest.raises(FileNotFoundError, match="no solutions/ folder.*no git history"):
        exercises.restore("07", course)


def test_restore_names_the_exercises_when_one_is_unknown(course):
    with pytest.raises(ValueError, match=r"no exercise '99'; there are: 07_demo"):
        exercises.restore("99", course)
    with pytest.raises(ValueError, match=r"no exercise '0'"):  # a prefix of every number: not a choice
        exercises.restore("0", course)


@pytest.mark.parametrize("which", ["07", "7", "07_demo", "07_demo.ipynb", "07-demo"])
def test_an_exercise_is_named_by_its_number_name_or_id(course, which):
    exercises.generate(course)
    mine = course / "exercises" / "07_demo.ipynb"
    mine.write_text(mine.read_text().replace("TODO: add", "my attempt"))
    assert "my attempt" in exercises.restore(which, course).read_text()


def test_a_learners_copy_of_a_notebook_is_not_an_exercise(course):
    exercises.generate(course)
    mine = course / "exercises" / "07_demo.ipynb"
    shutil.copy(mine, course / "exercises" / "07_demo-Copy1.ipynb")  # JupyterLab's Duplicate
    mine.write_text(mine.read_text().replace("TODO: add", "my attempt"))
    assert "my attempt" in exercises.restore("07", course).read_text()
    shutil.copy(mine, course / "exercises" / "07_demo_mine.ipynb")  # "Save As", a name like ours
    shutil.rmtree(course / "solutions")  # a hand-out: restore reads exercises/ and git
    with pytest.raises(ValueError, match=r"'07' names 2 notebooks .*07_demo.ipynb, 07_demo_mine.ipynb"):
        exercises.restore("07", course)


def test_generating_in_a_hand_out_points_to_restore(course):
    exercises.generate(course)
    shutil.rmtree(course / "solutions")
    with pytest.raises(FileNotFoundError, match=r"no solutions/ folder \(a hand-out\).*make restore"):
        exercises.generate(course)


def test_the_command_line_says_a_wrong_name_in_one_line(course, capsys):
    exercises.generate(course)
    assert exercises.main(["--root", str(course), "restore", "99"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no exercise '99'") and "Traceback" not in err
    assert exercises.main(["--root", str(course), "restore", "07"]) == 0
    assert "as it was handed out: nothing to restore" in capsys.readouterr().out


def test_the_command_line_check_fails_while_exercises_are_stale(course, capsys):
    assert exercises.main(["--root", str(course), "check"]) == 1
    assert "out of date" in capsys.readouterr().out
    assert exercises.main(["--root", str(course), "generate"]) == 0
    assert exercises.main(["--root", str(course), "check"]) == 0


# -- the course's own exercises ------------------------------------------------------------------
def test_every_lesson_has_an_exercise():
    for name in NAMES:
        assert (ROOT / "exercises" / name).is_file(), f"exercises/{name} is missing"


@pytest.mark.solutions
def test_every_lesson_has_a_solution():
    assert [p.name for p in SOLUTIONS] == NAMES


@pytest.mark.solutions
def test_committed_exercises_are_what_the_solutions_generate():
    edited = _edited()
    stale = [p for p in exercises.stale(ROOT) if p.name not in edited]
    assert stale == [], ("exercises/ is out of date: run `make exercises` (it copies any notebook "
                         "it replaces to exercises/backup/ first)")
    if edited:
        pytest.skip(f"your work? these exercises differ from the last commit: {', '.join(sorted(edited))}; "
                    f"only the others were compared with what the solutions generate")


def _feedback(cells: list[dict]) -> list[dict]:
    return [o["data"][MIME] for c in cells if c["cell_type"] == "code"
            for o in c.get("outputs", []) if MIME in o.get("data", {})]


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    root = tmp_path_factory.mktemp("practice")
    return {name: copy_folder(name, root) for name in ("solutions", "exercises")}


@pytest.mark.notebook
@pytest.mark.solutions
@pytest.mark.parametrize("name", NAMES, ids=lambda n: n[:-6])
def test_a_solution_passes_every_check(name, executed):
    found = _feedback(execute(executed["solutions"] / name))
    assert found, f"solutions/{name} shows no check"
    for feedback in found:
        assert feedback["status"] == "passed", feedback
    asked = os.environ.get("LABKIT_RANKS")  # --ranks N, make test-scale: the size every check runs at
    for feedback in found if asked else ():
        assert feedback["world_size"] == int(asked) or feedback["notes"], (
            f"solutions/{name}: exercise {feedback['exercise']}'s check ran on {feedback['world_size']} "
            f"ranks, not the {asked} that LABKIT_RANKS asks for, and did not say why: launch with "
            f"_ranks(minimum), or, for an exercise that holds at one size only, _only_at(feedback, "
            f"size, why) (labkit/_course/checks/_common.py)")


@pytest.mark.notebook
@pytest.mark.parametrize("name", NAMES, ids=lambda n: n[:-6])
def test_an_untouched_exercise_runs_to_its_check_which_reports_the_todo(name, executed):
    if name in _edited():
        pytest.skip(f"exercises/{name} differs from the last commit (your work?): it is not untouched")
    found = _feedback(execute(executed["exercises"] / name))
    assert found, f"exercises/{name} shows no check"
    first = found[0]
    assert first["status"] == "unfinished", first
    todo = [text for status, text in first["items"] if status == "todo"]
    assert todo and re.match(r"TODO: .+ \(scripts/\S+\.py, line \d+\)$", todo[0]), first


# -- restore in a learner's copy: from any folder inside it, the version the course shipped ----------
def _git(folder, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main",
                    "-C", str(folder), *args], check=True, capture_output=True, timeout=60)


@pytest.fixture
def learners_copy(course):
    """A hand-out as a learner has it: no solutions/, labkit/ and exercises/, one commit."""
    exercises.generate(course)
    shutil.rmtree(course / "solutions")
    (course / "labkit").mkdir()
    (course / "labkit" / "__init__.py").write_text("")
    (course / "notebooks").mkdir()
    _git(course, "init", "-q")
    _git(course, "add", "-A")
    _git(course, "commit", "-qm", "the hand-out")
    return course


@pytest.mark.parametrize("folder", [".", "exercises", "notebooks", "exercises/backup"])
def test_restore_finds_the_course_from_any_folder_inside_it(learners_copy, folder, monkeypatch):
    (learners_copy / folder).mkdir(exist_ok=True)
    monkeypatch.chdir(learners_copy / folder)
    mine = learners_copy / "exercises" / "07_demo.ipynb"
    original = mine.read_text()
    mine.write_text(original.replace("TODO: add", "my attempt"))
    assert exercises.main(["restore", "07"]) == 0
    assert mine.read_text() == original


def test_restore_brings_back_what_was_shipped_not_the_learners_commit(learners_copy):
    mine = learners_copy / "exercises" / "07_demo.ipynb"
    original = mine.read_text()
    mine.write_text(original.replace("TODO: add", "my attempt"))
    _git(learners_copy, "commit", "-qam", "my work")
    mine.write_text(original.replace("TODO: add", "my second attempt"))
    _git(learners_copy, "commit", "-qam", "more of my work")
    backup = exercises.restore("07", learners_copy)
    assert mine.read_text() == original and "my second attempt" in backup.read_text()


def test_restore_takes_the_newest_hand_out_commit(learners_copy):
    """After an update of the hand-out (a commit marked as one), restore brings back its version."""
    from labkit.handout import TRAILER

    mine = learners_copy / "exercises" / "07_demo.ipynb"
    updated = mine.read_text().replace("TODO: add", "TODO: add them")
    mine.write_text(updated)
    _git(learners_copy, "commit", "-qam", f"Course hand-out\n\n{TRAILER}: 0123abc")
    mine.write_text(updated.replace("TODO", "my work"))
    _git(learners_copy, "commit", "-qam", "my work")
    exercises.restore("07", learners_copy)
    assert mine.read_text() == updated


def test_restore_outside_a_course_says_where_to_go(tmp_path, monkeypatch):
    from labkit._course import exercises as course_exercises

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(course_exercises, "package_root", lambda: tmp_path)  # a labkit installed elsewhere
    with pytest.raises(FileNotFoundError, match=r"is not inside a copy of the course.*HINT: cd into"):
        exercises.restore("02")
