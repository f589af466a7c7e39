"""The hand-out: made by `make handout`, pushed to a new repository, cloned, updated, restored.

The recipe runs for real, with git, on a repository of this course's files as they are now
(the work tree, committed in a scratch folder). Git's own object listing, not the work tree,
says what a learner's clone holds.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from labkit._course import handout
from labkit.handout import File
from conftest import ROOT

GIT = shutil.which("git")
# Git 2.39 names a new repository's branch `master`: the recipe must not depend on it.
GIT_CONFIG = ["-c", "init.defaultBranch=master", "-c", "advice.detachedHead=false"]
pytestmark = [pytest.mark.solutions,
              pytest.mark.skipif(GIT is None, reason="needs git, which this machine lacks")]


@pytest.fixture(autouse=True)
def identity(monkeypatch):
    """Who commits: the instructor's and learners' git identities, and no user config."""
    for who in ("AUTHOR", "COMMITTER"):
        monkeypatch.setenv(f"GIT_{who}_NAME", "Someone")
        monkeypatch.setenv(f"GIT_{who}_EMAIL", "someone@example.org")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", os.devnull)
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")


def git(*args, cwd=None, check=True) -> subprocess.CompletedProcess:
    return subprocess.run([GIT, *GIT_CONFIG, *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, check=check, timeout=60)


def _course_files() -> list[str]:
    """The course's files as they are now: tracked or new, not ignored (no .venv, no runs)."""
    try:
        out = subprocess.run([GIT or "git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             cwd=ROOT, capture_output=True, text=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        pytest.skip("needs the course as a git checkout: this copy has no git history")
    return sorted(p for p in set(out.split("\0")) if p and (ROOT / p).is_file())


def _files_now() -> dict[str, File]:
    """The course's files as ``handout.read_commit`` gives them, from the work tree."""
    return {path: File("100755" if os.access(ROOT / path, os.X_OK) else "100644", None,
                       (ROOT / path).read_bytes()) for path in _course_files()}


@pytest.fixture
def course(tmp_path):
    """A git repository of this course, as the instructor's clone: one commit."""
    repo = tmp_path / "course"
    for path in _course_files():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / path, repo / path)
    git("init", "-q", repo)
    git("add", "-A", cwd=repo)
    git("commit", "-qm", "the course", cwd=repo)
    return repo


def _publish(course: Path, where: Path) -> Path:
    """The README's recipe: a new, empty bare repository, then the branch pushed to it as main."""
    git("init", "-q", "--bare", "-b", "main", where)
    git("push", "-q", where, "handout:main", cwd=course)
    return where


def _objects(repo: Path) -> tuple[set[str], list[str]]:
    """Every object id in ``repo`` (reachable or not), and every path in its history."""
    ids = set(git("cat-file", "--batch-all-objects", "--batch-check=%(objectname)", cwd=repo).stdout.split())
    paths = [line.split(" ", 1)[1] for line in git("rev-list", "--objects", "--all", cwd=repo).stdout.splitlines()
             if " " in line]
    return ids, paths


def _secrets(course: Path) -> set[str]:
    """Object ids a learner must never hold: every course commit, and every blob under a left-out
    path or of a file whose answer-quoting parts a hand-out cuts (but for a blob that a kept file
    holds too, such as the same .gitignore in solutions/scripts/ and exercises/scripts/)."""
    listing = [line.split("\t", 1) for line in git("ls-tree", "-r", "HEAD", cwd=course).stdout.splitlines()]
    secret = {meta.split()[2] for meta, path in listing if handout._left_out(path) or path in handout.ANSWERS_IN}
    kept = {meta.split()[2] for meta, path in listing if not handout._left_out(path) and path not in handout.ANSWERS_IN}
    commits = set(git("rev-list", "HEAD", cwd=course).stdout.split())  # the course, not its hand-outs
    assert secret - kept and commits
    return (secret - kept) | commits


def test_a_learner_clones_the_lessons_and_no_answer(course, tmp_path):
    built = handout.build(course)
    assert built.changed and built.parent is None, "the first hand-out is an orphan commit"
    assert git("rev-list", "--count", "handout", cwd=course).stdout.strip() == "1"
    bare = _publish(course, tmp_path / "handout.git")

    clone = git("clone", bare, tmp_path / "learner")
    learner = tmp_path / "learner"
    assert "warning" not in clone.stderr, clone.stderr  # e.g. "remote HEAD refers to nonexistent ref"
    for lesson in ("notebooks/00_setup.ipynb", "exercises/02_ddp.ipynb", "labkit/__init__.py", "Makefile"):
        assert (learner / lesson).is_file(), lesson
    assert not (learner / "solutions").exists()
    kept = set(git("ls-files", cwd=learner).stdout.split())
    assert kept == {p for p in _course_files() if not handout._left_out(p)}

    ids, paths = _objects(learner)
    assert not [p for p in paths if handout._left_out(p)], "a left-out path in the clone's history"
    assert not ids & _secrets(course), "the clone holds an object of the course's answers"


def test_the_hand_out_reads_right_for_a_learner(course, tmp_path):
    handout.build(course)
    learner = tmp_path / "learner"
    git("clone", "-q", _publish(course, tmp_path / "handout.git"), learner)
    for doc in learner.glob("*.md"):
        text = doc.read_text()
        for words in ("solutions/", "make exercises", "make handout", "<!-- hand-out"):
            assert words not in text, f"the hand-out's {doc.name} still says {words!r}"
    readme = (learner / "README.md").read_text()
    assert "## For instructors" not in readme
    assert "a workshop's hand-out" in readme, "the README says what this copy is"
    assert (learner / "CONTRIBUTING.md").is_file()


def test_an_update_reaches_learners_who_committed_their_own_work(course, tmp_path):
    first = handout.build(course)
    bare = _publish(course, tmp_path / "handout.git")
    committed, editing = tmp_path / "committed", tmp_path / "editing"
    for learner in (committed, editing):
        git("clone", "-q", bare, learner)
    ex02 = "exercises/02_ddp.ipynb"
    shipped = (committed / ex02).read_text()
    mine = shipped.replace("TODO", "MY WORK", 1)
    (committed / ex02).write_text(mine)
    git("commit", "-qam", "my exercise 02", cwd=committed)
    (committed / "exercises/03_syncbn.ipynb").write_text("unsaved work in progress")  # not committed
    (editing / ex02).write_text(mine)  # never commits

    lesson = course / "notebooks/01_single_device.ipynb"
    lesson.write_text(lesson.read_text().replace("# 01", "# 01 (updated)", 1))
    git("commit", "-qam", "a lesson is updated", cwd=course)
    second = handout.build(course)
    assert second.changed and second.parent == first.commit, "the update goes on top of the first"
    git("push", "-q", bare, "handout:main", cwd=course)  # no --force: a fast-forward
    assert handout.build(course).changed is False, "nothing new: no empty commit"

    for learner in (committed, editing):
        pulled = git("pull", "--rebase", "--autostash", cwd=learner, check=False)
        assert pulled.returncode == 0, pulled.stderr
        assert "# 01 (updated)" in (learner / "notebooks/01_single_device.ipynb").read_text()
        assert (learner / ex02).read_text() == mine, "the learner's work is kept"
        ids, paths = _objects(learner)
        assert not ids & _secrets(course) and not [p for p in paths if handout._left_out(p)]
    assert (committed / "exercises/03_syncbn.ipynb").read_text() == "unsaved work in progress"
    assert git("log", "-1", "--format=%s", cwd=committed).stdout.strip() == "my exercise 02"
    assert git("rev-list", "--merges", "--count", "HEAD", cwd=committed).stdout.strip() == "0"

    # Their own commit is not what restore brings back: the course's version is, from any folder.
    for folder in ("exercises", "notebooks", "exercises/scripts"):
        (committed / folder).mkdir(exist_ok=True)
        (committed / ex02).write_text(mine)
        done = subprocess.run([sys.executable, "-m", "labkit.exercises", "restore", "02"],
                              cwd=committed / folder, capture_output=True, text=True, timeout=60,
                              env=dict(os.environ, PYTHONPATH=str(committed)))
        assert done.returncode == 0, done.stderr
        assert (committed / ex02).read_text() == shipped, folder
        assert "restored exercise 02" in done.stdout


def test_make_handout_runs_the_module(course):
    make = shutil.which("make")
    if make is None:
        pytest.skip("needs make, which this machine lacks")
    done = subprocess.run([make, "-C", str(course), "handout", f"PYTHON={sys.executable}"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "the first: a commit with no parent" in done.stdout
    assert "left out: solutions/ (the worked answers)" in done.stdout
    assert "git push <learners' repository> handout:main" in done.stdout


# -- the guard: no line of an answer in what learners get ------------------------------------------
def test_no_line_of_an_answer_is_handed_out():
    """For every BEGIN SOLUTION ... END SOLUTION region, no non-trivial line of it is in any file
    of the hand-out, outside the teaching material (lessons, exercise skeletons, labkit)."""
    files = _files_now()
    answers = handout.answer_lines(files)
    assert len(answers) > 50, "the regions hold the answers"
    assert handout.answer_leaks(handout.handout_files(files), answers) == []


def test_the_guard_finds_an_answer_a_file_quotes():
    files = _files_now()
    answers = handout.answer_lines(files)
    # Without the cut, tests/test_checks.py (or tests/exercises/) quotes the answers.
    uncut = {p: f for p, f in files.items() if not p.startswith("solutions/")}
    assert handout.answer_leaks(uncut, answers), "the guard sees the quoted answers"
    source, line = next((s, l) for s, l in answers if "model_bytes" in l)
    quoted = {**handout.handout_files(files),
              "tests/test_mine.py": File("100644", None, f'OLD = "    {line}\\n"\n'.encode())}
    assert handout.answer_leaks(quoted, answers) == [f"tests/test_mine.py holds a line of {source}: {line!r}"]


def test_the_hand_outs_own_tests_skip_what_needs_the_answers_and_say_why(tmp_path):
    out = tmp_path / "handout"
    for path, file in handout.handout_files(_files_now()).items():
        (out / path).parent.mkdir(parents=True, exist_ok=True)
        (out / path).write_bytes(file.data)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-rs", "-p", "no:cacheprovider", "-m", "solutions",
         "tests/test_checks.py", "tests/test_exercises.py"],
        cwd=out, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=str(out), LABKIT_SMOKE="1"))
    assert done.returncode == 0, done.stdout[-3000:]
    report = done.stdout
    assert "a workshop's hand-out: left out solutions/ (the worked answers)" in report
    skipped = [line for line in report.splitlines() if line.startswith("SKIPPED [")]
    assert skipped and all("needs solutions/, which this copy of the course leaves out" in line
                           for line in skipped), report
    counted = sum(int(line.split("[", 1)[1].split("]", 1)[0]) for line in skipped)
    assert f"{counted} skipped" in report and "passed" not in report and "failed" not in report
    assert not (out / "tests" / "exercises").exists(), "the wrong answers are left out with solutions/"


# -- what a hand-out refuses -----------------------------------------------------------------------
def test_a_hand_out_is_not_made_from_a_stale_exercise(course):
    nb = course / "exercises/02_ddp.ipynb"
    nb.write_text(nb.read_text().replace("TODO", "T0D0", 1))
    git("commit", "-qam", "an exercise edited by hand", cwd=course)
    with pytest.raises(ValueError, match=r"exercises/02_ddp.ipynb differ from what solutions/ generates.*make exercises"):
        handout.build(course)


def test_a_hand_out_is_not_made_from_a_hand_out_nor_onto_another_branch(course, tmp_path):
    git("branch", "handout", cwd=course)  # a branch of that name that holds the course itself
    with pytest.raises(ValueError, match=r"the branch 'handout' exists and is not a hand-out"):
        handout.build(course)
    built = handout.build(course, branch="workshop")
    learner = tmp_path / "learner"
    git("clone", "-q", "-b", "workshop", course, learner)
    with pytest.raises(ValueError, match=r"holds no solutions/: it is a hand-out already"):
        handout.build(learner)


@pytest.mark.parametrize("text, match", [
    ("a\n<!-- hand-out: leave out -->\nb\n", r"README.md, line 2: .* never closed.*<!-- hand-out: end -->"),
    ("<!-- hand-out: instead\nb\n", r"README.md, line 1: .* never closed.*-->"),
    ("<!-- hand-out: leave out -->\n<!-- hand-out: instead\n", r"README.md, line 2: a hand-out marker inside"),
])
def test_unbalanced_markers_are_a_clear_error(text, match):
    with pytest.raises(ValueError, match=match):
        handout._markdown("README.md", text)


def test_markers_leave_out_and_put_in():
    text = ("keep\n<!-- hand-out: leave out -->\nfor instructors\n<!-- hand-out: end -->\n"
            "<!-- hand-out: instead\nfor learners\n-->\nend\n")
    assert handout._markdown("README.md", text) == "keep\nfor learners\nend\n"


def test_a_name_the_hand_out_cuts_must_still_be_there():
    with pytest.raises(ValueError, match=r"tests/x.py no longer defines GONE.*ANSWERS_IN"):
        handout._cut_answers("tests/x.py", "KEPT = {'a': 'answer'}\n", ("KEPT", "GONE"))
    assert handout._cut_answers("tests/x.py", "A = {'a': 1,\n     'b': 2}\nB = 'x'\nC = 3\n", ("A", "B")) == (
        'A = dict.fromkeys([  # the values quote the answers: not in a hand-out\n    "a",\n    "b",\n])\nC = 3\n')


def test_the_last_hint_in_a_hand_out_does_not_point_to_solutions(tmp_path, monkeypatch):
    import labkit
    from labkit._course import folder as _course

    (tmp_path / "labkit").mkdir()
    (tmp_path / "labkit" / "__init__.py").write_text("")
    (tmp_path / "exercises").mkdir()
    monkeypatch.chdir(tmp_path / "exercises")  # a learner's hand-out, without solutions/
    last = labkit.hint("02-ddp", labkit.hint("02-ddp").total)
    assert "solutions/" not in str(last) and "ask your instructor" in str(last)
    monkeypatch.setattr(_course, "find_root", lambda start=None: ROOT)  # the course itself
    assert "the full answer is in solutions/" in str(labkit.hint("02-ddp", last.number))
