"""The course folder: the one that holds ``labkit/`` and ``exercises/``, found from where you are.

Standard library only. ``make restore`` and ``python -m labkit.exercises`` use it to find the
course from any folder inside it (``notebooks/``, ``exercises/``, ``exercises/scripts/``), and
``labkit.doctor()`` to tell whether the labkit a kernel imports is this course's own.
"""

from __future__ import annotations

from pathlib import Path


def is_course(folder: Path) -> bool:
    """True when ``folder`` is a copy of the course (the full one or a workshop's hand-out)."""
    return (folder / "labkit" / "__init__.py").is_file() and (folder / "exercises").is_dir()


def find_root(start: str | Path | None = None) -> Path | None:
    """The course folder that holds ``start`` (default: the current folder), or None.

    Looks in ``start`` and then in each folder above it, so that a command run in
    ``notebooks/`` or ``exercises/`` finds the course it is in.
    """
    here = Path.cwd() if start is None else Path(start)
    here = here.resolve()
    for folder in (here, *here.parents):
        if is_course(folder):
            return folder
    return None


def package_root() -> Path:
    """The folder that holds the ``labkit`` package this interpreter imported.

    The course folder itself for the course's own ``.venv`` (labkit installed in editable mode);
    another folder for a kernel from another environment or another copy of the course.
    """
    return Path(__file__).resolve().parents[2]
