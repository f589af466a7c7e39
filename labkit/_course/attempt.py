"""A check's launch: the learner's script run for real, and a failed launch said in words.

``attempt`` launches (or takes a finished Run) and turns what went wrong into findings: a
target that is not a script, a TODO not done yet, a syntax error, a rank's exception, a signal
or a lost peer, a hang. ``launched`` is the same inside a ``@check``: it ends the check when
the launch failed. Every exercise module uses it (``labkit._course.feedback`` says how a check
is written). Kernel side.
"""

from __future__ import annotations

import os
from pathlib import Path

from labkit._course.feedback import Feedback
from labkit._diagnose.stacks import traceback_frames
from labkit._errors import LaunchError, LaunchTimeout, ScriptError

def _where(failure, script: str) -> str:
    """' (scripts/ex.py, line 42)' from the last frame of the script in a traceback."""
    found = [f for f in traceback_frames(failure.traceback)
             if os.path.abspath(f["file"]) == os.path.abspath(script)]
    return f" ({script}, line {found[0]['line']})" if found else ""


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def _stopped(feedback: Feedback, checked_before: bool):
    """(feedback, None) for a launch that did not succeed: nothing of this run can be checked."""
    feedback.stopped = not checked_before
    return feedback, None


def attempt(exercise: str | Feedback, target, **launch_options):
    """Launch the learner's script (or take a finished Run) for a check.

    ``exercise``: the exercise's id (a new Feedback is made), or the Feedback of a check
    that launches more than once, to add this launch's findings to.

    Returns ``(feedback, run)``. ``run`` is None when the launch did not succeed; the
    feedback then already says why, in words: a target that is not a script, a TODO not
    done yet, a syntax error, a rank's exception (its traceback is in the output above; the
    root cause is kept in ``feedback.failure``), a rank killed by a signal or left without
    its peers (with its last output and what that usually means, e.g. a collective that
    only some ranks call), a hang (where each rank waited).
    """
    from labkit._launch.launch import launch
    from labkit._results.run import Run

    feedback = exercise if isinstance(exercise, Feedback) else Feedback(exercise)
    before = bool(feedback.items)
    if isinstance(target, Run):
        feedback.run = target
        return feedback, target
    script = _script_path(feedback, target)
    if script is None:
        return _stopped(feedback, before)
    try:
        run = launch(script, **launch_options)
    except FileNotFoundError:
        folder = os.path.dirname(script)
        if folder and not os.path.isdir(folder):
            feedback.fail(f"there is no folder {folder!r} next to this notebook, so the %%writefile "
                          f"cell could not write {script}. Run the notebook from the course's "
                          f"exercises/ folder, or create {folder!r} there first.")
        else:
            feedback.todo(f"{script} does not exist yet: run the %%writefile cell above first.")
        return _stopped(feedback, before)
    except ScriptError as err:
        feedback.fail(f"the script does not compile: {str(err).splitlines()[0]}")
        return _stopped(feedback, before)
    except LaunchTimeout as err:
        where = "; ".join(f"rank {r} at {s}" for r, s in sorted(err.stacks.items()))
        waited = (f"hung: no rank said anything for {err.run.info['hang_timeout_s']:g} s"
                  if err.run.info.get("hung") else f"did not finish within {err.run.info.get('timeout_s')} s")
        feedback.fail(f"the run {waited}" + (f": {where}" if where else "") + f". {_sentence(err.hint)}")
        feedback.run = err.run
        return _stopped(feedback, before)
    except LaunchError as err:
        _failed(feedback, err, script)
        return _stopped(feedback, before)
    feedback.run = run
    return feedback, run


def _script_path(feedback: Feedback, target) -> str | None:
    """``target`` as the path of a .py script; None, with a finding that says why, if it is not."""
    try:
        script = os.fspath(target)
    except TypeError:
        feedback.fail(f"a check takes the path of your script (the file that the %%writefile cell "
                      f"wrote), not {type(target).__name__} {target!r}.")
        return None
    if os.path.isdir(script):
        feedback.fail(f"{script} is a folder: pass the path of the script that the %%writefile "
                      f"cell wrote.")
        return None
    if not script.endswith(".py"):  # launch would refuse it with a ValueError
        from labkit._launch.plan import _written_scripts

        written = _written_scripts(Path(script)) if script.endswith(".ipynb") else []
        feedback.fail(f"{script} is not a Python script: pass the path of the .py file that the "
                      f"%%writefile cell wrote" + (f", e.g. {written[0]}." if written else "."))
        return None
    return script


def _failed(feedback: Feedback, err: LaunchError, script: str) -> None:
    """The finding for a launch whose rank failed: a TODO left, a rank's exception, or a signal,
    a lost peer or a collective mismatch (the HINT says most)."""
    feedback.run = err.run
    root = feedback.failure = err.root_cause
    if root is not None and root.exc_type == "NotImplementedError":
        feedback.todo(f"{root.message}{_where(root, script)}")
    elif root is not None and root.exc_type and not root.secondary and not any(
            f.says_mismatch for f in err.failures):
        feedback.fail(f"rank {root.rank} stopped with {root.exc_type}: {root.message}"
                      f"{_where(root, script)}. Its traceback is in the output above.")
    elif root is not None:
        last = "" if root.exc_type else root.last_line()
        feedback.fail(f"{root.headline()}{_where(root, script)}"
                      + (f"; its last output: {last}" if last else "")
                      + f". {_sentence(err.hint)}")
    else:
        feedback.fail(f"the run failed: {err.summary} {_sentence(err.hint)}")


def launched(exercise: str | Feedback, target, *, explain=None, **launch_options):
    """``attempt``, inside a ``@check``: returns ``(feedback, run)``, or ends the check when the launch
    did not succeed (its findings say why). ``explain(feedback, target)``, when given, may first add
    what such a failure most likely means in this exercise."""
    feedback, run = attempt(exercise, target, **launch_options)
    if run is None:
        if explain is not None:
            explain(feedback, target)
        feedback.stop()
    return feedback, run
