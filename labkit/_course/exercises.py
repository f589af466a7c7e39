"""Exercises from solutions: one source, two notebooks.

The notebooks in ``solutions/`` are the single source. Each region a learner
should write is fenced with markers (nbgrader's, with an optional TODO)::

    ### BEGIN SOLUTION: wrap the model in DDP, after moving it to its device
    model = DDP(model, device_ids=...)
    ### END SOLUTION

``generate()`` writes ``exercises/`` from them: each region becomes a stub that
says what to do and stops the script there::

    # TODO: wrap the model in DDP, after moving it to its device
    raise NotImplementedError("TODO: wrap the model in DDP, after moving it to its device")

In a markdown cell the region becomes *Your answer here.* Outputs are
cleared, and the result is the same, byte for byte, every time; a test
regenerates the exercises and fails if they differ from what is committed.

From a terminal (the Makefile's ``make exercises`` runs the first)::

    python -m labkit.exercises generate          # solutions/*.ipynb -> exercises/*.ipynb
    python -m labkit.exercises check             # exit 1 if exercises/ is out of date
    python -m labkit.exercises restore 02        # back up exercises/02_*.ipynb, then regenerate it

``make restore EX=02`` runs the last with the course's own Python. Both work from any folder
inside the course. In a hand-out (no ``solutions/``) restore takes the exercise from the newest
hand-out commit (``labkit.handout``), never from a commit of the learner's own.

A learner's work is never lost: an exercise notebook that differs from what
would be generated is copied to ``exercises/backup/`` before it is replaced (a visible folder,
so that JupyterLab can open it; git ignores it).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from pathlib import Path

from labkit._course.folder import find_root, is_course, package_root
from labkit._course.checks import parse_exercise

__all__ = ["strip_solutions", "exercise_notebook", "generate", "stale", "restore", "main"]

_BEGIN = re.compile(r"^(?P<indent>[ \t]*)### BEGIN SOLUTION(?::[ \t]*(?P<todo>.*?))?[ \t]*$")
_END = re.compile(r"^[ \t]*### END SOLUTION[ \t]*$")
_DEFAULT_TODO = "write this part"


def strip_solutions(source: str, *, markdown: bool = False, where: str = "cell") -> str:
    """Replace every solution region of one cell's source with its stub.

    Args:
        source: the cell's text.
        markdown: True for a markdown cell (the stub is *Your answer here.*).
        where: names the cell in error messages.

    Raises:
        ValueError: unbalanced or nested markers (with the line).
    """
    out: list[str] = []
    opened = None
    for number, line in enumerate(source.split("\n"), 1):
        begin, end = _BEGIN.match(line), _END.match(line)
        if begin:
            if opened:
                raise ValueError(f"{where}, line {number}: BEGIN SOLUTION inside another "
                                 f"(opened on line {opened[0]}). HINT: close it with END SOLUTION first.")
            opened = (number, begin["indent"], begin["todo"] or _DEFAULT_TODO)
        elif end:
            if not opened:
                raise ValueError(f"{where}, line {number}: END SOLUTION without a BEGIN SOLUTION.")
            _, indent, todo = opened
            if markdown:
                out.append(f"{indent}*Your answer here.*")
            else:
                out.append(f"{indent}# TODO: {todo}")
                out.append(f"{indent}raise NotImplementedError({json.dumps('TODO: ' + todo, ensure_ascii=False)})")
            opened = None
        elif not opened:
            out.append(line)
    if opened:
        raise ValueError(f"{where}, line {opened[0]}: BEGIN SOLUTION is never closed. "
                         f"HINT: add ### END SOLUTION.")
    return "\n".join(out)


def _source(cell: dict) -> str:
    src = cell.get("source", "")
    return src if isinstance(src, str) else "".join(src)


def dumps(nb: dict) -> str:
    """A notebook as nbformat writes it: sorted keys, one-space indent, a final newline."""
    return json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def exercise_notebook(solution: dict, *, name: str = "solution") -> dict:
    """The exercise notebook for a solution notebook (a new dict; outputs cleared).

    Raises:
        ValueError: a solution region in a code cell that is not a ``%%writefile`` script
            (its stub would stop the notebook before the check cell could say what is missing).
    """
    cells = []
    for index, cell in enumerate(solution["cells"]):
        kind, source = cell["cell_type"], _source(cell)
        where = f"{name}, cell {index}"
        if kind == "code" and not source.startswith("%%writefile") and \
                any(_BEGIN.match(line) for line in source.split("\n")):
            raise ValueError(f"{where}: a solution region outside a %%writefile script. HINT: put "
                             f"it in the script (the check then reports the TODO) or in markdown.")
        text = strip_solutions(source, markdown=kind == "markdown", where=where)
        new = {key: value for key, value in cell.items() if key not in ("outputs", "execution_count")}
        new["source"] = text.splitlines(keepends=True)
        if kind == "code":
            new["outputs"], new["execution_count"] = [], None
        cells.append(new)
    metadata = dict(solution.get("metadata", {}))
    metadata["labkit"] = {"generated_from": f"solutions/{name}",
                          "note": "generated by `make exercises`: edit the solution, not this file"}
    return {**solution, "cells": cells, "metadata": metadata}


def _root(root) -> Path:
    """The course folder: ``root`` if given, else the one you are in (from any folder inside
    it), else the one this labkit belongs to."""
    if root is not None:
        return Path(root)
    found = find_root()
    if found is None and is_course(package_root()):
        found = package_root()
    if found is None:
        raise FileNotFoundError(f"{Path.cwd()} is not inside a copy of the course (a folder that holds "
                                f"labkit/ and exercises/). HINT: cd into the course folder, or pass --root.")
    return found


def _pairs(root: Path, which: str | None = None) -> list[tuple[Path, Path]]:
    solutions = _notebooks(root / "solutions")
    if not solutions:
        if (root / "exercises").is_dir():
            raise FileNotFoundError(
                "this copy of the course has no solutions/ folder (a hand-out), so the exercises "
                "cannot be generated here. HINT: to put one exercise back as it was handed out, "
                "`make restore EX=02`.")
        raise FileNotFoundError(f"no solution notebooks in {root / 'solutions'}. "
                                f"HINT: run this from the course's folder.")
    if which is not None:
        solutions = [_one(solutions, which, root / "solutions")]
    return [(s, root / "exercises" / s.name) for s in solutions]


def _notebooks(folder: Path) -> list[Path]:
    """The course's notebooks in a folder: NN_name.ipynb, not a learner's copy such as
    '02_ddp-Copy1.ipynb' (JupyterLab's Duplicate) or '02_ddp (1).ipynb'."""
    return sorted(p for p in folder.glob("[0-9][0-9]_*.ipynb") if re.fullmatch(r"\d\d_\w+\.ipynb", p.name))


def _one(notebooks: list[Path], which: str, where: Path) -> Path:
    """The one notebook ``which`` names, or a ValueError that says why not."""
    matches = _named(notebooks, which)
    if len(matches) > 1:
        raise ValueError(f"{which!r} names {len(matches)} notebooks in {where}: "
                         f"{', '.join(p.name for p in matches)}. HINT: give the full name, e.g. "
                         f"{matches[0].stem!r}.")
    if not matches:
        raise ValueError(f"no exercise {which!r}; there are: "
                         f"{', '.join(p.stem for p in notebooks)} (in {where}). "
                         f"HINT: its number, name or id, e.g. '02', '02_ddp' or '02-ddp'.")
    return matches[0]


def _named(notebooks: list[Path], which: str) -> list[Path]:
    """The notebooks ``which`` names: a number ('02' or '2'), a name ('02_ddp'), an id ('02-ddp',
    as the notebook's title gives it). Read as ``labkit.hint`` reads it (``labkit._course.checks.parse_exercise``)."""
    parsed = parse_exercise(which)
    if parsed is None:
        return []
    number, exercise, stem = parsed
    ours = [p for p in notebooks if p.name[:2] == number]
    if stem is not None:
        return [p for p in ours if p.stem == stem]
    if exercise is not None:
        return [p for p in ours if f"Exercise id: `{exercise}`" in p.read_text(encoding="utf-8")]
    return ours


def _render(solution: Path) -> str:
    nb = json.loads(solution.read_text(encoding="utf-8"))
    return dumps(exercise_notebook(nb, name=solution.name))


def _back_up(path: Path) -> Path:
    folder = path.parent / "backup"
    folder.mkdir(exist_ok=True)
    backup = folder / f"{path.stem}-{time.strftime('%Y%m%d-%H%M%S')}.ipynb"
    n = 1
    while backup.exists():
        n += 1
        backup = folder / f"{path.stem}-{time.strftime('%Y%m%d-%H%M%S')}-{n}.ipynb"
    shutil.copy2(path, backup)
    return backup


def generate(root=None, *, which: str | None = None) -> list[Path]:
    """Write ``exercises/NN_*.ipynb`` from ``solutions/NN_*.ipynb``; return the files changed.

    A notebook that already holds exactly what would be written is left alone; one that
    differs is first copied to ``exercises/backup/``.
    """
    changed = []
    for solution, exercise in _pairs(_root(root), which):
        text = _render(solution)
        if exercise.exists():
            if exercise.read_text(encoding="utf-8") == text:
                continue
            _back_up(exercise)
        exercise.parent.mkdir(exist_ok=True)
        exercise.write_text(text, encoding="utf-8")
        changed.append(exercise)
    return changed


def stale(root=None) -> list[Path]:
    """Exercise notebooks that are missing or differ from what ``generate`` would write."""
    return [exercise for solution, exercise in _pairs(_root(root))
            if not exercise.exists() or exercise.read_text(encoding="utf-8") != _render(solution)]


def _committed(root: Path, which: str) -> tuple[Path, str]:
    """(exercise path, its text as the course handed it out): for a hand-out without solutions/.
    Never a learner's own commit: see ``labkit._course.handout.shipped``."""
    from labkit._course.handout import shipped

    exercise = _one(_notebooks(root / "exercises"), which, root / "exercises")
    return exercise, shipped(root, f"exercises/{exercise.name}")


def restore(which: str, root=None) -> Path | None:
    """Put exercise ``which`` (e.g. ``"02"``) back as it was handed out.

    The original comes from ``solutions/`` when the course has it, else from git: the newest
    hand-out commit, never a commit of your own. Returns the backup of your version (None if
    it was unchanged). Works from any folder inside the course (``notebooks/``, ``exercises/``).
    Reopen the notebook afterwards (JupyterLab: File → Reload Notebook from Disk).
    """
    root = _root(root)
    if (root / "solutions").is_dir():
        (solution, exercise), = _pairs(root, which)
        original = _render(solution)
    else:
        exercise, original = _committed(root, which)
    backup = None
    if exercise.exists() and exercise.read_text(encoding="utf-8") != original:
        backup = _back_up(exercise)
    exercise.write_text(original, encoding="utf-8")
    return backup


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labkit.exercises",
                                     description="Exercises generated from solutions.")
    parser.add_argument("--root", default=None, help="the course folder (holds solutions/)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("generate", help="write exercises/ from solutions/")
    sub.add_parser("check", help="exit 1 if exercises/ is out of date")
    rest = sub.add_parser("restore", help="restore one exercise notebook (your version is backed up)")
    rest.add_argument("which", help="the exercise's number or name, e.g. 02 or 02_ddp")
    args = parser.parse_args(argv)
    try:
        return _command(args)
    except (ValueError, FileNotFoundError) as err:  # a mistyped name, a missing folder: one line
        print(f"error: {err}", file=sys.stderr)
        return 2


def _command(args: argparse.Namespace) -> int:
    if args.command == "generate":
        changed = generate(args.root)
        print("\n".join(f"wrote {p}" for p in changed) or "exercises are up to date")
    elif args.command == "check":
        out_of_date = stale(args.root)
        if out_of_date:
            print("out of date (run `make exercises`):\n" + "\n".join(f"  {p}" for p in out_of_date))
            return 1
        print("exercises are up to date")
    else:
        backup = restore(args.which, args.root)
        print(f"restored exercise {args.which}; your version is in {backup}. Open the notebook "
              f"again (or File → Reload Notebook from Disk) to see it." if backup else
              f"exercise {args.which} is as it was handed out: nothing to restore")
    return 0


if __name__ == "__main__":
    sys.exit(main())
