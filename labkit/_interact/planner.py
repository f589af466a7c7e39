"""``labkit.planner()``: sliders and menus for a model and a cluster, and what each rank holds and
sends under each strategy, redrawn as they move (lessons 12 and 13).

The figures are ``labkit.plan_table``'s (``labkit/_interact/plan.py``), from the arithmetic the
lessons check against their runs. Outside JupyterLab the planner prints its table once, as text.
"""

from __future__ import annotations

import io

from labkit._interact import plan
from labkit._results import costs
from labkit._results.shapes import Shapes

#: The choices for the model's inputs: lesson 06 trains on images, lessons 11-13 on dim features.
INPUTS = {"3072: an image (lesson 06)": 3072, "dim (lessons 11-13)": 0}
#: What each control may be set to (the sliders' ranges).
RANGES = {"dim": (32, 8192), "depth": (1, 64), "world_size": (1, 64), "batch_size": (1, 4096), "tp": (1, 8),
          "parameters": (10**6, 10**12)}


class Planner:
    """The planner's settings, and the table they give; ``labkit.planner()`` makes one.

    Attributes:
        settings: ``{name: value}`` as the controls hold them now (dim, depth, in_features,
            parameters, world_size, strategy, precision, optimizer, batch_size, tp).
        controls: ``{name: widget}`` in JupyterLab; empty elsewhere.

    Example (lesson 12)::

        p = labkit.planner(dim=1024, depth=8, world_size=8)
        p.table()          # what the controls show now, as a DataFrame
    """

    def __init__(self, settings: dict):
        self.settings, self.controls = dict(settings), {}
        self._table = self._image = None

    def model(self) -> Shapes:
        s = self.settings
        if s["parameters"] is not None:
            return Shapes.count(int(s["parameters"]))
        return Shapes.mlp_stack(dim=s["dim"], depth=s["depth"], in_features=s["in_features"] or s["dim"])

    def table(self):
        """Memory per rank and bytes per step for the settings now (``labkit.plan_table``): each
        strategy's largest rank, or each rank of the one strategy chosen."""
        s = self.settings
        one = s["strategy"] not in (None, "all")
        table = plan.plan_table(self.model(), world_size=s["world_size"], strategy=s["strategy"] if one else None,
                                precision=s["precision"], optimizer=s["optimizer"], batch_size=s["batch_size"],
                                tp=s["tp"], per_rank=one)
        if one:
            attrs, table = table.attrs, table.loc[s["strategy"]]
            table.index = [f"rank {r}" for r in table.index]
            table.attrs.update(attrs)
        return table

    def text(self) -> str:
        """The table and its caption, as text (what is shown outside JupyterLab)."""
        try:
            table = self.table()
        except ValueError as err:
            return f"planner: {err}"
        return f"planner · {plan.caption(table)}\n{plan.shown(table).to_string()}"

    # -- drawn in JupyterLab ---------------------------------------------------------------------
    def redraw(self, change=None) -> None:
        """Read the controls, then draw the table and the chart again (the controls call it)."""
        for name, control in self.controls.items():
            if name not in ("model", "parameters"):
                self.settings[name] = control.value
        self.settings["parameters"] = (int(self.controls["parameters"].value)
                                       if self.controls["model"].value == "parameter count" else None)
        mlp = self.settings["parameters"] is None
        for name in ("dim", "depth", "in_features"):
            self.controls[name].layout.display = None if mlp else "none"
        self.controls["parameters"].layout.display = "none" if mlp else None
        try:
            table = self.table()
        except ValueError as err:
            self._table.value = f"<pre>{err}</pre>"
            return
        self._image.value = _png(table)     # the chart first: the table is what says it is done
        self._table.value = (f"<div class='labkit-planner-caption'>{plan.caption(table)}</div>"
                             + plan.shown(table).to_html(classes="labkit-planner-rows", index_names=False))

    def __repr__(self) -> str:
        return f"Planner({self.settings!r})"


def _png(table) -> bytes:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.6), dpi=80)
    plan.draw(table, fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _whole(name: str, value) -> int:
    low, high = RANGES[name]
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be a whole number from {low:,} to {high:,}, got {value!r}. "
                         f"HINT: labkit.planner(dim=256, depth=4, world_size=4).")
    return value


def planner(*, dim: int = 256, depth: int = 4, in_features: int = 3072, parameters: int | None = None,
            world_size: int = 2, strategy: str = "all", precision: str = "fp32", optimizer: str = "AdamW",
            batch_size: int = 32, tp: int = 2) -> Planner:
    """What each rank holds and sends, per strategy, with sliders: the course's memory calculator.

    In JupyterLab: sliders and menus for the model (lesson 06's ``MLPStack`` by its width and
    depth, or a bare parameter count), the world size, the strategy (all, or one to see each
    rank), the precision, the optimizer, the global batch and FSDP x TP's tensor-parallel group;
    a table (MiB per rank, MiB sent per step) and a bar chart follow them. Elsewhere it prints
    the table once. The figures are ``labkit.plan_table``'s, which lessons 06, 11, 12 and 13
    check against their runs.

    Args:
        dim, depth, in_features: the MLPStack (in_features 0: dim, as lessons 11-13 build it).
        parameters: a parameter count instead of an MLPStack (DDP, ZeRO and FSDP only).
        world_size, strategy, precision, optimizer, batch_size, tp: as for ``plan_table``
            (strategy "all": every one).

    Returns:
        a Planner; ``.table()`` is what it shows now.

    Raises:
        ValueError: a setting outside the controls' range or choices (nothing is drawn then).

    Example (lesson 12)::

        labkit.planner(dim=1024, depth=8, world_size=8, strategy="all")
    """
    for name, value in (("dim", dim), ("depth", depth), ("world_size", world_size),
                        ("batch_size", batch_size), ("tp", tp)):
        _whole(name, value)
    if parameters is not None:
        _whole("parameters", parameters)
    for name, value, choices in (("strategy", strategy, ("all", *costs.STRATEGIES)),
                                 ("precision", precision, tuple(plan.PRECISIONS)),
                                 ("optimizer", optimizer, tuple(costs.OPTIMIZERS)),
                                 ("in_features", in_features, (3072, 0, dim))):
        if value not in choices:
            raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}. "
                             f"HINT: labkit.planner(world_size=4, strategy='all').")
    found = Planner(dict(dim=dim, depth=depth, in_features=0 if in_features == dim else in_features,
                         parameters=parameters, world_size=world_size, strategy=strategy,
                         precision=precision, optimizer=optimizer, batch_size=batch_size, tp=tp))
    from labkit._launch.live import in_notebook

    if not in_notebook():
        print(found.text())
        return found
    try:
        from labkit._interact.boxes import planner_box
    except ImportError:          # no ipywidgets: the text is all there is
        print(found.text())
        return found
    planner_box(found)
    return found
