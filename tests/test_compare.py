"""labkit.compare_losses and the losses it reads: by step, by epoch, gaps and tolerances."""

from __future__ import annotations

import matplotlib
import pytest

import labkit
from labkit import NoMetricsError
from labkit._results.compare import EARLY_TOL
from test_run import make_run, rec

matplotlib.use("Agg")


def two_ranks(tmp_path, losses, *, epochs=None, name="r", device="cpu", every=4, spread=0.5):
    """A 2-rank run logging ``losses`` (the mean over ranks) at steps every, 2·every, ...;
    rank 0 logs loss − spread, rank 1 loss + spread, so only their mean is the loss."""
    lines = {0: [], 1: []}
    for i, loss in enumerate(losses):
        extra = {} if epochs is None else {"epoch": epochs[i]}
        step = every * (i + 1)
        lines[0].append(rec(0, step, float(i), loss=loss - spread, **extra))
        lines[1].append(rec(1, step, float(i), loss=loss + spread, **extra))
    folder = tmp_path / name
    folder.mkdir()
    return make_run(folder, lines, name=name, device=device)


def test_loss_by_step_and_by_epoch_are_means_over_ranks(tmp_path):
    run = two_ranks(tmp_path, [2.0, 1.5, 1.0, 0.5], epochs=[0, 0, 1, 1])
    by_step = labkit.loss_by_step(run)
    assert by_step.index.tolist() == [4, 8, 12, 16] and by_step.tolist() == [2.0, 1.5, 1.0, 0.5]
    assert labkit.loss_by_epoch(run).tolist() == [1.75, 0.75]
    assert labkit.loss_by_step(run.metrics()).equals(by_step)   # a DataFrame works too


def test_lines_without_a_loss_are_left_out(tmp_path):
    run = make_run(tmp_path, {0: [rec(0, 4, 1.0, loss=2.0, epoch=0), rec(0, 4, 1.1, test_acc=0.3, epoch=0)]})
    assert labkit.loss_by_step(run).tolist() == [2.0]
    assert labkit.loss_by_epoch(run).tolist() == [2.0]


def test_losses_say_what_the_run_did_not_log(tmp_path):
    run = two_ranks(tmp_path, [2.0, 1.5])
    with pytest.raises(NoMetricsError, match=r"logged no 'epoch', so its loss by epoch is unknown"):
        labkit.loss_by_epoch(run)
    (tmp_path / "other").mkdir()
    other = make_run(tmp_path / "other", {0: [rec(0, 1, 1.0, acc=0.5)]})
    with pytest.raises(NoMetricsError, match=r"logged no 'loss'"):
        labkit.loss_by_step(other)


def test_agreeing_runs_pass_and_print_each_tolerance(tmp_path, capsys):
    epochs = [0, 0, 1, 1]
    ref = two_ranks(tmp_path, [2.0, 1.5, 1.0, 0.5], epochs=epochs, name="ref")
    run = two_ranks(tmp_path, [2.0 + 5e-5, 1.5, 1.0 + 0.01, 0.5], epochs=epochs, name="ddp")
    same = labkit.compare_losses(run, ref, epoch_tol=0.05, window_tol=0.05)
    assert same.early == 2 and same.early_tol == EARLY_TOL["cpu"] == 1e-4
    assert same.early_gap == pytest.approx(5e-5) and same.same_steps
    assert same.check() is same
    printed = capsys.readouterr().out.splitlines()
    assert printed == same.lines() and len(printed) == 3
    assert printed[0] == "✓ first 2 windows: gap ≤ 5.0e-05 (tolerance 0.0001)"
    assert printed[1] == ("✓ whole run (2 epochs): each epoch's mean loss off the reference's by at "
                          "most 0.29% of its first-epoch loss (tolerance 5%); the largest "
                          "single-window gap was 1.0e-02")
    assert printed[2] == "✓ whole run (4 windows): gap ≤ 1.0e-02 (tolerance 0.05)"


def test_epoch_gaps_are_shares_of_the_first_epochs_loss(tmp_path):
    """A late epoch of small loss: 0.02 apart is 20% of that epoch's own loss (GPU noise does
    that) but 1.1% of the first epoch's 1.75; a run that stops learning is 80% off."""
    epochs = [0, 0, 1, 1]
    ref = two_ranks(tmp_path, [2.0, 1.5, 0.1, 0.1], epochs=epochs, name="ref")
    noisy = two_ranks(tmp_path, [2.0, 1.5, 0.12, 0.12], epochs=epochs, name="noisy")
    same = labkit.compare_losses(noisy, ref, epoch_tol=0.05).check()
    assert same.epoch_gap.tolist() == pytest.approx([0.0, 0.02 / 1.75])
    stalled = two_ranks(tmp_path, [2.0, 1.5, 1.5, 1.5], epochs=epochs, name="stalled")
    with pytest.raises(AssertionError, match=r"off the reference's by 80.00% of"):
        labkit.compare_losses(stalled, ref, epoch_tol=0.05).check()
    close = two_ranks(tmp_path, [2.0, 1.5, 0.1 + 2e-5, 0.1], epochs=epochs, name="close")
    line = labkit.compare_losses(close, ref, epoch_tol=0.05).lines()[1]
    assert "at most 0.00057% of" in line and "gap was 2.0e-05" in line, line  # not "0.00%", "0.000"


def test_a_label_prefixes_every_line(tmp_path):
    ref = two_ranks(tmp_path, [2.0, 1.5], name="ref")
    run = two_ranks(tmp_path, [2.0, 1.5], name="run")
    assert labkit.compare_losses(run, ref, label="synced BN").lines() == [
        "✓ synced BN: first 2 windows: gap ≤ 0.0e+00 (tolerance 0.0001)"]


def test_the_early_tolerance_follows_the_device(tmp_path):
    ref = two_ranks(tmp_path, [2.0, 1.5], name="ref", device="cuda")
    run = two_ranks(tmp_path, [2.0 + 1e-3, 1.5], name="run", device="cuda")
    same = labkit.compare_losses(run, ref)
    assert same.early_tol == EARLY_TOL["cuda"] == 5e-3
    same.check()
    with pytest.raises(AssertionError, match=r"first 2 windows: gap 1.0e-03 > tolerance 0.0001"):
        labkit.compare_losses(run, ref, early_tol=1e-4).check()


@pytest.mark.parametrize("losses, kwargs, message", [
    ([2.0 + 2e-4, 1.5, 1.0, 0.5], {}, r"first 2 windows: gap 2.0e-04 > tolerance 0.0001 "
                                      r"\(gaps by step: \{4: 0.0002, 8: 0.0\}\)"),
    ([2.0, 1.5, 1.0, 0.5 + 0.2], {"epoch_tol": 0.05},
     r"an epoch's mean loss is off the reference's by 5.71% of the reference's first-epoch loss "
     r"> tolerance 5%"),
    ([2.0, 1.5, 1.0, 0.5 + 0.2], {"window_tol": 0.05},
     r"a window's gap is 2.0e-01 > tolerance 0.05 \(at step 16\)"),
])
def test_each_tolerance_can_fail(tmp_path, losses, kwargs, message):
    epochs = [0, 0, 1, 1]
    ref = two_ranks(tmp_path, [2.0, 1.5, 1.0, 0.5], epochs=epochs, name="ref")
    run = two_ranks(tmp_path, losses, epochs=epochs, name="run")
    with pytest.raises(AssertionError, match=message):
        labkit.compare_losses(run, ref, label="ddp", **kwargs).check()


def test_a_whole_run_of_one_epoch_proves_nothing(tmp_path):
    ref = two_ranks(tmp_path, [2.0, 1.5], epochs=[0, 0], name="ref")
    run = two_ranks(tmp_path, [2.0, 1.5], epochs=[0, 0], name="run")
    with pytest.raises(AssertionError, match=r"whole run: 1 epoch\(s\); comparing epochs needs 2 or more"):
        labkit.compare_losses(run, ref, epoch_tol=0.05).check()


def test_runs_that_log_other_steps_do_not_agree(tmp_path):
    """A run with more windows than the reference matches its first ones, yet check() refuses."""
    ref = two_ranks(tmp_path, [2.0, 1.5], name="ref")
    run = two_ranks(tmp_path, [2.0, 1.5, 1.0], name="run")
    longer = labkit.compare_losses(run, ref)
    assert not longer.same_steps and longer.gap.index.tolist() == [4, 8]
    with pytest.raises(AssertionError, match="the runs logged different steps"):
        longer.check()


def test_first_windows_at_other_steps_are_refused_at_once(tmp_path):
    ref = two_ranks(tmp_path, [2.0, 1.5], name="ref", every=4)
    run = two_ranks(tmp_path, [2.0, 1.5], name="run", every=8)
    with pytest.raises(ValueError, match=r"first 2 windows are not at the same steps: 'run' logged "
                                         r"\[8, 16\], 'ref' \[4, 8\]"):
        labkit.compare_losses(run, ref)
    with pytest.raises(ValueError, match=r"first 3 windows are not at the same steps"):
        labkit.compare_losses(ref, ref, early=3)   # only 2 windows logged


def test_check_misses_passes_only_a_clear_miss(tmp_path, capsys):
    ref = two_ranks(tmp_path, [2.0, 1.5], name="ref")
    broken = two_ranks(tmp_path, [2.3, 1.5], name="broken")
    miss = labkit.compare_losses(broken, ref, label="no sampler")
    assert miss.check_misses() is miss
    assert capsys.readouterr().out == ("✓ no sampler: first 2 windows miss the reference by up to "
                                       "3.0e-01, 3000× the tolerance\n")
    with pytest.raises(AssertionError, match="does not match the reference"):
        miss.check()
    close = two_ranks(tmp_path, [2.0 + 5e-4, 1.5], name="close")
    with pytest.raises(AssertionError, match=r"within 5.0e-04 of the reference, not more than 10 × "
                                             r"the tolerance 0.0001"):
        labkit.compare_losses(close, ref).check_misses()


def test_bad_arguments_are_refused(tmp_path):
    ref = two_ranks(tmp_path, [2.0, 1.5], name="ref")
    with pytest.raises(ValueError, match=r"early must be an int >= 0"):
        labkit.compare_losses(ref, ref, early=-1)
    with pytest.raises(ValueError, match=r"epoch_tol must be a number >= 0, got '5%'"):
        labkit.compare_losses(ref, ref, epoch_tol="5%")
    with pytest.raises(ValueError, match=r"early_tol is not given, and run 'ref' does not say which "
                                         r"device it trained on"):
        labkit.compare_losses(ref.metrics(), ref)
    same = labkit.compare_losses(ref.metrics(), ref, early_tol=1e-4)
    assert same.early_gap == 0.0
    with pytest.raises(ValueError, match="check_misses compares the first windows"):
        labkit.compare_losses(ref, ref, early=0).check_misses()


def test_plot_draws_the_gap_and_the_tolerance(tmp_path):
    ref = two_ranks(tmp_path, [2.0, 1.5, 1.0], name="ref")
    run = two_ranks(tmp_path, [2.0, 1.5 + 1e-5, 1.0 + 1e-2], name="run")
    same = labkit.compare_losses(run, ref, label="ddp")
    ax = same.plot(title="gap")
    curve, tolerance = ax.lines
    assert curve.get_xdata().tolist() == [4, 8, 12]
    assert curve.get_ydata()[0] == 1e-8      # a gap of 0, drawn on the log scale
    assert tolerance.get_ydata()[0] == 1e-4 and ax.get_yscale() == "log"
    assert ax.get_xlabel() == "optimizer step" and ax.get_title() == "gap"
    assert ax.get_ylabel() == "|loss gap| (log scale; 0 at 1e-8)", "a learner must not read 1e-8 as a gap"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "ddp", "tolerance, first 2 windows: 0.0001"]
    off = two_ranks(tmp_path, [2.0 + 1e-6, 1.5 + 1e-5, 1.0 + 1e-2], name="off")
    assert labkit.compare_losses(off, ref).plot().get_ylabel() == "|loss gap| (log scale)"
    linear = same.plot(log=False, tolerance_line=False)
    assert len(linear.lines) == 1 and linear.get_ylim() == (0, pytest.approx(1.2e-2))
