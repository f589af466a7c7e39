"""A run's loss read back: the mean over ranks of each logged window, and of each epoch.

Every comparison of two runs' training starts here (``compare.compare_losses``, the exercise
checks of 07 and 08): the loss of the global batch, as one process on it would log it.
"""

from __future__ import annotations

from labkit._errors import NoMetricsError


def frame(run):
    """A run's metrics DataFrame (``run`` is a Run, or already a DataFrame)."""
    return run.metrics() if hasattr(run, "metrics") else run


def run_name(run) -> str:
    """What a message calls the run: its name, or a DataFrame's ``attrs["run"]``."""
    if hasattr(run, "name"):
        return str(run.name)
    return str(getattr(run, "attrs", {}).get("run", "run"))


def _losses(run, by: str):
    df = frame(run)
    for column in ("loss", by):
        if column not in df.columns:
            raise NoMetricsError(
                f"run '{run_name(run)}' logged no {column!r}, so its loss by {by} is unknown. "
                f"HINT: metrics.log(step, loss=..., epoch=epoch) in the script's training loop.")
    return df[df["loss"].notna()].groupby(by)["loss"].mean()


def loss_by_step(run):
    """The mean over ranks of each logged window's loss: the loss of the global batch.

    Each rank logs the mean loss of its own slice of every window; with equal slices, their
    mean is the loss of the whole global batch, which is what one process on that batch logs.

    Args:
        run: a ``Run`` (from ``labkit.launch``), or its ``run.metrics()`` DataFrame.

    Returns:
        a pandas Series of losses indexed by ``step``, in step order.

    Raises:
        NoMetricsError: the run logged no ``loss``.

    Example (lesson 02)::

        labkit.loss_by_step(ddp).head()
    """
    return _losses(run, "step")


def loss_by_epoch(run):
    """The mean loss of each epoch, over every logged window and every rank.

    Args:
        run: a ``Run``, or its ``run.metrics()`` DataFrame. The script logs ``epoch=`` with
            each loss.

    Returns:
        a pandas Series of mean losses indexed by ``epoch``.

    Raises:
        NoMetricsError: the run logged no ``loss``, or no ``epoch`` with it.

    Example (lessons 02 and 04)::

        labkit.loss_by_epoch(ddp)
    """
    return _losses(run, "epoch")
