"""A workshop's hand-out: the course without its answers, on a git branch that learners clone.

From a terminal in the course folder (``make handout`` runs the same)::

    python -m labkit.handout            # the branch `handout`, made from the last commit

The branch holds hand-out commits only. The first has no parent: none of the course's history,
so no earlier version of ``solutions/``, travels with it. Each later run adds one commit on top
of the last, so that learners who cloned it take an update with ``git pull``. The README's
section for instructors has the whole recipe: a new repository, the push, the learners' clone,
an update.

What a hand-out leaves out is listed once, here: ``LEFT_OUT`` (folders and files),
``ANSWERS_IN`` (the parts of a kept Python file that quote the answers) and, in every Markdown
file, the lines between ``<!-- hand-out: leave out -->`` and ``<!-- hand-out: end -->``; a
block that opens with ``<!-- hand-out: instead`` and closes with ``-->`` holds the lines a
learner reads in their place. Before it commits, this module checks that ``exercises/`` is what
``solutions/`` generates and that no line of an answer is left (``answer_leaks``).

``restore`` (``make restore EX=02``) in a hand-out takes the exercise from the newest hand-out
commit in the learner's history (``shipped``), never from a commit of the learner's own.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

from labkit._course import exercises, git
from labkit._course.folder import find_root
from labkit._course.git import File, read_commit

__all__ = ["LEFT_OUT", "ANSWERS_IN", "TRAILER", "File", "read_commit", "handout_files",
           "answer_lines", "answer_leaks", "stale_exercises", "build", "shipped", "main"]

# -- what a hand-out leaves out: the one list -------------------------------------------------
LEFT_OUT = {
    "solutions/": "the worked answers",
    "tests/exercises/": "each exercise's deliberately wrong answers, made from the solutions",
}
# Top-level names of a kept Python file whose values quote the answers. A dict keeps its keys
# (the tests it feeds are still listed, and skip saying why: they need solutions/); any other
# value goes. Empty: every test that quotes an answer lives in tests/exercises/ (LEFT_OUT).
ANSWERS_IN: dict[str, tuple[str, ...]] = {}
# The teaching material a learner is meant to read: an answer line that also appears here
# (a lesson teaches it, an exercise's skeleton keeps it, labkit's hints end with the answer by
# design, the lessons display labkit's layers) is not a leak. Every other file is searched.
TAUGHT = ("notebooks/", "exercises/", "labkit/")
TRAILER = "Course-Hand-Out"  # the line that marks a hand-out commit: "Course-Hand-Out: <source commit>"
SHORTEST_ANSWER = 12  # characters of code (no spaces or quotes); shorter lines ("n = x[-1]") are trivial

_LEAVE_OUT = re.compile(r"^\s*<!--\s*hand-out:\s*leave out\s*-->\s*$")
_LEAVE_END = re.compile(r"^\s*<!--\s*hand-out:\s*end\s*-->\s*$")
_INSTEAD = re.compile(r"^\s*<!--\s*hand-out:\s*instead\s*$")
_CLOSE = re.compile(r"^\s*-->\s*$")
_SOLUTION = re.compile(r"solutions/(\d\d_\w+\.ipynb)")


# -- what changes ---------------------------------------------------------------------------------
def _left_out(path: str) -> bool:
    return any(path == prefix.rstrip("/") or path.startswith(prefix) for prefix in LEFT_OUT)


def _cut_answers(path: str, text: str, names: tuple[str, ...]) -> str:
    """``text`` without the values of ``names`` (top-level assignments): a dict keeps its keys."""
    tree = ast.parse(text, filename=path)
    found = {node.targets[0].id: node for node in tree.body
             if isinstance(node, ast.Assign) and len(node.targets) == 1
             and isinstance(node.targets[0], ast.Name) and node.targets[0].id in names}
    missing = [name for name in names if name not in found]
    if missing:
        raise ValueError(f"{path} no longer defines {', '.join(missing)}, which a hand-out leaves "
                         f"out. HINT: if they moved (to tests/exercises/, say), take them out of "
                         f"ANSWERS_IN in labkit/handout.py.")
    lines = text.splitlines(keepends=True)
    for name, node in sorted(found.items(), key=lambda item: -item[1].lineno):
        new = []
        if isinstance(node.value, ast.Dict) and all(isinstance(k, ast.Constant) for k in node.value.keys):
            new = [f"{name} = dict.fromkeys([  # the values quote the answers: not in a hand-out\n",
                   *(f"    {json.dumps(k.value)},\n" for k in node.value.keys), "])\n"]
        lines[node.lineno - 1:node.end_lineno] = new
    return "".join(lines)


def _markdown(path: str, text: str) -> str:
    """``text`` as a learner reads it: leave-out blocks dropped, instead blocks shown."""
    out, block, opened = [], None, 0
    for number, line in enumerate(text.splitlines(keepends=True), 1):
        if block is None and _LEAVE_OUT.match(line):
            block, opened = "leave out", number
        elif block is None and _INSTEAD.match(line):
            block, opened = "instead", number
        elif block == "leave out" and _LEAVE_END.match(line):
            block = None
        elif block == "instead" and _CLOSE.match(line):
            block = None
        elif _LEAVE_OUT.match(line) or _INSTEAD.match(line) or _LEAVE_END.match(line):
            raise ValueError(f"{path}, line {number}: a hand-out marker inside the block opened "
                             f"on line {opened}. HINT: close that one first.")
        elif block != "leave out":
            out.append(line)
    if block is not None:
        closer = "<!-- hand-out: end -->" if block == "leave out" else "-->"
        raise ValueError(f"{path}, line {opened}: the hand-out block opened here is never "
                         f"closed. HINT: end it with {closer}.")
    return "".join(out)


def handout_files(files: dict[str, File]) -> dict[str, File]:
    """The hand-out's files from the course's: LEFT_OUT dropped, ANSWERS_IN cut, Markdown edited."""
    out = {}
    for path, file in files.items():
        if _left_out(path):
            continue
        text = None
        if path in ANSWERS_IN:
            text = _cut_answers(path, file.data.decode(), ANSWERS_IN[path])
        elif path.endswith(".md"):
            text = _markdown(path, file.data.decode())
        if text is not None and text.encode() != file.data:
            file = File(file.mode, None, text.encode())
        out[path] = file
    return out


# -- the guards -----------------------------------------------------------------------------------
def _squeeze(text: str) -> str:
    """Code without spaces, quotes or backslashes: a line matches however a file quotes it."""
    return re.sub(r"[\s'\"\\]+", "", text)


def _text(path: str, data: bytes) -> str | None:
    try:
        text = data.decode()
    except UnicodeDecodeError:
        return None  # an image, say: it holds no line of code
    if path.endswith(".ipynb"):
        return "\n".join("".join(cell.get("source", "")) for cell in json.loads(text)["cells"])
    return text


def answer_lines(files: dict[str, File]) -> list[tuple[str, str]]:
    """(solution notebook, line) for every non-trivial line of every solution region."""
    found = []
    for path, file in sorted(files.items()):
        if not _SOLUTION.fullmatch(path):
            continue
        for cell in json.loads(file.data)["cells"]:
            inside = False
            for line in "".join(cell.get("source", "")).split("\n"):
                if exercises._BEGIN.match(line):
                    inside = True
                elif exercises._END.match(line):
                    inside = False
                elif inside:
                    code = line.split("  #")[0] if cell["cell_type"] == "code" else line
                    if not code.strip().startswith("#") and len(_squeeze(code)) >= SHORTEST_ANSWER:
                        found.append((path, code.strip()))
    return found


def answer_leaks(handout: dict[str, File], answers: list[tuple[str, str]]) -> list[str]:
    """Each answer line that a file of the hand-out holds, outside the teaching material.

    Returns lines like ``tests/test_checks.py holds a line of solutions/03_syncbn.ipynb: '...'``.
    """
    texts = {path: _text(path, file.data) for path, file in handout.items()}
    taught = _squeeze("\n".join(t for p, t in texts.items() if t and p.startswith(TAUGHT)))
    leaks = []
    for source, line in answers:
        key = _squeeze(line)
        if key in taught:
            continue
        leaks += [f"{path} holds a line of {source}: {line!r}" for path, text in sorted(texts.items())
                  if text and not path.startswith(TAUGHT) and key in _squeeze(text)]
    return leaks


def stale_exercises(files: dict[str, File]) -> list[str]:
    """Exercise notebooks that differ from what their solution generates (or are missing)."""
    stale = []
    for path, file in sorted(files.items()):
        match = _SOLUTION.fullmatch(path)
        if match:
            name = match[1]
            want = exercises.dumps(exercises.exercise_notebook(json.loads(file.data), name=name))
            have = files.get(f"exercises/{name}")
            if have is None or have.data.decode() != want:
                stale.append(f"exercises/{name}")
    return stale


# -- the branch -----------------------------------------------------------------------------------
class Built(NamedTuple):
    branch: str
    commit: str
    parent: str | None   # the previous hand-out commit; None for the first (an orphan)
    source: str          # the course's commit it was made from
    changed: bool        # False: the branch already held this hand-out


def build(root=None, *, rev: str = "HEAD", branch: str = "handout") -> Built:
    """Make the hand-out of commit ``rev`` and put it on ``branch``; return what was done.

    Raises:
        ValueError: ``rev`` holds no solutions/ (a hand-out already), exercises/ is out of date,
            an answer line would be handed out, or ``branch`` exists and is not a hand-out.
        RuntimeError: git failed (its message is kept).
    """
    root = Path(root) if root is not None else (find_root() or Path.cwd())
    source = git.commit_id(root, rev)
    if source is None:
        raise ValueError(f"{rev!r} is not a commit in {root}. HINT: run this in the course folder.")
    files = read_commit(root, source)
    if not any(path.startswith("solutions/") for path in files):
        raise ValueError(f"commit {source[:12]} holds no solutions/: it is a hand-out already. HINT: "
                         f"make the hand-out in the course's own repository.")
    stale = stale_exercises(files)
    if stale:
        raise ValueError(f"in commit {source[:12]}, {', '.join(stale)} differ from what solutions/ "
                         f"generates. HINT: `make exercises`, commit, then make the hand-out.")
    handout = handout_files(files)
    leaks = answer_leaks(handout, answer_lines(files))
    if leaks:
        raise ValueError("the hand-out would hold answers:\n  " + "\n  ".join(leaks) + "\nHINT: leave "
                         "that file or part out (labkit/handout.py lists what is left out).")
    tree = git.write_tree(root, handout)
    parent = git.commit_id(root, f"refs/heads/{branch}")
    if parent is not None:
        if not re.search(rf"^{TRAILER}: ", git.run(root, "log", "-1", "--format=%B", parent), re.M):
            raise ValueError(f"the branch {branch!r} exists and is not a hand-out. HINT: choose "
                             f"another name (--branch), or delete that branch.")
        if git.run(root, "rev-parse", f"{parent}^{{tree}}") == tree:
            return Built(branch, parent, None, source, False)
    message = f"Course hand-out, made by `make handout`\n\n{TRAILER}: {source}\n"
    commit = git.run(root, "commit-tree", tree, *(["-p", parent] if parent else []), data=message.encode())
    kept_out = [path for path in git.run(root, "rev-list", "--objects", commit).splitlines()
                if " " in path and _left_out(path.split(" ", 1)[1])]
    assert not kept_out, kept_out  # the history holds only hand-out trees: never a left-out path
    git.run(root, "update-ref", f"refs/heads/{branch}", commit, parent or "")
    return Built(branch, commit, parent, source, True)


def shipped(root: Path, path: str) -> str:
    """The text of ``path`` as the course handed it out.

    From the newest hand-out commit in this copy's history (a learner's own commits are never
    one), or, in a copy made without ``make handout``, from its first commit.

    Raises:
        FileNotFoundError: no git history, or the hand-out had no such file.
    """
    try:
        commit = git.run(root, "log", "-1", "--format=%H", f"--grep=^{TRAILER}: ", "HEAD")
        if not commit:
            commit = git.run(root, "rev-list", "--max-parents=0", "HEAD").splitlines()[-1]
    except (RuntimeError, OSError, subprocess.SubprocessError):
        raise FileNotFoundError(
            f"cannot restore {path}: there is no solutions/ folder to regenerate it from, and no git "
            f"history to take it from. HINT: ask for a fresh copy of the course.") from None
    try:
        return git.run_bytes(root, "show", f"{commit}:{path}").decode()
    except RuntimeError:
        raise FileNotFoundError(f"{path} is not in the course as it was handed out (commit "
                                f"{commit[:12]}). HINT: is it a notebook of your own?") from None


# -- the command line -----------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labkit.handout",
                                     description="Make a workshop's hand-out: the course without its answers.")
    parser.add_argument("--root", default=None, help="the course folder (default: the one you are in)")
    parser.add_argument("--from", dest="rev", default="HEAD", help="the commit to make it from (HEAD)")
    parser.add_argument("--branch", default="handout", help="the branch that holds the hand-outs")
    args = parser.parse_args(argv)
    try:
        built = build(args.root, rev=args.rev, branch=args.branch)
    except (ValueError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    root = Path(args.root) if args.root else (find_root() or Path.cwd())
    if args.rev == "HEAD" and git.run(root, "status", "--porcelain", "--untracked-files=no"):
        print(f"note: your uncommitted changes are not in it: it is made from commit {built.source[:12]}.")
    if not built.changed:
        print(f"the branch {built.branch} already holds this hand-out ({built.commit[:12]}): nothing to do.")
        return 0
    how = (f"on top of the previous hand-out {built.parent[:12]}: learners take it with "
           f"git pull --rebase --autostash"
           if built.parent else "the first: a commit with no parent, so no earlier history")
    print(f"branch {built.branch}: hand-out {built.commit[:12]} from commit {built.source[:12]}, {how}.")
    cut = f"; the answer-quoting parts of {', '.join(ANSWERS_IN)}" if ANSWERS_IN else ""
    print("left out: " + "; ".join(f"{path} ({why})" for path, why in LEFT_OUT.items()) + cut + ".")
    print(f"next: git push <learners' repository> {built.branch}:main   (README: For instructors)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
