"""How fast, against what: waits for data, the cost of step 1, and the scaling report.

Lesson 08 reads what its scripts time on the ranks:

- the training script logs, per window, the seconds the loop waited for the loader
  (``data_wait_s``) and, once, the seconds of step 1 (``first_step_s``);
- the scaling bench logs ``step_time_s`` of every repeat of every setting: DDP on every rank
  (setting "DDP"), then one process alone at the per-rank and the global batch, with one
  rank's threads and with every core (settings "<n> thread(s), per-rank batch", ...).

::

    labkit.data_wait_per_step(run, batch_size=32)      # median seconds a step waited for data
    report = labkit.scaling_report(bench.metrics(), nproc=2, batch_size=32)
"""

from __future__ import annotations


def _metrics(run):
    return run.metrics() if hasattr(run, "metrics") else run


def _need(df, columns, what: str):
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise ValueError(f"the run logged no {', '.join(missing)}: {what}. HINT: launch the lesson's "
                         f"script as the lesson does (scripts/08_speed.py or 08_scaling.py).")


def data_wait_per_step(run, batch_size: int) -> float:
    """The median seconds a training step waited for its batch, over the windows after step 1.

    Args:
        run: a ``Run`` of the lesson's training script (it logs ``data_wait_s`` and ``samples``
            with each window).
        batch_size: the per-rank batch (a window of ``samples`` holds samples / batch_size steps).

    Returns:
        seconds per step (median over windows and ranks).

    Raises:
        ValueError: the run logged no ``data_wait_s``.

    Example (lesson 08)::

        labkit.data_wait_per_step(starved, BATCH) >= BATCH * DELAY_MS / 1000
    """
    df = _metrics(run)
    _need(df, ["data_wait_s", "samples"], "how long each window waited for data")
    df = df.dropna(subset=["data_wait_s"])
    df = df[df["step"] > 1]
    return float((df["data_wait_s"] / (df["samples"] / batch_size)).median())


def first_step_s(run) -> float:
    """The seconds of step 1 on the slowest rank: where compiling and other one-off costs go.

    Raises:
        ValueError: the run logged no ``first_step_s``.

    Example (lesson 08)::

        cost = labkit.first_step_s(compiled) - labkit.first_step_s(reference)
    """
    df = _metrics(run)
    _need(df, ["first_step_s"], "the time of step 1")
    return float(df["first_step_s"].dropna().max())


def steady_step_s(run, global_batch: int) -> float:
    """The seconds of a steady training step: the global batch over the run's steady samples/s.

    Example (lesson 08)::

        saved = labkit.steady_step_s(reference, 64) - labkit.steady_step_s(compiled, 64)
    """
    return global_batch / run.throughput()


def ddp_rate(df, *, nproc: int, batch_size: int, setting: str = "DDP"):
    """Samples/s of DDP in each repeat of the scaling bench: the slowest rank sets the pace.

    Args:
        df: the bench's metrics.
        nproc: its ranks.
        batch_size: the per-rank batch.
        setting: the DDP setting's name in the bench.

    Returns:
        a pandas Series of samples/s indexed by repeat.

    Raises:
        ValueError: the bench logged no step time for ``setting``.

    Example (lesson 08)::

        labkit.ddp_rate(bench.metrics(), nproc=2, batch_size=32).median()
    """
    _need(df, ["setting", "step_time_s"], "the step time of each setting")
    steps = df[(df["setting"] == setting) & df["step_time_s"].notna()]
    if steps.empty:
        raise ValueError(f"the bench logged no step time for {setting!r}; its settings: "
                         f"{sorted(df['setting'].dropna().unique())}")
    return nproc * batch_size / steps.groupby("step")["step_time_s"].max()


def one_process_rates(df) -> dict:
    """Samples/s of each one-process setting of the scaling bench, per repeat.

    Returns:
        {setting: a pandas Series of samples/s}, for the settings that end in "batch".

    Example (lesson 08)::

        labkit.one_process_rates(bench.metrics())["1 thread(s), global batch"].median()
    """
    _need(df, ["setting", "step_time_s", "batch_size"], "the step time of each setting")
    one = df[df["setting"].str.endswith("batch", na=False) & df["step_time_s"].notna()]
    one = one.assign(rate=one["batch_size"] / one["step_time_s"])
    return {setting: part["rate"].reset_index(drop=True) for setting, part in one.groupby("setting")}


def baseline_name(setting: str, *, nproc: int, batch_size: int) -> str:
    """What a one-process setting of the bench is, in words.

    Example (lesson 08)::

        labkit.baseline_name("1 thread(s), global batch", nproc=2, batch_size=32)
        # '1 process × 1 thread(s), batch 64'
    """
    size = nproc * batch_size if setting.endswith("global batch") else batch_size
    threads = _threads(setting)
    return f"1 process × {threads} thread(s), batch {size}" if threads else f"1 GPU, batch {size}"


def scaling_report(df, *, nproc: int, batch_size: int, setting: str = "DDP"):
    """DDP's speedup over each one-process baseline, for strong and weak scaling.

    **Strong** scaling keeps the global batch: its baselines are the one-process settings at the
    global batch. **Weak** scaling keeps the per-rank batch: its baselines run the per-rank
    batch. Speedup is DDP's median samples/s over the baseline's; low and high pair DDP's slowest
    repeat with the baseline's fastest, and the other way round. **Ideal** is the hardware DDP ran
    on over the baseline's: ``nproc`` GPUs over one; on CPU ranks, the cores DDP's ranks could use
    (``nproc`` × one rank's threads, at most every core) over the baseline's threads. The bench
    names each baseline with its threads, the fewest being one rank's and the most every core, so
    both are read from the names. Efficiency is speedup / ideal: over one process on every core
    the ideal is 1×, and an efficiency above 100% says DDP's processes beat one process's threads
    on the same cores.

    Args:
        df: the scaling bench's metrics.
        nproc: DDP's ranks.
        batch_size: the per-rank batch.
        setting: the DDP setting's name in the bench.

    Returns:
        a DataFrame, one row per (scaling, baseline): scaling, baseline, baseline samples/s,
        DDP samples/s, speedup, low, high, ideal, efficiency.

    Raises:
        ValueError: the bench logged no DDP or no one-process setting.

    Example (lesson 08)::

        report = labkit.scaling_report(bench.metrics(), nproc=2, batch_size=32)
    """
    import pandas as pd

    ddp = ddp_rate(df, nproc=nproc, batch_size=batch_size, setting=setting)
    rates = one_process_rates(df)
    if not rates:
        raise ValueError("the bench logged no one-process setting (settings ending in 'batch'): did rank 0 "
                         "run the baselines after DDP?")
    threads = {name: _threads(name) for name in rates}
    counts = [n for n in threads.values() if n]
    ddp_cores = min(nproc * min(counts), max(counts)) if counts else None  # CPU: capped at every core
    rows = []
    for scaling, wanted in (("strong", "global batch"), ("weak", "per-rank batch")):
        for name, rate in rates.items():
            if not name.endswith(wanted):
                continue
            speedup = ddp.median() / rate.median()
            ideal = ddp_cores / threads[name] if threads[name] else nproc  # no threads named: one GPU
            rows.append({"scaling": scaling, "baseline": baseline_name(name, nproc=nproc, batch_size=batch_size),
                         "baseline samples/s": rate.median(), "DDP samples/s": ddp.median(),
                         "speedup": speedup, "low": ddp.min() / rate.max(), "high": ddp.max() / rate.min(),
                         "ideal": ideal, "efficiency": speedup / ideal})
    return pd.DataFrame(rows)


def _threads(setting: str) -> int | None:
    """The threads a bench setting names ("2 thread(s), global batch": 2), or None (a GPU's)."""
    head = setting.split(" thread(s)")[0]
    return int(head) if head.isdigit() else None
