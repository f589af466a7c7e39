"""The planner's table and chart: memory per rank and bytes per step, for each strategy.

``labkit.plan_table`` is the planner without widgets; ``labkit.planner()`` draws the same table
and chart and redraws them as its sliders move. Every figure is ``labkit/_results/costs.py``'s,
the arithmetic lessons 06, 11, 12 and 13 check against what their runs measured::

    labkit.plan_table(MLPStack(dim=256, depth=4), world_size=4)                  # every strategy
    labkit.plan_table(MLPStack(dim=256, depth=4), world_size=2, strategy="FSDP", per_rank=True)

Activations are not in the table: the course measures them for lesson 05's CNN only, and a
figure that no lesson measures has no place here.
"""

from __future__ import annotations

from labkit._results import costs
from labkit._results.shapes import Shapes

#: The planner's precisions: bytes per value of parameters, gradients, optimizer state and
#: messages alike (the lessons measure float32; bf16 halves every figure but the step counters).
PRECISIONS = {"fp32": 4, "bf16": 2}
COLUMNS = ["params", "grads", "optimizer", "steps", "total", "sent"]
#: The columns of ``plan_table`` drawn as memory in the chart, with their colours.
PARTS = {"params": "tab:blue", "grads": "tab:orange", "optimizer": "tab:green"}


def shapes_of(model, precision: str | None = None) -> Shapes:
    """The ``Shapes`` the arithmetic reads: from a module, a parameter count or ``Shapes`` itself."""
    if isinstance(model, Shapes):
        shapes = model
    elif isinstance(model, int) and not isinstance(model, bool):
        shapes = Shapes.count(model)
    elif hasattr(model, "named_parameters"):
        shapes = Shapes.of(model)
    else:
        raise ValueError(f"model must be a module (an MLPStack), a parameter count or a Shapes, got "
                         f"{type(model).__name__}. HINT: labkit.plan_table(MLPStack(dim=256, depth=4), "
                         f"world_size=2) or labkit.plan_table(7_000_000_000, world_size=8).")
    if precision is None:
        return shapes
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}: one of {', '.join(PRECISIONS)}")
    return shapes.with_value_bytes(PRECISIONS[precision])


def _strategies(strategy) -> list[str]:
    if strategy is None:
        return list(costs.STRATEGIES)
    names = [strategy] if isinstance(strategy, str) else list(strategy)
    unknown = [s for s in names if s not in costs.STRATEGIES]
    if unknown or not names:
        raise ValueError(f"unknown strategy {unknown or names!r}: each one of {', '.join(costs.STRATEGIES)}. "
                         f"HINT: strategy=None plans them all.")
    return names


def _settings(world_size, optimizer: str, batch_size, tp) -> None:
    """What every strategy reads, checked before any row is worked out."""
    for name, value in (("world_size", world_size), ("batch_size", batch_size), ("tp", tp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a whole number >= 1, got {value!r}. "
                             f"HINT: labkit.plan_table(model, world_size=4, batch_size=32, tp=2).")
    if optimizer not in costs.OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}: one of {', '.join(costs.OPTIMIZERS)}")


def plan_table(model, *, world_size: int, strategy=None, precision: str | None = None,
               optimizer: str = "AdamW", batch_size: int = 32, tp: int = 2, per_rank: bool = False):
    """Memory per rank and bytes sent per step, for each strategy: the planner without widgets.

    Args:
        model: the model: a module (an ``MLPStack``, as the lessons build it), a parameter count
            (DDP, ZeRO and FSDP only: TP and PP need its shapes), or a ``Shapes``.
        world_size: the ranks.
        strategy: one of ``costs.STRATEGIES`` ("DDP", "ZeRO-1", ..., "FSDP x TP"), a list of
            them, or None for all (a strategy that cannot run at this size then says why in
            ``note``; "one process" is always on 1 rank, the yardstick).
        precision: "fp32" or "bf16" for every value; None: the model's own (a count: fp32).
        optimizer: "AdamW" (lessons 06, 13) or "SGD momentum" (lessons 11, 12).
        batch_size: the global batch (the activations TP and PP send).
        tp: the tensor-parallel group of "FSDP x TP" (the 2-D mesh is W / tp × tp).
        per_rank: one row per rank (index strategy, rank) instead of each strategy's largest rank.

    Returns:
        a DataFrame indexed by strategy (and rank): ``params``, ``grads``, ``optimizer`` (its
        values), ``steps`` (its step counters), ``total`` (all four), ``sent`` (bytes one rank
        sends per step), in bytes, and ``note``; ``attrs`` say the model and the settings.

    Raises:
        ValueError: an unknown model, strategy, precision or optimizer, or (for a strategy named
            alone) a world size that it cannot divide.

    Example (lessons 12, 13)::

        labkit.plan_table(MLPStack(dim=256, depth=4, in_features=256), world_size=4, optimizer="AdamW")
    """
    import pandas as pd

    names, shapes = _strategies(strategy), shapes_of(model, precision)
    _settings(world_size, optimizer, batch_size, tp)
    rows = []
    for name in names:
        ranks = 1 if name == "one process" else world_size
        try:
            found = costs.per_rank(name, shapes, ranks, batch_size=batch_size, tp=tp, optimizer=optimizer)
        except ValueError as err:
            if strategy is not None:   # named alone, or in a list: the caller asked for it
                raise
            rows.append({"strategy": name, "rank": 0, "note": str(err).split(". HINT")[0]})
            continue
        for rank, cost in enumerate(found):
            rows.append({"strategy": name, "rank": rank, "params": cost.params, "grads": cost.grads,
                         "optimizer": cost.optimizer, "steps": cost.steps, "total": cost.state,
                         "sent": float(cost.sent), "note": ""})
    table = pd.DataFrame(rows, columns=["strategy", "rank", *COLUMNS, "note"])
    if not per_rank:   # each strategy's largest rank
        table = table.sort_values("total", ascending=False, kind="stable").drop_duplicates("strategy")
        table = table.set_index("strategy").loc[names].drop(columns="rank")
    else:
        table = table.set_index(["strategy", "rank"])
    table.attrs.update(model=shapes.label, world_size=world_size, precision=precision or f"{shapes.value_bytes} bytes",
                       optimizer=optimizer, batch_size=batch_size, tp=tp)
    return table


def shown(table):
    """The table as a person reads it: MiB, and each strategy's memory as a share of one process's."""
    out = table[["params", "grads", "optimizer", "total", "sent"]].astype(float) / 2**20
    out.columns = [f"{c} MiB" if c != "sent" else "sent MiB/step" for c in out.columns]
    if "one process" in table.index and table.loc["one process", "total"] == table.loc["one process", "total"]:
        out["of one process"] = (table["total"] / table.loc["one process", "total"]).map(
            lambda v: "" if v != v else f"{v:.0%}")
    for column in out.columns[:5]:
        out[column] = out[column].map(lambda v: "—" if v != v else f"{v:,.3f}")
    out["note"] = table["note"]
    return out


def caption(table) -> str:
    a = table.attrs
    return (f"{a['model']} · {a['world_size']} ranks · {a['precision']} · {a['optimizer']} · global batch "
            f"{a['batch_size']} · FSDP x TP mesh {max(1, a['world_size'] // a['tp'])} x {a['tp']}")


def draw(table, fig) -> None:
    """Two panels on ``fig``: memory per rank (parameters, gradients, optimizer state stacked) and
    bytes sent per step, one bar per strategy (its largest rank)."""
    ax_mem, ax_sent = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
    ok = table[table["note"] == ""]
    names, bottom = list(ok.index), [0.0] * len(ok)
    for part, color in PARTS.items():
        values = list((ok[part] + (ok["steps"] if part == "optimizer" else 0)) / 2**20)
        ax_mem.bar(names, values, bottom=bottom, color=color, label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax_mem.set(ylabel="MiB per rank (largest rank)", title="memory per rank")
    ax_mem.legend(fontsize=8)
    ax_sent.bar(names, list(ok["sent"] / 2**20), color="tab:purple")
    ax_sent.set(ylabel="MiB sent per rank per step", title="bytes per step")
    for ax in (ax_mem, ax_sent):
        ax.tick_params(axis="x", labelrotation=45, labelsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(caption(table), fontsize=9)
    fig.tight_layout()
