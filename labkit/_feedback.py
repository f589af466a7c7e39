"""What a check says to a learner: a list of findings, each right, wrong or not done yet.

``labkit.check_*`` functions (the ``_checks`` package) build a Feedback. In Jupyter it shows as a
short list with a verdict and a pointer to the hints; it also carries a small JSON part
(``application/vnd.labkit.feedback+json``) that the course's tests read from executed
notebooks, so a solution's checks can be asserted without an ``assert`` in the notebook.
"""

from __future__ import annotations

import html
import os
import re
from dataclasses import dataclass, field

from labkit._errors import LaunchError, LaunchTimeout, ScriptError

MIME = "application/vnd.labkit.feedback+json"
_MARK = {"ok": "✓", "fail": "✗", "todo": "…"}
_COLOR = {"ok": "#1a7f37", "fail": "#cf222e", "todo": "#9a6700"}
_LINE = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+)')


@dataclass
class Feedback:
    """The findings of one check, in the order they were made.

    Attributes:
        exercise: the exercise's id, e.g. ``"02-ddp"``.
        items: ``(status, text)`` pairs; status is ``"ok"``, ``"fail"`` or ``"todo"``.
        run: the Run that was checked, when there was one.
        failure: the root-cause RankFailure when a rank stopped with an exception (a check
            may read its traceback to name a likelier cause).
    """

    exercise: str
    items: list = field(default_factory=list)
    run: object = None
    failure: object = field(default=None, repr=False)

    def ok(self, text: str) -> None:
        self.items.append(("ok", text))

    def fail(self, text: str) -> None:
        self.items.append(("fail", text))

    def todo(self, text: str) -> None:
        self.items.append(("todo", text))

    def expect(self, condition: bool, right: str, wrong: str) -> bool:
        """Record ``right`` if ``condition`` holds, else ``wrong``; return the condition."""
        (self.ok if condition else self.fail)(right if condition else wrong)
        return bool(condition)

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
        return {"passed": f"all {done} checks pass. Well done.",
                "failed": f"{done} of {len(self.items)} checks pass; read what is wrong below.",
                "unfinished": "not finished yet."}[self.status]

    def _hint_line(self) -> str:
        return "" if self.passed else f"Stuck? labkit.hint({self.exercise!r}, 1) gives a first hint."

    def __str__(self) -> str:
        lines = [f"Exercise {self.exercise}: {self._verdict()}"]
        lines += [f"  {_MARK[s]} {text}" for s, text in self.items]
        if self._hint_line():
            lines.append(self._hint_line())
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<li style='list-style:none;color:{_COLOR[s]}'>{_MARK[s]} "
            f"<span style='color:inherit'>{html.escape(text)}</span></li>" for s, text in self.items)
        hint = f"<p><i>{html.escape(self._hint_line())}</i></p>" if self._hint_line() else ""
        return (f"<div><b>Exercise {html.escape(self.exercise)}</b>: {html.escape(self._verdict())}"
                f"<ul style='padding-left:0.5em'>{rows}</ul>{hint}</div>")

    def _repr_mimebundle_(self, include=None, exclude=None):
        return {"text/plain": str(self), "text/html": self._repr_html_(),
                MIME: {"exercise": self.exercise, "status": self.status,
                       "items": [list(item) for item in self.items]}}


def _where(failure, script: str) -> str:
    """' (scripts/ex.py, line 42)' from the last frame of the script in a traceback."""
    found = [m for m in _LINE.finditer(failure.traceback or "")
             if os.path.abspath(m["file"]) == os.path.abspath(script)]
    return f" ({script}, line {found[-1]['line']})" if found else ""


def attempt(exercise: str, target, **launch_options):
    """Launch the learner's script (or take a finished Run) for a check.

    Returns ``(feedback, run)``. ``run`` is None when the launch did not succeed; the
    feedback then already says why, in words: a target that is not a script, a TODO not
    done yet, a syntax error, a rank's exception (its traceback is in the output above; the
    root cause is kept in ``feedback.failure``), a hang.
    """
    from labkit._launch import launch
    from labkit._run import Run

    feedback = Feedback(exercise)
    if isinstance(target, Run):
        feedback.run = target
        return feedback, target
    try:
        script = os.fspath(target)
    except TypeError:
        feedback.fail(f"a check takes the path of your script (the file that the %%writefile cell "
                      f"wrote), not {type(target).__name__} {target!r}.")
        return feedback, None
    if os.path.isdir(script):
        feedback.fail(f"{script} is a folder: pass the path of the script that the %%writefile "
                      f"cell wrote.")
        return feedback, None
    try:
        run = launch(script, **launch_options)
    except FileNotFoundError:
        feedback.todo(f"{script} does not exist yet: run the %%writefile cell above first.")
        return feedback, None
    except ScriptError as err:
        feedback.fail(f"the script does not compile: {str(err).splitlines()[0]}")
        return feedback, None
    except LaunchTimeout as err:
        where = "; ".join(f"rank {r} at {s}" for r, s in sorted(err.stacks.items()))
        feedback.fail(f"the run did not finish within {launch_options.get('timeout')} s"
                      + (f": {where}" if where else "") + ". A rank waits in a collective "
                      "the others never reach?")
        feedback.run = err.run
        return feedback, None
    except LaunchError as err:
        feedback.run = err.run
        root = feedback.failure = err.root_cause
        if root is not None and root.exc_type == "NotImplementedError":
            feedback.todo(f"{root.message}{_where(root, script)}")
        elif root is not None and root.exc_type:
            feedback.fail(f"rank {root.rank} stopped with {root.exc_type}: {root.message}"
                          f"{_where(root, script)}. Its traceback is in the output above.")
        else:
            feedback.fail(f"the run failed: {err.summary}")
        return feedback, None
    feedback.run = run
    return feedback, run
