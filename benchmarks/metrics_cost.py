"""What does metrics.log cost, per call and as a share of a lesson-02 training step?

    python benchmarks/metrics_cost.py [--calls 100000]

Measures, in one process: the time of one metrics.log call (writing to a real run
folder), and the time of one training step of the lesson-02 model at the smoke size
(width 8, batch 32) and the full size (width 32, batch 128), on the CPU. The share
is what logging *every* step would cost; the lessons log every k steps.
"""
from __future__ import annotations

import argparse
import importlib
import os
import statistics
import tempfile
import time


def log_cost_us(calls: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["LABKIT_RUN_DIR"] = tmp
        from labkit import metrics
        metrics = importlib.reload(metrics)
        metrics.log(0, loss=1.0, samples=128)  # opens the file
        samples = []
        for _ in range(5):
            start = time.perf_counter()
            for step in range(calls // 5):
                metrics.log(step, loss=2.3025850929940455, samples=128, epoch=1)
            samples.append((time.perf_counter() - start) / (calls // 5) * 1e6)
        metrics.flush()
        os.environ.pop("LABKIT_RUN_DIR")
        return statistics.median(samples)


def step_time_ms(width: int, batch: int, steps: int = 20) -> float:
    import torch
    import torch.nn.functional as F

    from labkit.models import SmallResNet

    torch.manual_seed(0)
    model = SmallResNet(width=width)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    times = []
    for i in range(steps + 3):
        start = time.perf_counter()
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if i >= 3:  # warm-up steps left out
            times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=100_000)
    args = parser.parse_args()
    import torch

    per_call = log_cost_us(args.calls)
    print(f"metrics.log: {per_call:.1f} µs per call (median of 5 × {args.calls // 5} calls)")
    for name, width, batch in (("smoke", 8, 32), ("full", 32, 128)):
        step = step_time_ms(width, batch, steps=20 if name == "smoke" else 5)
        share = per_call / 1000 / step
        print(f"lesson-02 step, {name} size (width {width}, batch {batch}), CPU, "
              f"{torch.get_num_threads()} threads: {step:.1f} ms; one log call = {share:.4%} of it")


if __name__ == "__main__":
    main()
