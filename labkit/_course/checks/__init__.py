"""The exercises' checks: run (or read) the learner's launch and say, in words, what is right and wrong.

One module per exercise, and nothing else lists the exercises. ``exNN_<name>.py`` holds all
that exercise NN is: ``EXERCISE = "NN-<id>"`` (the id in its notebook's title), ``HINTS`` (the
progressive hints, the first a nudge, the last all but the answer), its constants, and the
public ``check_<name>``. This package finds the modules by their file names, so that
``labkit.check_<name>`` and ``labkit.hint("NN-<id>", k)`` work as soon as a module is added.
``_common`` holds what several checks share, ``_saved`` a checkpoint read back as a resume reads it (05); ``labkit._course.feedback`` says how a check is written.

Each ``check_*`` takes the exercise's script (it launches it, showing every rank's output) or
a finished Run, and returns a Feedback. It never raises for a mistake in the learner's code:
a TODO not done yet, an exception in a rank or a wrong number all become findings. Each check
reads what the exercise's script logs outside its TODO regions, its settings included.

Used by the notebooks in ``exercises/`` and ``solutions/``::

    labkit.check_ddp("scripts/ex02_ddp.py")

Standard library only, and listing the checks imports none of them: ``import labkit`` (in
every rank too) reads the names of the files here.
"""

from __future__ import annotations

import importlib
import os
import re

_MODULE = re.compile(r"ex(?P<number>\d\d)_(?P<name>[a-z][a-z0-9_]*)\.py")
_WHICH = re.compile(r"(?P<number>\d+)(?:(?P<sep>[-_])(?P<rest>[A-Za-z0-9][A-Za-z0-9_-]*))?")


def _modules() -> dict[str, str]:
    """{'02': 'ex02_ddp', ...}: the module of every exercise in this package, by number."""
    found: dict[str, str] = {}
    for folder in __path__:
        for file in sorted(os.listdir(folder)):
            match = _MODULE.fullmatch(file)
            if not match:
                continue
            number, name = match["number"], match["name"]
            twin = found.get(number) or next((m for m in found.values() if m[5:] == name), None)
            if twin:
                raise RuntimeError(f"labkit/_course/checks has {twin}.py and {file}: one module per exercise, "
                                   f"each with its own number and name (its check is check_<name>).")
            found[number] = file[:-3]
    return dict(sorted(found.items()))


def _checks() -> dict[str, str]:
    """{'check_ddp': 'ex02_ddp', ...}: each exercise's public check and its module, in order."""
    return {f"check_{_MODULE.fullmatch(module + '.py')['name']}": module for module in _modules().values()}


def check_names() -> list[str]:
    """The public check of every exercise, in order (``['check_hello', ...]``); imports nothing."""
    return list(_checks())


def _load(module: str):
    return importlib.import_module(f"{__name__}.{module}")


def exercises() -> dict:
    """{exercise id: its module} for every exercise, in order (``{'00-hello': <module>, ...}``).

    Raises:
        RuntimeError: a module whose ``EXERCISE`` does not start with its file's number.
    """
    found = {}
    for number, name in _modules().items():
        module = _load(name)
        exercise = getattr(module, "EXERCISE", "")
        if not re.fullmatch(rf"{number}-[a-z0-9][a-z0-9-]*", exercise):
            raise RuntimeError(f"labkit/_course/checks/{name}.py sets EXERCISE = {exercise!r}: it should be "
                               f"'{number}-<id>', the id in the exercise notebook's title.")
        found[exercise] = module
    return found


def parse_exercise(which) -> tuple[str, str | None, str | None] | None:
    """What ``which`` says about an exercise: ``(number, id, notebook stem)``, or None.

    Every way a learner names an exercise (``labkit.hint``, ``make restore EX=...``) is read here::

        parse_exercise("02")            # ('02', None, None): by number (also '2' or 2)
        parse_exercise("02-ddp")        # ('02', '02-ddp', None): by id, as in the notebook's title
        parse_exercise("02_ddp.ipynb")  # ('02', None, '02_ddp'): by the notebook's name
    """
    key = str(which).strip().removesuffix(".ipynb")
    match = _WHICH.fullmatch(key)
    if not match:
        return None
    number = match["number"].zfill(2)
    if match["sep"] is None:
        return number, None, None
    return (number, key, None) if match["sep"] == "-" else (number, None, key)


def find(which):
    """The module of the exercise ``which`` names: its number ('02'), id ('02-ddp') or
    notebook's name ('02_ddp', '02_ddp.ipynb'; any name that starts with the number).

    Raises:
        ValueError: no such exercise (the message lists them).
    """
    parsed = parse_exercise(which)
    every = exercises()
    if parsed is not None:
        number, exercise, _ = parsed
        for module in every.values():
            if module.EXERCISE[:2] == number and exercise in (None, module.EXERCISE):
                return module
    raise ValueError(f"no exercise {which!r}; the exercises are: {', '.join(every)}. "
                     f"HINT: the id is in the exercise notebook's title, e.g. '02-ddp' (or just '02').")


def __getattr__(name: str):
    module = _checks().get(name) if name.startswith("check_") else None
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(_load(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *check_names()])
