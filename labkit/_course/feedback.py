"""What a check says to a learner: a list of findings, each right, wrong or not done yet.

``labkit.check_*`` functions (one module per exercise in ``labkit._course.checks``) build a
Feedback. In Jupyter it shows as a short list with a verdict and a pointer to the hints; it also
carries a small JSON part (``application/vnd.labkit.feedback+json``) that the course's tests read
from executed notebooks, so a solution's checks can be asserted without an ``assert`` in the
notebook.

A check is a few phases, one function each, run in order. Each phase adds findings
(``ok``, ``fail``, ``todo``, ``expect``). A finding after which the rest cannot be judged ends
the check: ``feedback.stop(text)`` records it as a ✗ and stops, ``feedback.require(condition,
right, wrong)`` stops only when the condition fails, and ``feedback.stop()`` without a text stops
on the findings already made. The check function wears ``@check``, which catches that stop
signal, once, and returns the Feedback as it stands. ``launched`` (``labkit._course.attempt``)
launches the script and ends the check when the launch fails (``attempt``'s findings say why: a TODO, a rank's exception, a hang)::

    EXERCISE = "09-demo"

    @check
    def check_demo(target="scripts/ex09_demo.py", *, timeout_s: float = 180) -> Feedback:
        feedback, run = launched(EXERCISE, target, timeout_s=timeout_s, name="check-09-demo", **_ranks(2))
        df = _metrics(feedback, run, ["loss"])         # stops by itself when a column is missing
        _the_loss_falls(feedback, df)
        return feedback

    def _the_loss_falls(feedback: Feedback, df) -> None:
        first, last = df["loss"].iloc[0], df["loss"].iloc[-1]
        feedback.require(last < first, f"the loss falls ({first:.2f} → {last:.2f})",
                         "the loss never falls: is optimizer.step() called?", hint=1)
        ...                                            # runs only when the loss fell

The signal (``_Stop``) is private: a check never catches it, and nothing outside ``@check``
raises it.
"""

from __future__ import annotations

import functools
import html
from dataclasses import dataclass, field
from typing import NoReturn

from labkit._launch.keywords import refuse_keywords, renamed

MIME = "application/vnd.labkit.feedback+json"
_MARK = {"ok": "✓", "fail": "✗", "todo": "…"}
_COLOR = {"ok": "#1a7f37", "fail": "#cf222e", "todo": "#9a6700"}


@dataclass
class Feedback:
    """The findings of one check, in the order they were made.

    Attributes:
        exercise: the exercise's id, e.g. ``"02-ddp"``.
        items: ``(status, text)`` pairs; status is ``"ok"``, ``"fail"`` or ``"todo"``.
        run: the Run that was checked, when there was one.
        failure: the root-cause RankFailure when a rank stopped with an exception (a check
            may read its traceback to name a likelier cause).
        hints: for each item, the number of the hint about it (``labkit.hint``), or None.
        stopped: the launch did not succeed, so nothing of the run was checked.
        notes: what the learner should know that is neither right nor wrong, e.g. that the
            check ran at another size than ``LABKIT_RANKS`` asks for, and why.

    Example (an exercise notebook)::

        feedback = labkit.check_ddp("scripts/ex02_ddp.py")
        feedback.passed, feedback.messages()
    """

    exercise: str
    items: list = field(default_factory=list)
    run: object = None
    failure: object = field(default=None, repr=False)
    hints: list = field(default_factory=list, repr=False)
    stopped: bool = False
    notes: list = field(default_factory=list)

    def _add(self, status: str, text: str, hint: int | None) -> None:
        self.items.append((status, text))
        self.hints.append(hint)

    def ok(self, text: str, *, hint: int | None = None) -> None:
        self._add("ok", text, hint)

    def fail(self, text: str, *, hint: int | None = None) -> None:
        self._add("fail", text, hint)

    def note(self, text: str) -> None:
        """A line shown under the findings that counts neither way (``note: ...``)."""
        self.notes.append(text)

    def todo(self, text: str, *, hint: int | None = None) -> None:
        self._add("todo", text, hint)

    def expect(self, condition: bool, right: str, wrong: str, *, hint: int | None = None) -> bool:
        """Record ``right`` if ``condition`` holds, else ``wrong``; return the condition.

        ``hint``: the number of the hint that helps with what ``wrong`` names.
        """
        (self.ok if condition else self.fail)(right if condition else wrong, hint=hint)
        return bool(condition)

    def require(self, condition: bool, right: str, wrong: str, *, hint: int | None = None) -> None:
        """``expect``, and when ``condition`` fails the check ends after ``wrong``: what it would
        look at next cannot be judged without this (only inside a ``@check`` function)."""
        if not self.expect(condition, right, wrong, hint=hint):
            raise _Stop(self)

    def stop(self, text: str | None = None, *, hint: int | None = None) -> NoReturn:
        """End the check here: with ``text`` as a ✗ finding, or, without it, on the findings
        already made (e.g. ``attempt``'s, when the launch failed). Only inside a ``@check`` function."""
        if text is not None:
            self.fail(text, hint=hint)
        raise _Stop(self)

    @property
    def status(self) -> str:
        """``"passed"``, ``"failed"`` (something is wrong) or ``"unfinished"`` (a TODO is left)."""
        states = {status for status, _ in self.items}
        if "fail" in states:
            return "failed"
        if "todo" in states or not self.items:
            return "unfinished"
        return "passed"

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def messages(self, status: str | None = None) -> list[str]:
        """The texts of the findings (of one status, if given)."""
        return [text for s, text in self.items if status is None or s == status]

    def _verdict(self) -> str:
        done = sum(1 for s, _ in self.items if s == "ok")
        if self.status == "failed" and self.stopped:
            return "the run stopped before the checks could look at it; read why below."
        return {"passed": f"all {done} checks pass. Well done.",
                "failed": f"{done} of {len(self.items)} checks pass; read what is wrong below.",
                "unfinished": "not finished yet."}[self.status]

    def _hint_line(self) -> str:
        """Points to the hint about the first thing that is wrong or unfinished, else hint 1 (after
        the error itself, when the run crashed)."""
        if self.passed:
            return ""
        numbers = [n for (status, _), n in zip(self.items, self.hints) if status != "ok" and n]
        if numbers:
            return (f"Stuck? labkit.hint({self.exercise!r}, {numbers[0]}) is about the first thing "
                    f"to fix above.")
        first = f"Stuck? labkit.hint({self.exercise!r}, 1) gives a first hint."
        if self.stopped and self.status == "failed":  # a crash: its message says more than hint 1
            return f"Fix what the {_MARK['fail']} line names first. " + first
        return first

    def __str__(self) -> str:
        lines = [f"Exercise {self.exercise}: {self._verdict()}"]
        lines += [f"  {_MARK[s]} {text}" for s, text in self.items]
        lines += [f"  note: {text}" for text in self.notes]
        if self._hint_line():
            lines.append(self._hint_line())
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<li style='list-style:none;color:{_COLOR[s]}'>{_MARK[s]} "
            f"<span style='color:inherit'>{html.escape(text)}</span></li>" for s, text in self.items)
        rows += "".join(f"<li style='list-style:none;color:#57606a'>note: {html.escape(text)}</li>"
                        for text in self.notes)
        hint = f"<p><i>{html.escape(self._hint_line())}</i></p>" if self._hint_line() else ""
        return (f"<div><b>Exercise {html.escape(self.exercise)}</b>: {html.escape(self._verdict())}"
                f"<ul style='padding-left:0.5em'>{rows}</ul>{hint}</div>")

    def _repr_mimebundle_(self, include=None, exclude=None):
        return {"text/plain": str(self), "text/html": self._repr_html_(),
                MIME: {"exercise": self.exercise, "status": self.status,
                       "items": [list(item) for item in self.items], "notes": list(self.notes),
                       "world_size": getattr(self.run, "world_size", None)}}


class _Stop(BaseException):
    """The stop signal: a finding ended the check. Raised by ``Feedback.stop`` and
    ``Feedback.require``, caught by ``@check`` and nowhere else (a BaseException, as pytest's
    outcomes are, so that a check's ``except Exception`` cannot swallow it)."""

    def __init__(self, feedback: Feedback):
        super().__init__(f"a check of exercise {feedback.exercise} stopped outside a @check function")
        self.feedback = feedback


def check(function):
    """Decorate a check: a finding that ends it (``Feedback.stop``, ``Feedback.require``) returns
    the Feedback from here, with every finding made so far. See the module's docstring.

    An old keyword gets a did-you-mean: ``check_ddp(target, timeout=300)`` says ``timeout_s``.
    """

    @refuse_keywords(**renamed(function.__name__, timeout="timeout_s"))
    @functools.wraps(function)
    def checked(*args, **kwargs) -> Feedback:
        try:
            return function(*args, **kwargs)
        except _Stop as stop:
            return stop.feedback

    return checked
