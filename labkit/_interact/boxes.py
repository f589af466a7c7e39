"""The widgets the interactive layer draws (ipywidgets), each shown with a plain-text fallback.

Imported only when a widget is drawn in a Jupyter kernel: ``predict`` and ``planner`` fall
back to text when ipywidgets is missing, and nothing here is imported with labkit.
"""

from __future__ import annotations

import html

import ipywidgets as widgets

from labkit._interact.predict import _read, amount, number


def show(widget, text: str) -> None:
    """Display ``widget``; where no widget can be drawn (nbmake, a front end without ipywidgets)
    the output shows ``text`` instead of ipywidgets' ``HBox(children=...)``."""
    from IPython.display import display

    bundle = widget._repr_mimebundle_()
    bundle["text/plain"] = text
    display(bundle, raw=True)


def note_for(typed: str, unit: str) -> str:
    """What the box says beside a guess as it is typed."""
    value, unreadable = _read(typed)
    if value is not None:
        return f"your guess: {amount(value, unit)}"
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


def planner_box(found) -> None:
    """The planner's controls over its table and chart; each control redraws them when it moves."""
    from labkit._interact.planner import INPUTS, RANGES
    from labkit._interact.plan import PRECISIONS
    from labkit._results.costs import OPTIMIZERS, STRATEGIES

    s, wide = found.settings, {"style": {"description_width": "8em"}}

    def slider(name, label, step=1):
        low, high = RANGES[name]
        return widgets.IntSlider(value=s[name], min=low, max=high, step=step, description=label,
                                 continuous_update=False, **wide)

    c = found.controls
    c["model"] = widgets.ToggleButtons(options=["MLPStack", "parameter count"],
                                       value="MLPStack" if s["parameters"] is None else "parameter count")
    c["dim"], c["depth"] = slider("dim", "dim", 32), slider("depth", "depth (blocks)")
    c["in_features"] = widgets.Dropdown(options=list(INPUTS.items()), value=s["in_features"],
                                        description="inputs", **wide)
    c["parameters"] = widgets.FloatLogSlider(value=s["parameters"] or 10**9, base=10, min=6, max=12, step=0.1,
                                             description="parameters", continuous_update=False,
                                             readout_format=".2e", **wide)
    c["world_size"] = slider("world_size", "world size")
    c["strategy"] = widgets.Dropdown(options=["all", *STRATEGIES], value=s["strategy"], description="strategy", **wide)
    c["precision"] = widgets.ToggleButtons(options=list(PRECISIONS), value=s["precision"])
    c["optimizer"] = widgets.ToggleButtons(options=list(OPTIMIZERS), value=s["optimizer"])
    c["batch_size"] = slider("batch_size", "global batch")
    c["tp"] = slider("tp", "TP group (2-D)")
    for name, control in c.items():
        control.add_class(f"labkit-planner-{name.replace('_', '-')}")
        control.observe(found.redraw, "value")
    found._table = widgets.HTML()
    found._table.add_class("labkit-planner-table")
    found._image = widgets.Image(format="png")
    model = widgets.VBox([c["model"], c["dim"], c["depth"], c["in_features"], c["parameters"]])
    cluster = widgets.VBox([c["world_size"], c["strategy"], c["batch_size"], c["tp"], c["precision"], c["optimizer"]])
    box = widgets.VBox([widgets.HBox([model, cluster]), found._table, found._image])
    box.add_class("labkit-planner")
    found.redraw()
    show(box, found.text())
