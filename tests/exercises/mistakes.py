"""Deliberately wrong answers to the exercises, for their checks to name.

A wrong answer is the solution notebook's own script with one mistake put in: an exact text
replacement, so that if the solution changes, the test says so. Each is launched for real, as a
learner's would be, and the check must fail with the message that names the mistake.

``tests/exercises/test_exNN_<name>.py`` lists exercise NN's mistakes and makes their test::

    MISTAKES = {"no-set-epoch": Mistake("    sampler.set_epoch(epoch)\n", "    pass\n",
                                        "sampler.set_epoch(epoch)", hint=2), ...}
    test_each_mistake_gets_the_message_that_names_it = each_named_by(labkit.check_ddp, "02_ddp.ipynb",
                                                                     MISTAKES)

This folder holds every piece of answer text the tests quote: a workshop's hand-out leaves it
out, with ``solutions/``.
(A plain module, not a ``conftest.py``: a second conftest would shadow ``from conftest import``
in the rest of ``tests/``.)
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WRITEFILE = re.compile(r"^%%writefile(?P<append>[ \t]+-a)?[ \t]+(?P<path>\S+)[ \t]*\n")


def solution_script(notebook: str, path: str | None = None) -> str:
    """The text of the script that ``solutions/<notebook>`` writes: its ``%%writefile`` cell and
    the ``%%writefile -a`` cells that continue it. ``path``: which script, as the cells name it
    (default: the first one written)."""
    text = None
    for cell in json.loads((ROOT / "solutions" / notebook).read_text(encoding="utf-8"))["cells"]:
        source = "".join(cell["source"])
        match = WRITEFILE.match(source)
        if cell["cell_type"] != "code" or not match:
            continue
        path = path or match["path"]
        if match["path"] == path:
            text = (text or "") + source[match.end():] if match["append"] else source[match.end():]
    if text is None:
        raise AssertionError(f"solutions/{notebook} writes no script {path or ''}".rstrip())
    return text


def wrong(notebook: str, old: str, new: str) -> str:
    """The solution's script with ``old`` (found exactly once) replaced by ``new``."""
    text = solution_script(notebook)
    assert text.count(old) == 1, f"solutions/{notebook} no longer holds {old!r} exactly once"
    return text.replace(old, new)


@dataclass(frozen=True)
class Mistake:
    """One wrong answer and what the check must say about it.

    ``old`` (text of the solution's script) becomes ``new``. The check must fail with a ✗ that
    holds ``words``; when ``hint`` is given, its closing line points to that hint; and each of
    ``still_right`` stays among its ✓ (the check blames the mistake, not what is right).
    """

    old: str
    new: str
    words: str
    still_right: tuple[str, ...] = ()
    hint: int | None = None


def assert_named(check, notebook: str, mistake: Mistake, workdir: Path):
    """Write the wrong answer to ``scripts/mine.py`` in ``workdir``, run ``check`` on it (a real
    launch), and assert that the feedback names the mistake. Returns the Feedback."""
    (workdir / "scripts").mkdir(exist_ok=True)
    (workdir / "scripts" / "mine.py").write_text(wrong(notebook, mistake.old, mistake.new))
    feedback = check("scripts/mine.py")
    assert feedback.status == "failed", feedback
    assert any(mistake.words in text for text in feedback.messages("fail")), feedback
    if mistake.hint is not None:
        assert (f"labkit.hint({feedback.exercise!r}, {mistake.hint}) is about the first thing to fix"
                in str(feedback)), feedback
    for right in mistake.still_right:
        assert any(right in text for text in feedback.messages("ok")), (right, str(feedback))
    return feedback


def each_named_by(check, notebook: str, mistakes: dict):
    """The test that launches each of ``mistakes`` ({test id: Mistake}) as a wrong answer to
    ``solutions/<notebook>`` and asserts that ``check`` names it. Marked ``launch`` (real ranks) and
    ``solutions`` (it needs them); give it a module-level name that starts with ``test_``."""

    @pytest.mark.launch
    @pytest.mark.solutions
    @pytest.mark.parametrize("mistake", list(mistakes))
    def test(mistake, workdir):
        assert_named(check, notebook, mistakes[mistake], workdir)

    return test
