"""ZeRO's table: what one rank holds and sends under DDP and ZeRO's three stages (lesson 13).

Pure arithmetic on the model's units (each one flat buffer, padded to a multiple of W as lesson
13's ``scripts/zero.py`` pads it), worked out by ``labkit/_results/costs.py`` (the planner's
arithmetic too: one source), checked by lesson 13 against what its runs measured
(``labkit.memory.storage_bytes``) and counted (``labkit.comm.count_collectives``)::

    labkit.zero_bytes(units, world_size, stage)     # ModelBytes(params, grads, optimizer)
    labkit.zero_traffic(units, world_size, stage)   # {"reduce_scatter": ..., "all_gather": ...}
    labkit.zero_table(units, world_size)            # all four side by side

Torch only when ``units`` are modules (to count their parameters) and for ``ModelBytes``.
"""

from __future__ import annotations


def _check_stage(stage) -> None:
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0 (DDP), 1, 2 or 3, got {stage!r}. "
                         f"HINT: 0 is DDP (nothing cut); 1 cuts the optimizer state, 2 the "
                         f"gradients too, 3 the parameters too.")


def _units(units, world_size) -> list[int]:
    """Each unit's number of values, checked (``units``: numbers, or modules to count)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    counts = [sum(p.numel() for p in u.parameters()) if hasattr(u, "parameters") else u
              for u in units]
    if not counts or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in counts):
        raise ValueError(f"units must be a non-empty list of modules or of value counts > 0, got {counts!r}. "
                         f"HINT: labkit.zero_bytes([model.stem, *model.blocks, model.head], world_size, stage).")
    return counts


def zero_bytes(units, world_size: int, stage: int, *, value_bytes: int = 4,
               optimizer_values: int = 2):
    """What one rank holds under ZeRO stage 0 (DDP), 1, 2 or 3, by the ZeRO paper's table.

    With Psi values in all, a rank holds Psi parameters, Psi gradients and ``optimizer_values``
    × Psi of optimizer state under DDP (AdamW: two moments). ZeRO-1 cuts the optimizer state
    into W slices, ZeRO-2 the gradients too, ZeRO-3 the parameters too (Rajbhandari et al.,
    2020, arXiv:1910.02054, figure 1). Exactly, as lesson 13's ``scripts/zero.py`` holds them:
    each unit is one flat buffer padded with zeros to a multiple of W (P values, P/W a slice),
    so that it splits into W equal slices; under stages 1 and 2 the whole padded buffer is
    held. Measured right after ``backward()``: stage 1 still holds every gradient whole.
    Optimizers' step counters are not counted (the paper's table has none).

    Args:
        units: what is flattened and cut together: modules, or their numbers of values.
        world_size: W, the ranks that share the slices.
        stage: 0 (DDP: nothing cut), 1, 2 or 3.
        value_bytes: bytes per value (4 for float32).
        optimizer_values: optimizer values per parameter (AdamW 2, SGD with momentum 1).

    Returns:
        ModelBytes(params, grads, optimizer) in bytes.

    Raises:
        ValueError: a bad stage, world size or unit.

    Example (lesson 13)::

        labkit.zero_bytes([4160, 33216, 33216, 778], 4, stage=2)   # ModelBytes(params=285_488, grads=71_372, ...)
    """
    from labkit._results.costs import zero_held
    from labkit.memory import ModelBytes

    _check_stage(stage)
    return ModelBytes(*zero_held(_units(units, world_size), world_size, stage, value_bytes=value_bytes,
                                 optimizer_values=optimizer_values))


def zero_table(units, world_size: int, *, value_bytes: int = 4, optimizer_values: int = 2):
    """DDP and ZeRO's three stages side by side: bytes per rank, and bytes sent per step.

    Memory from ``zero_bytes``; traffic from ``zero_traffic``, weighed as a rank
    sends it with ring algorithms (``labkit._results.costs.sent_bytes``, as
    ``labkit.comm.Collective.sent_bytes`` weighs what a run counted).

    Args:
        units, world_size, value_bytes, optimizer_values: as for ``zero_bytes``.

    Returns:
        a pandas DataFrame indexed by strategy (``DDP``, ``ZeRO-1``, ``ZeRO-2``, ``ZeRO-3``),
        columns ``params``, ``grads``, ``optimizer``, ``total`` and ``sent`` (the bytes one rank
        sends in one step's collectives), all in bytes. DDP sends what ZeRO-1 and 2 send, up to
        their padding: 2 (W - 1) / W × Psi values; ZeRO-3 half as much again.

    Example (lesson 13)::

        labkit.zero_table([model.stem, *model.blocks, model.head], world_size=2)
    """
    import pandas as pd

    from labkit._results.costs import sent_bytes

    rows = {}
    for stage, name in enumerate(("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")):
        held = zero_bytes(units, world_size, stage, value_bytes=value_bytes, optimizer_values=optimizer_values)
        traffic = zero_traffic(units, world_size, stage, value_bytes=value_bytes)
        rows[name] = {"params": held.params, "grads": held.grads, "optimizer": held.optimizer,
                      "total": held.total, "sent": sum(sent_bytes(k, b, world_size) for k, b in traffic.items())}
    return pd.DataFrame.from_dict(rows, orient="index")


def zero_traffic(units, world_size: int, stage: int, *, value_bytes: int = 4) -> dict:
    """The collectives of one training step under ZeRO stage 0 (DDP), 1, 2 or 3, in bytes.

    Each entry is the full-buffer bytes of a kind of collective, added up over the step, as
    ``labkit.comm.count_collectives`` weighs them, so the two compare with ``==``. With Psi values:

    - DDP all-reduces every gradient: ``all_reduce`` Psi;
    - ZeRO-1 and 2 reduce-scatter the gradients, then all-gather the updated slices: Psi each,
      2 Psi in all, what DDP's all-reduce carries (an all-reduce *is* a reduce-scatter and an
      all-gather);
    - ZeRO-3 all-gathers each unit twice (for forward and again for backward): 3 Psi.

    Each unit is padded to a multiple of W, as ``zero_bytes`` says; DDP pads
    nothing.

    Args:
        units: modules, or their numbers of values (one flat buffer each).
        world_size: W.
        stage: 0, 1, 2 or 3.
        value_bytes: bytes per value (4 for float32).

    Returns:
        ``{kind: bytes}``, kinds as ``CollectiveCounter.bytes`` names them.

    Raises:
        ValueError: a bad stage, world size or unit.

    Example (lesson 13)::

        labkit.zero_traffic([1000, 10], 4, stage=3)   # {'all_gather': 8096, 'reduce_scatter': 4048}
    """
    from labkit._results.costs import zero_collectives

    _check_stage(stage)
    return zero_collectives(_units(units, world_size), world_size, stage, value_bytes=value_bytes)
