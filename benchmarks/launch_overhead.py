"""How much does labkit.launch cost over the same bare torchrun? (quality bar: ratio ≤ 1.10)

Runs a tiny 2-rank gloo script both ways, in pairs, alternating which goes first,
and prints each pair's ratio and the median. Plain script, not a test: timings on a
shared machine are noisy, so read the median and the spread.

    python benchmarks/launch_overhead.py [--pairs 7] [--nproc 2]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import labkit
from labkit import _hardware

TINY = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
print(f"rank {dist.get_rank()}: {t.item():.0f}")
dist.destroy_process_group()
"""


def bare(script: Path, nproc: int) -> float:
    """The torchrun command a learner would type, same rendezvous, output piped."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
            f"--nproc-per-node={nproc}", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0",
            f"--rdzv-id={uuid.uuid4().hex[:12]}", "--max-restarts=0", str(script)]
    env = dict(__import__("os").environ, OMP_NUM_THREADS=str(max(1, _hardware.cpu_count() // nproc)))
    start = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True, env=env)
    return time.perf_counter() - start


def with_labkit(script: Path, nproc: int, runs_dir: Path) -> float:
    start = time.perf_counter()
    labkit.launch(str(script), nproc=nproc, runs_dir=runs_dir, quiet=True, timeout=300)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "tiny.py"
        script.write_text(TINY)
        bare(script, args.nproc)  # warm the file cache once, unmeasured
        ratios, bares, labkits = [], [], []
        for i in range(args.pairs):
            if i % 2 == 0:
                b = bare(script, args.nproc)
                k = with_labkit(script, args.nproc, Path(tmp) / "runs")
            else:
                k = with_labkit(script, args.nproc, Path(tmp) / "runs")
                b = bare(script, args.nproc)
            bares.append(b)
            labkits.append(k)
            ratios.append(k / b)
            print(f"pair {i + 1}: bare torchrun {b:.2f} s, labkit.launch {k:.2f} s, ratio {k / b:.3f}")
    print(f"\nmedian: bare {statistics.median(bares):.2f} s, labkit {statistics.median(labkits):.2f} s, "
          f"ratio {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}); "
          f"bar: <= 1.10")
    print(f"machine: {_hardware.cpu_count()} CPU cores, {_hardware.gpu_count()} GPU(s), "
          f"{args.nproc} ranks, gloo")


if __name__ == "__main__":
    main()
