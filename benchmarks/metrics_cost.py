"""What does metrics.log cost, per call and as a share of a lesson-02 training step?

Quality bars: metrics.log costs well under 1% of a training step, and tens of
microseconds a call (here: under 100 µs). The bar checked is the call next to the
step, the larger of the two figures below.

The step is the one lesson 02 runs on the CPU: labkit.launch starts 2 ranks
(one thread each, labkit's default on 2 cores) of benchmarks/_lesson02_step.py,
which trains SmallResNet with GroupNorm (`--norm group`) under DDP over gloo,
exactly the loop body of notebooks/scripts/02_ddp.py, on a fixed batch (no data
loading, so the step is shorter than the lesson's and the share an upper bound).
Inside each rank, next to each step, one metrics.log call with lesson 02's fields
is timed, writing to the run folder as in the lessons; then a tight loop of calls.
The first costs several times the second: right after a step the interpreter's
caches are cold (any small piece of Python, json.dumps alone, is slower there too),
and that is what a call in a training loop pays.
Two sizes: smoke (width 8, batch 32 per rank) and full on the CPU (width 32,
batch 128 per rank). The share is what logging *every* step would cost; lesson 02
logs every 4 (smoke) or 10 steps.

    python benchmarks/metrics_cost.py [--nproc 2]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import tempfile
from pathlib import Path

import labkit

import _machine

CALL_BAR_US = 100    # "tens of microseconds a call"
SHARE_BAR = 0.01     # "well under 1% of a training step": the printed share says how far under
RANK_SCRIPT = Path(__file__).with_name("_lesson02_step.py")
SIZES = (("smoke", 8, 32, 30), ("full", 32, 128, 10))  # name, width, batch per rank, timed steps


def measure(width: int, batch: int, steps: int, nproc: int, runs_dir: Path) -> list[dict]:
    """Launch the ranks; return what each measured."""
    with contextlib.redirect_stdout(io.StringIO()):
        run = labkit.launch(str(RANK_SCRIPT), nproc=nproc, device="cpu", runs_dir=runs_dir,
                            timeout_s=600, name=f"metrics-cost-w{width}",
                            args=["--width", str(width), "--batch-size", str(batch),
                                  "--norm", "group", "--steps", str(steps)])
    return [json.loads((run.run_dir / f"bench-rank{r}.json").read_text()) for r in range(nproc)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    print(f"machine: {_machine.describe()}")
    passed = True
    with tempfile.TemporaryDirectory() as tmp:
        for name, width, batch, steps in SIZES:
            ranks = measure(width, batch, steps, args.nproc, Path(tmp))
            step_ms = min(r["step_ms"] for r in ranks)  # the shorter step: the larger share
            in_loop = max(r["call_in_loop_us"] for r in ranks)
            tight = max(r["call_tight_us"] for r in ranks)
            per_rank = ", ".join(f"{r['step_ms']:.1f}" for r in ranks)
            share = in_loop / 1e3 / step_ms
            ok = in_loop <= CALL_BAR_US and share < SHARE_BAR
            passed &= ok
            print(f"{name} size (width {width}, batch {batch} per rank), {args.nproc} ranks × "
                  f"{ranks[0]['threads']} thread(s), DDP over gloo, GroupNorm:\n"
                  f"  training step {step_ms:.1f} ms (the shorter rank; medians of {steps} steps, "
                  f"per rank: {per_rank} ms)\n"
                  f"  metrics.log {in_loop:.1f} µs a call next to the step, {tight:.1f} µs in a tight "
                  f"loop (medians, slower rank)\n"
                  f"  one call = {share:.3%} of a step  "
                  f"bars: <= {CALL_BAR_US} µs, < {SHARE_BAR:.0%}: {'PASS' if ok else 'FAIL'}")
    print(f"metrics.log: {'PASS' if passed else 'FAIL'}")
    print(f"machine after: {_machine.describe()}")


if __name__ == "__main__":
    main()
