"""Predict, then measure: the learner's guess before a launch, graded against the run after it.

A lesson asks before the launch where a prediction teaches most, and grades in its check cell::

    p = labkit.predict("bytes all-reduced per step, per rank", unit="MB")
    run = labkit.launch("scripts/02_ddp.py", nproc=2)
    p.grade(measured_mb, run=run, why="DDP all-reduces every gradient once per step")
    # bytes all-reduced per step, per rank: you said 1.2 MB, measured 1.23 MB: within 3%. DDP ...

In JupyterLab the question is a small input box; anywhere else (nbmake, a terminal,
``python -c``) it is one line of text, and ``guess=`` sets the guess from code. Grading never
fails a notebook: without a guess it says so in one line, and the lesson's own asserts check
the claim as always. Each grade is one JSON line in the run folder (``predictions.jsonl``), so
the learner, or an instructor with a room's run folders, reads them back with
``labkit.predictions(...)`` or ``Run.predictions()``.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from labkit._interact import guesses

#: A guess this close to the measurement (relative gap) reads "within N%".
CLOSE = 0.10
#: Units that name a position, not an amount: written before the figure ("step 16", not "16 step").
POSITIONS = {"step", "epoch", "rank", "round"}


def _text(value, name: str, example: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{name} must be a non-empty string, got {value!r}. HINT: {example}")
    return value.strip()


def _finite(value, name: str, hint: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r} ({type(value).__name__}). "
                         f"HINT: {hint}")
    return float(value)


def number(x: float) -> str:
    """A figure as a person reads it: four significant digits, thousands grouped, no exponent
    between 1e-4 and 1e15 (``number(1234567.0)`` is ``'1,234,567'``)."""
    short = f"{x:.4g}"
    if "e" in short and 1e-4 <= abs(x) < 1e15:
        return f"{x:,.0f}" if abs(x) >= 1 else f"{x:.6f}".rstrip("0")
    return short


def amount(x: float, unit: str) -> str:
    """A figure with its unit: "1.23 MB", "12 all-reduces"; a ratio or a share as written:
    "1.8×", "40%"; a position reads as one: "step 16" (``POSITIONS``: a question "at which
    step" is answered by a step, not by 16 of them)."""
    if unit in POSITIONS:
        return f"{unit} {number(x)}"
    return f"{number(x)}{unit}" if unit in ("×", "%") else f"{number(x)} {unit}"


def gap_words(guess: float, measured: float) -> str:
    """How far a guess is from the measurement, in words: "exactly", "within 3%", "40% too
    low", "2.5× too high"."""
    if guess == measured:
        return "exactly"
    if measured == 0:
        return "the measurement is 0"
    gap = abs(guess - measured) / abs(measured)
    if gap <= CLOSE:
        return f"within {max(1, math.ceil(gap * 100 - 1e-9))}%"
    side = "too high" if guess > measured else "too low"
    if guess * measured < 0:
        return f"{gap:.0%} off (the opposite sign)"
    ratio = guess / measured
    if ratio >= 2 or ratio <= 0.5:
        return f"{max(ratio, 1 / ratio):.1f}× {side}"
    return f"{gap:.0%} {side}"


@dataclass(frozen=True)
class Grade:
    """One graded prediction: what was guessed, what was measured, and the line that said so.

    Attributes:
        question, unit: as ``predict`` was given them.
        guess: the learner's guess, or None (no guess, or text that is not a number).
        measured: the figure the run measured, in ``unit``.
        gap: ``|guess - measured| / |measured|``; None without a guess or when measured is 0.
        line: the one line ``Prediction.grade`` printed.

    Example (lesson 02)::

        graded = p.grade(measured_mb, run=ddp)
        graded.gap          # 0.024: 2.4% off
    """

    question: str
    unit: str
    guess: float | None
    measured: float
    gap: float | None
    why: str
    line: str

    def __str__(self) -> str:
        return self.line

    def __repr__(self) -> str:
        return f"Grade({self.line!r})"

    def _ipython_display_(self) -> None:
        """As a cell's last value, a Grade shows nothing more: ``grade`` printed its line."""


class Prediction:
    """A question the learner answers with a number before a launch; ``labkit.predict`` makes one.

    Attributes:
        question, unit: what is asked, and in which unit the guess and the measurement are.
        guess: the guess now (the box's number in JupyterLab, else ``guess=``), or None.

    Example (lesson 02)::

        p = labkit.predict("bytes all-reduced per step, per rank", unit="MB", guess=1.2)
        p.grade(1.23)       # bytes all-reduced per step, per rank: you said 1.2 MB, measured 1.23 MB: within 3%.
    """

    def __init__(self, question: str, unit: str, guess: float | None = None):
        self.question, self.unit = question, unit
        self._guess, self._box, self._note = guess, None, None

    @property
    def guess(self) -> float | None:
        return _read(self._box.value)[0] if self._box is not None else self._guess

    @guess.setter
    def guess(self, value: float | None) -> None:
        self._guess = None if value is None else _finite(value, "guess", "a number, e.g. guess=1.2")
        if self._box is not None:
            self._box.value = "" if value is None else number(self._guess)

    def text(self) -> str:
        """The question as one line of text (what is shown outside JupyterLab)."""
        guess = self.guess
        said = (f"your guess: {amount(guess, self.unit)}" if guess is not None else
                f"no guess yet (type one in JupyterLab, or pass guess=...)")
        return f"predict · {self.question} ({self.unit}) · {said}"

    def grade(self, measured, *, run=None, why: str = "", source: str = "measured") -> Grade:
        """Compare the guess with the measured figure in one printed line, and keep both.

        Never raises for a missing guess: the line then says there was none. The lesson's own
        asserts check the claim; a grade only tells the learner how close they were.

        Args:
            measured: the figure the run measured, in the prediction's ``unit``, a finite number.
            run: the Run (or Sweep, or run folder) it came from: the grade is appended to its
                ``predictions.jsonl``. None: nothing is kept.
            why: one short sentence on why the figure is what it is (printed after the gap).
            source: the words before the figure: "measured", or what gave a figure that was
                worked out rather than measured, e.g. "the ideal replay gave".

        Returns:
            a Grade (its ``line`` is what was printed).

        Raises:
            ValueError: ``measured`` is not a finite number, ``why`` not a string, ``source`` not
                a non-empty string, or ``run`` is not a run or sweep folder (nothing is printed
                or kept then).

        Example (lesson 02)::

            p.grade(allreduced_bytes / 1e6, run=ddp, why="every gradient, once per step")
        """
        measured = _finite(measured, "measured", f"pass the measurement in {self.unit} as a "
                           f"number, e.g. float(value); a tensor: value.item()")
        if not isinstance(why, str):
            raise ValueError(f"why must be a string, got {why!r}. HINT: why=\"one short sentence\".")
        source = _text(source, "source", 'source="measured", or e.g. source="the ideal replay gave"')
        folder = None if run is None else guesses.folder_of(run)
        graded = self._graded(measured, why.strip(), source)
        print(graded.line)
        if folder is not None:
            guesses.keep(folder, graded)
        return graded

    def _graded(self, measured: float, why: str, source: str) -> Grade:
        guess, unreadable = _read(self._box.value) if self._box is not None else (self._guess, "")
        said = amount(measured, self.unit)
        if guess is None:
            what = f"could not read {unreadable!r} as a number" if unreadable else "no guess"
            line, gap = f"{self.question}: {what}; {source} {said}.", None
        else:
            line = (f"{self.question}: you said {amount(guess, self.unit)}, {source} {said}: "
                    f"{gap_words(guess, measured)}.")
            gap = abs(guess - measured) / abs(measured) if measured else None
        return Grade(self.question, self.unit, guess, measured, gap, why,
                     f"{line} {why}" if why else line)

    def _show(self) -> None:
        """A widget in a Jupyter kernel (with this line as its plain-text fallback), else the line."""
        from labkit._launch.live import in_notebook

        if not in_notebook():
            print(self.text())
            return
        try:
            from labkit._interact.boxes import prediction_box
        except ImportError:          # no ipywidgets: the text is all there is
            print(self.text())
            return
        self._box, self._note = prediction_box(self, self.text())

    def __repr__(self) -> str:
        return f"Prediction({self.question!r}, unit={self.unit!r}, guess={self.guess!r})"


def _read(typed: str) -> tuple[float | None, str]:
    """(the number typed, or None; the text when it is not a number) from the box."""
    text = typed.strip().replace(",", "").replace("_", "")
    if not text:
        return None, ""
    try:
        value = float(text)
    except ValueError:
        return None, typed.strip()
    return (value, "") if math.isfinite(value) else (None, typed.strip())


def predict(question: str, *, unit: str, guess: float | None = None) -> Prediction:
    """Ask the learner for a number before a launch; grade it after with ``Prediction.grade``.

    In JupyterLab a small box takes the guess (the question, a number box, the unit); in nbmake,
    a terminal or ``python -c`` it is one line of text, and ``guess=`` sets the guess from code.

    Args:
        question: what to predict, e.g. "bytes all-reduced per step, per rank".
        unit: the unit of the guess and of the measurement, e.g. "MB" (a non-empty string).
        guess: a guess set from code (a finite number); None to let the learner type one.

    Returns:
        a Prediction; call ``.grade(measured, run=run)`` in the check cell.

    Raises:
        ValueError: an empty question or unit, or a guess that is not a finite number.

    Example (lesson 02)::

        p = labkit.predict("bytes all-reduced per step, per rank", unit="MB")
        ddp = labkit.launch("scripts/02_ddp.py", nproc=2)
        p.grade(measured_mb, run=ddp, why="DDP all-reduces every gradient once per step")
    """
    question = _text(question, "question", 'labkit.predict("bytes all-reduced per step", unit="MB")')
    unit = _text(unit, "unit", 'the unit of the guess and of the measurement: unit="MB", unit="%", '
                 'unit="steps"')
    if guess is not None:
        guess = _finite(guess, "guess", "a number, e.g. guess=1.2, or leave it out to type one")
    prediction = Prediction(question, unit, guess)
    prediction._show()
    return prediction
