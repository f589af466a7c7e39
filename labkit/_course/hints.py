"""Progressive hints for the exercises: the first nudges, the last all but says it.

In an exercise notebook::

    labkit.hint("02-ddp", 1)     # then 2, then 3

Each exercise's hints are its module's ``HINTS`` (``labkit/_course/checks/exNN_<name>.py``).
"""

from __future__ import annotations

import html
from dataclasses import dataclass

from labkit._course import checks


def _answers() -> str:
    """Where the worked answers are: in solutions/, or, in a workshop's hand-out, with the instructor."""
    from labkit._course.folder import find_root, package_root

    root = find_root() or package_root()
    if (root / "solutions").is_dir():
        return "the full answer is in solutions/, where your copy has it"
    return "this copy of the course is a workshop's hand-out, without the worked answers: ask your instructor"


@dataclass(frozen=True)
class Hint:
    """One hint: shows as a short note in Jupyter, as text elsewhere."""

    exercise: str
    number: int
    total: int
    text: str

    def __str__(self) -> str:
        more = (f" (labkit.hint({self.exercise!r}, {self.number + 1}) for the next)"
                if self.number < self.total else f" (the last one; {_answers()})")
        return f"Hint {self.number} of {self.total} for {self.exercise}{more}:\n{self.text}"

    __repr__ = __str__

    def _repr_html_(self) -> str:
        head, body = str(self).split("\n", 1)
        return (f"<div style='border-left:3px solid #9a6700;padding-left:8px'>"
                f"<b>{html.escape(head)}</b><br>{html.escape(body)}</div>")


def hint(exercise: str, number: int = 1) -> Hint:
    """Hint ``number`` (1, 2, ...) for ``exercise``, e.g. ``labkit.hint("02-ddp", 1)``.

    ``exercise`` is the exercise's id ('02-ddp'), its number ('02') or its notebook's name
    ('02_ddp'), as ``make restore`` takes them.

    Raises:
        ValueError: an unknown exercise (the message lists them), or a number out of range.

    Example (an exercise notebook)::

        labkit.hint("02-ddp", 1)     # then 2, then 3
    """
    module = checks.find(exercise)
    exercise, texts = module.EXERCISE, module.HINTS
    if isinstance(number, bool) or not isinstance(number, int) or not 1 <= number <= len(texts):
        raise ValueError(f"{exercise} has hints 1 to {len(texts)}, not {number!r}. "
                         f"HINT: after the last hint, {_answers()}.")
    return Hint(exercise, number, len(texts), texts[number - 1])

