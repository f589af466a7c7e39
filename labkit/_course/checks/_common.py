"""What several checks share: the ranks to launch, the metrics, settings and files a run left,
comparisons. A helper that finds the run unfit to check ends the check (``Feedback.stop``)."""

from __future__ import annotations

import os

from labkit import _hardware
from labkit._errors import NoMetricsError
from labkit._course.feedback import Feedback


def _ranks(minimum: int = 2) -> dict:
    """Launch options for a check: every GPU when there are ``minimum`` or more (in smoke mode
    as many as ``LABKIT_RANKS`` allows, at least ``minimum``), else ``LABKIT_RANKS`` CPU ranks
    (2 unless set; ``make test-scale`` sets 4), at least ``minimum``: the size a lesson launches
    (``labkit.default_nproc``)."""
    wanted = max(minimum, _hardware.cpu_ranks())
    gpus = _hardware.gpu_count()
    if gpus >= minimum:
        return {"nproc": min(gpus, wanted if _hardware.is_smoke() else 8), "device": "auto"}
    return {"nproc": wanted, "device": "cpu"}


def _only_at(feedback: Feedback, nproc: int, why: str) -> dict:
    """Launch options for a check whose exercise holds at ``nproc`` ranks only (GPUs when there
    are that many, else CPU ranks). When ``LABKIT_RANKS`` asks for another size, the feedback
    says so, and why, in a note: a check never passes silently at a size it did not run.

    Example (a check whose plan is written for two ranks)::

        feedback = Feedback(EXERCISE)
        options = _only_at(feedback, 2, "the plan cuts each layer in two")
        feedback, run = launched(feedback, target, timeout_s=timeout_s, **options)
    """
    asked = os.environ.get(_hardware.RANKS_ENV, "").strip()
    if asked and _hardware.cpu_ranks() != nproc:
        feedback.note(f"this check runs on {nproc} ranks, not the {_hardware.cpu_ranks()} that "
                      f"{_hardware.RANKS_ENV} asks for: {why}")
    return {"nproc": nproc, "device": "auto" if _hardware.gpu_count() >= nproc else "cpu"}


def _metrics(feedback: Feedback, run, needed: list[str]):
    """The run's metrics, if every rank logged the ``needed`` columns; else a finding that ends the check."""
    try:
        df = run.metrics()
    except NoMetricsError:
        feedback.stop("the script logged no metrics: keep the metrics.log(...) lines of the skeleton.")
    missing = [c for c in needed if c not in df.columns]
    if missing:
        feedback.stop(f"the script never logged {', '.join(missing)}: keep the skeleton's "
                      f"metrics.log(...) lines as they are.")
    silent = sorted(set(range(run.world_size)) - set(df["rank"]))  # every rank of every node
    if silent:
        feedback.stop(f"{_on(silent, run.world_size)} logged nothing: did it stop early?")
    return df


def _last(df, column: str):
    """{rank: last logged value of column}."""
    return df.dropna(subset=[column]).groupby("rank")[column].last().to_dict()


def _on(ranks, world_size: int) -> str:
    """'rank 1', 'ranks 1, 3' or 'every rank'."""
    ranks = sorted(ranks)
    if len(ranks) == world_size > 1:
        return "every rank"
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _saved(feedback: Feedback, run, stem: str) -> dict:
    """{rank: what the rank saved as ``<run folder>/<stem>_rank<R>.pt``}; else a finding that ends the check."""
    import torch

    found, missing = {}, []
    for rank in range(run.nproc):
        path = run.run_dir / f"{stem}_rank{rank}.pt"
        if not path.is_file():
            missing.append(rank)
            continue
        try:
            found[rank] = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - whatever it is, the learner needs to hear it
            feedback.stop(f"{path.name} does not load ({str(err).strip().splitlines()[0][:200]}): keep the "
                          f"skeleton's torch.save(...) line as it is.")
    if missing:
        feedback.stop(f"{_on(missing, run.nproc)} saved nothing in the run folder ({stem}_rank<R>.pt): keep "
                      f"the skeleton's torch.save(...) at the end, and the default of --out.")
    return found


def _config(df, columns: list[str]) -> dict:
    """The settings the skeleton logged at step 0 (rank 0's line), so that an exercise's
    defaults live in its script alone."""
    row = df.dropna(subset=columns)
    row = row[row["rank"] == 0].iloc[0]
    return {c: row[c] for c in columns}


def _gap(got, want) -> float:
    """Largest difference, relative to the largest value wanted (and absolute below 1)."""
    want = want.double()
    return float((got.double() - want).abs().max() / max(1.0, float(want.abs().max())))


def _near(got, want, rtol: float = 1e-3) -> bool:
    """Close enough to name a mistake by what it computed (not the pass/fail tolerance)."""
    import torch

    return got.shape == want.shape and bool(torch.allclose(got.double(), want.double(), rtol=rtol, atol=1e-4))
