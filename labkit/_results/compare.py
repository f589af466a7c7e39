"""Did two runs train alike? Their losses' gaps (read by ``losses``), and the tolerances.

Lessons 02, 03, 04 and 06 each prove that a distributed run computes what a reference
computes (one process on the global batch, a bigger batch, DDP). "The same" cannot mean bit
for bit: the ranks add the same numbers in another order, and training amplifies the last
bits step after step. So a lesson checks two things:

- the **first windows** agree to rounding: within ``EARLY_TOL["cpu"]`` (1e-4) on CPU ranks,
  ``EARLY_TOL["cuda"]`` (5e-3) on GPUs, where TF32 convolutions and non-deterministic
  kernels add their own rounding. A real difference (other data, another learning rate, a
  summed gradient) shows at once and is far larger;
- the **whole run** goes the same way: each epoch's mean loss within ``epoch_tol`` of the
  reference's, as a share of the reference's *first* epoch's mean loss (the scale of the
  problem), or every window within an absolute tolerance (``window_tol``).

Why the first epoch's loss and not each epoch's own: on a GPU two float32 runs of the same
script part ways after a few dozen steps (cuDNN's kernels add in a varying order), and one
H100 measured a later epoch's mean 1% apart between two such runs, 12% between bf16 autocast
and float32, while the loss was falling fast. Once the loss is small, a share of that epoch's
own loss calls such noise a failure; a run that stops learning is still off by tens of percent
of the first epoch's loss.

``compare_losses`` holds the gaps and the tolerances in one object that can draw them, say its
✓ lines and assert them.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit._results.losses import loss_by_epoch, loss_by_step, run_name

#: Tolerance on the first windows' loss gap, by the device the runs trained on.
EARLY_TOL = {"cpu": 1e-4, "cuda": 5e-3}
#: How many logged windows count as "the first windows".
EARLY_WINDOWS = 2


@dataclass
class LossComparison:
    """How far a run's loss is from a reference's, and the tolerances it must meet.

    Made by ``compare_losses``. ``check()`` asserts the runs agree and prints one ✓ line per
    tolerance; ``check_misses()`` asserts the opposite, for a broken run that must fail.

    Attributes:
        label: what the ✓ lines call the run ("" for none).
        gap: |loss − reference's loss| of each logged window, indexed by step (the steps both
            runs logged).
        same_steps: True when both runs logged exactly the same steps.
        early: how many first windows must agree to rounding.
        early_tol: their tolerance (absolute).
        epoch_gap: |epoch mean − reference's| / the reference's first epoch mean, per
            epoch; None without
            ``epoch_tol``.
        epoch_tol: tolerance on each epoch's mean loss gap, as a share of the reference's
            first epoch mean, or None.
        window_tol: absolute tolerance on every window of the whole run, or None.

    Example (lesson 02)::

        cmp = labkit.compare_losses(ddp, single, epoch_tol=0.05)
        cmp.plot(); cmp.check()
    """

    label: str
    gap: object
    same_steps: bool
    early: int
    early_tol: float
    epoch_gap: object = None
    epoch_tol: float | None = None
    window_tol: float | None = None

    @property
    def early_gap(self) -> float:
        """The largest gap in the first ``early`` windows."""
        return float(self.gap.iloc[:self.early].max()) if self.early else 0.0

    def _prefix(self) -> str:
        return f"{self.label}: " if self.label else ""

    def failures(self) -> list[str]:
        """What does not hold, one sentence each with the values involved; [] if all hold."""
        found = []
        if not self.same_steps:
            found.append("the runs logged different steps: compare runs that take the same "
                         "optimizer steps and log at the same ones")
        if self.early and not self.early_gap <= self.early_tol:
            found.append(f"first {self.early} windows: gap {self.early_gap:.1e} > tolerance "
                         f"{self.early_tol:g} (gaps by step: {_rounded(self.gap.iloc[:self.early])})")
        if self.epoch_tol is not None:
            if len(self.epoch_gap) < 2:
                found.append(f"whole run: {len(self.epoch_gap)} epoch(s); comparing epochs needs "
                             f"2 or more")
            elif not self.epoch_gap.max() <= self.epoch_tol:
                found.append(f"whole run: an epoch's mean loss is off the reference's by "
                             f"{self.epoch_gap.max():.2%} of the reference's first-epoch loss > "
                             f"tolerance {self.epoch_tol:.0%} (by epoch: "
                             f"{_rounded(self.epoch_gap)})")
        if self.window_tol is not None and not self.gap.max() <= self.window_tol:
            found.append(f"whole run: a window's gap is {self.gap.max():.1e} > tolerance "
                         f"{self.window_tol:g} (at step {self.gap.idxmax()})")
        return found

    def lines(self) -> list[str]:
        """The ✓ lines that ``check()`` prints: each gap measured, with its tolerance."""
        out = []
        if self.early:
            out.append(f"✓ {self._prefix()}first {self.early} windows: gap ≤ {self.early_gap:.1e} "
                       f"(tolerance {self.early_tol:g})")
        if self.epoch_tol is not None:
            out.append(f"✓ {self._prefix()}whole run ({len(self.epoch_gap)} epochs): each epoch's "
                       f"mean loss off the reference's by at most {self.epoch_gap.max() * 100:.2g}% of "
                       f"its first-epoch loss (tolerance {self.epoch_tol:.0%}); the largest single-window "
                       f"gap was {self.gap.max():.1e}")  # .2g and .1e: a gap of 1e-5 is not "0.00%"
        if self.window_tol is not None:
            out.append(f"✓ {self._prefix()}whole run ({len(self.gap)} windows): gap ≤ "
                       f"{self.gap.max():.1e} (tolerance {self.window_tol:g})")
        return out

    def check(self) -> "LossComparison":
        """Assert that the runs agree within every tolerance, then print the ✓ lines.

        Returns:
            self, so that a cell can go on with ``.gap`` or ``.plot()``.

        Raises:
            AssertionError: a tolerance is missed, the runs logged different steps, or an
                epoch comparison has fewer than 2 epochs; the message gives the gaps.
        """
        failures = self.failures()
        if failures:
            raise AssertionError(f"{self.label or 'the run'} does not match the reference: "
                                 + "; ".join(failures))
        for line in self.lines():
            print(line)
        return self

    def check_misses(self, factor: float = 10) -> "LossComparison":
        """Assert that a broken run misses the reference: its first windows' gap exceeds
        ``factor`` × the tolerance. This is what shows that ``check()`` can fail.

        Returns:
            self.

        Raises:
            AssertionError: the broken run came within ``factor`` × the tolerance.

        Example (lesson 02's first pitfall)::

            labkit.compare_losses(no_sampler, reference).check_misses()
        """
        if not self.early:
            raise ValueError("check_misses compares the first windows: pass early >= 1")
        if not self.early_gap > factor * self.early_tol:
            raise AssertionError(
                f"{self.label or 'the broken run'}'s first {self.early} windows are within "
                f"{self.early_gap:.1e} of the reference, not more than {factor:g} × the "
                f"tolerance {self.early_tol:g}: the check would not tell it apart "
                f"(gaps by step: {_rounded(self.gap.iloc[:self.early])})")
        print(f"✓ {self._prefix()}first {self.early} windows miss the reference by up to "
              f"{self.early_gap:.1e}, {self.early_gap / self.early_tol:.0f}× the tolerance")
        return self

    def plot(self, ax=None, *, log: bool = True, label: str | None = None,
             tolerance_line: bool = True, title: str | None = None, **style):
        """Draw the gap of each window, and the first windows' tolerance as a dotted line.

        Args:
            ax: the axes to draw on (a new figure if None); several comparisons can share one.
            log: a log scale (gaps of 0 are drawn at 1e-8); False for a linear scale, for
                gaps that may be exactly 0.
            label: the curve's legend entry (default: the comparison's label).
            tolerance_line: draw the tolerance (once per axes is enough).
            title: the axes' title.
            **style: passed to ``ax.plot`` (``color``, ``marker``, ...).

        Returns:
            the matplotlib Axes.
        """
        import matplotlib.pyplot as plt

        if ax is None:
            _, ax = plt.subplots(figsize=(7, 3.4))
        shown = ax.get_ylim()[1] if ax.lines else 0.0   # another comparison already drawn here
        style = {"marker": "o", "ms": 4, **style}
        gap = self.gap.clip(lower=1e-8) if log else self.gap
        ax.plot(gap.index, gap, label=label if label is not None else (self.label or None), **style)
        if tolerance_line and self.early:
            ax.axhline(self.early_tol, color="grey", ls=":",
                       label=f"tolerance, first {self.early} windows: {self.early_tol:g}")
        ax.set_xlabel("optimizer step")
        if log:
            ax.set_yscale("log")
            zero = bool((self.gap == 0).any()) or "0 at 1e-8" in ax.get_ylabel()   # say where 0 went
            ax.set_ylabel("|loss gap| (log scale; 0 at 1e-8)" if zero else "|loss gap| (log scale)")
        else:
            ax.set_ylim(0, max(2 * self.early_tol, 1.2 * float(self.gap.max()), shown))
            ax.set_ylabel("|loss gap|")
            ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
        if title is not None:
            ax.set_title(title)
        ax.legend(fontsize=8)
        return ax

    def __repr__(self) -> str:
        return (f"LossComparison({self.label!r}, first {self.early} windows ≤ {self.early_gap:.1e}"
                f" (tol {self.early_tol:g}), {len(self.gap)} windows, "
                f"{'ok' if not self.failures() else 'FAILS'})")


def _rounded(series) -> dict:
    return {k: float(f"{v:.2e}") for k, v in series.items()}


def compare_losses(run, reference, *, label: str = "", early: int = EARLY_WINDOWS,
                   early_tol: float | None = None, epoch_tol: float | None = None,
                   window_tol: float | None = None) -> LossComparison:
    """Compare a run's loss with a reference run's, window by window and over the whole run.

    The gap is |loss − reference's loss| of each logged window (the mean over ranks, see
    ``loss_by_step``), on the steps both runs logged. Pass the tolerances the lesson claims;
    nothing is asserted until ``.check()`` (or ``.check_misses()`` for a broken run).

    Args:
        run: the run under test (a ``Run``, or a metrics DataFrame with ``early_tol`` given).
        reference: the run it should match (one process on the global batch, DDP, ...).
        label: what the ✓ lines and the chart call the run, e.g. "synced BN".
        early: how many first windows must agree to rounding (0: none).
        early_tol: their tolerance; default ``EARLY_TOL`` for the device ``run`` trained on
            (1e-4 on CPU, 5e-3 on GPUs).
        epoch_tol: tolerance on each epoch's mean loss gap, as a share of the reference's
            first epoch mean loss (lessons 02, 04: 0.05), or None.
        window_tol: absolute tolerance on every window's gap (lesson 06: 0.05), or None.

    Returns:
        a ``LossComparison`` holding the gaps and the tolerances.

    Raises:
        NoMetricsError: a run logged no loss (or no epoch, with ``epoch_tol``).
        ValueError: a bad tolerance or ``early``; the runs do not both log the first ``early``
            windows at the same steps; ``early_tol`` missing for a DataFrame.

    Example (lesson 02)::

        same = labkit.compare_losses(ddp, reference, epoch_tol=0.05).check()
        same.plot(title="rounding, amplified by training")
    """
    if isinstance(early, bool) or not isinstance(early, int) or early < 0:
        raise ValueError(f"early must be an int >= 0 (windows), got {early!r}")
    for name, value in (("early_tol", early_tol), ("epoch_tol", epoch_tol), ("window_tol", window_tol)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not value >= 0):
            raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    if early_tol is None:
        info = getattr(run, "info", None)   # a Run's run.json (a DataFrame's .info is a method)
        device = info.get("device") if isinstance(info, dict) else None
        if device not in EARLY_TOL:
            raise ValueError(f"early_tol is not given, and run '{run_name(run)}' does not say which "
                             f"device it trained on (got {device!r}). HINT: pass early_tol=1e-4 "
                             f"(CPU) or 5e-3 (GPU), or pass the Run itself.")
        early_tol = EARLY_TOL[device]
    ours, ref = loss_by_step(run), loss_by_step(reference)
    first = list(ref.index[:early])
    if len(first) < early or list(ours.index[:early]) != first:
        raise ValueError(
            f"the first {early} windows are not at the same steps: '{run_name(run)}' logged "
            f"{list(ours.index[:early])}, '{run_name(reference)}' {list(ref.index[:early])}. HINT: give "
            f"both runs the same --log-every and global batch, or compare fewer windows (early=...).")
    common = ours.index.intersection(ref.index)
    gap = (ours[common] - ref[common]).abs()
    same_steps = list(ours.index) == list(ref.index)
    epoch_gap = None
    if epoch_tol is not None:
        ours_e, ref_e = loss_by_epoch(run), loss_by_epoch(reference)
        epochs = ours_e.index.intersection(ref_e.index)
        same_steps = same_steps and list(ours_e.index) == list(ref_e.index)
        epoch_gap = (ours_e[epochs] - ref_e[epochs]).abs() / ref_e.iloc[0]
    return LossComparison(label, gap, same_steps, early, float(early_tol), epoch_gap,
                          epoch_tol, window_tol)
