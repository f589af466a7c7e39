"""The widgets the interactive layer draws (ipywidgets), each shown with a plain-text fallback.

Imported only when a widget is drawn in a Jupyter kernel: ``predict`` and ``planner`` fall
back to text when ipywidgets is missing, and nothing here is imported with labkit.
"""

from __future__ import annotations

import html

import ipywidgets as widgets
from IPython.display import display

from labkit._interact.predict import _read, number


def show(widget, text: str) -> None:
    """Display ``widget``; where no widget can be drawn (nbmake, a front end without ipywidgets)
    the output shows ``text`` instead of ipywidgets' ``HBox(children=...)``."""
    bundle = widget._repr_mimebundle_()
    bundle["text/plain"] = text
    display(bundle, raw=True)


def note_for(typed: str, unit: str) -> str:
    """What the box says beside a guess as it is typed."""
    value, unreadable = _read(typed)
    if value is not None:
        return f"your guess: {number(value)} {unit}"
    return f"✗ not a number: {unreadable!r}" if unreadable else ""


def prediction_box(prediction, text: str):
    """The question, a box for the number, its unit and a note; returns (box, note)."""
    ask = widgets.HTML(f"<b>Predict</b> · {html.escape(prediction.question)}")
    guess = prediction.guess
    box = widgets.Text(value="" if guess is None else number(guess), placeholder="your guess",
                       continuous_update=True, layout=widgets.Layout(width="9em", margin="0 0.5em"))
    box.add_class("labkit-predict-guess")
    note = widgets.Label(note_for(box.value, prediction.unit), layout=widgets.Layout(margin="0 0 0 1em"))

    def changed(change) -> None:
        note.value = note_for(change["new"], prediction.unit)

    box.observe(changed, "value")
    row = widgets.HBox([ask, box, widgets.Label(prediction.unit), note],
                       layout=widgets.Layout(align_items="center"))
    row.add_class("labkit-predict")
    show(row, text)
    return box, note
