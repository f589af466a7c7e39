"""How much does labkit.launch cost over the same torchrun command? (quality bar: ratio <= 1.10)

A tiny 2-rank gloo script (one all_reduce) is run three ways, in rounds:

  labkit   labkit.launch(script): its command, plus its supervision (run folder and
           run.json, pid files, the watcher threads, output read back and printed,
           failure collection at the end).
  same     the very command labkit stored in run.json as `argv` (same interpreter,
           rendezvous on 127.0.0.1:0, --local-addr, --log-dir, --redirects, ranks
           started in `-m labkit._rank.entry`), run with subprocess and the environment
           run.json records, with a fresh log folder and run id each time, and no
           run folder: the entry point then writes no pid files and watches only its
           parent. labkit / same is labkit's own cost, the ratio the bar is about.
  script   the same command with the script in place of `-m labkit._rank.entry SCRIPT`:
           torchrun runs the script itself. labkit's entry point ends a rank with
           os._exit once the script and its atexit handlers are done (see
           labkit/_entry.py), skipping the interpreter's teardown, so labkit / script
           can be below 1. Context only, no bar.

Each round runs all three, in an order that rotates from round to round, and the
ratios are taken within a round; the median and the spread over rounds are printed.
A plain script, not a test: on a shared machine timings are noisy, so read the
median and the spread.

    python benchmarks/launch_overhead.py [--rounds 9] [--nproc 2]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import labkit
from labkit import _rundir

import _machine

BAR = 1.10  # labkit.launch over the same torchrun command, at most

TINY = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
print(f"rank {dist.get_rank()}: {t.item():.0f}")
dist.destroy_process_group()
"""


def with_labkit(script: Path, nproc: int, runs_dir: Path) -> tuple[float, labkit.Run]:
    out = io.StringIO()  # labkit prints every rank's lines; a notebook would show them
    start = time.perf_counter()
    with contextlib.redirect_stdout(out):
        run = labkit.launch(str(script), nproc=nproc, runs_dir=runs_dir, device="cpu", timeout_s=300)
    return time.perf_counter() - start, run


def replay(template: labkit.Run, folder: Path, *, entry_point: bool) -> float:
    """Run the command labkit stored, without labkit: fresh log folder and run id."""
    folder.mkdir(parents=True)
    argv = []
    for arg in template.info["argv"]:
        if arg.startswith("--log-dir="):
            arg = f"--log-dir={_rundir.torchrun_dir(folder)}"
        elif arg.startswith("--rdzv-id="):
            arg = f"--rdzv-id={uuid.uuid4().hex[:12]}"
        argv.append(arg)
    if not entry_point:
        i = argv.index("labkit._rank.entry")
        del argv[i - 1:i + 1]  # "-m labkit._rank.entry SCRIPT" -> "SCRIPT"
    # The environment run.json records, and unbuffered output, as labkit gives its ranks.
    env = dict(os.environ, **template.info["env"], PYTHONUNBUFFERED="1")
    with open(folder / _rundir.TORCHRUN_LOG, "wb") as log:
        start = time.perf_counter()
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                              env=env)
        wall = time.perf_counter() - start
    if proc.returncode != 0:
        if entry_point:  # the command labkit runs must succeed, or nothing is compared
            raise RuntimeError(f"{' '.join(argv)} exited with {proc.returncode}; see {folder}")
        # A script run directly may die in the interpreter's teardown (labkit/_entry.py says
        # why) after its work is done; its time still counts, and the round says so.
        print(f"  note: torchrun running the script itself exited with {proc.returncode}")
    return wall


def spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.3f}, min {min(values):.3f}, max {max(values):.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    print(f"machine: {_machine.describe()}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        script = tmp / "tiny.py"
        script.write_text(TINY)
        runs = tmp / "runs"
        # One unmeasured run of each warms the file cache; labkit's gives the command.
        _, template = with_labkit(script, args.nproc, runs)
        print(f"labkit's command (run.json `command`):\n  {template.command}")
        replay(template, tmp / "warm-same", entry_point=True)
        replay(template, tmp / "warm-script", entry_point=False)

        runners = {
            "labkit": lambda i: with_labkit(script, args.nproc, runs)[0],
            "same": lambda i: replay(template, tmp / f"same-{i}", entry_point=True),
            "script": lambda i: replay(template, tmp / f"script-{i}", entry_point=False),
        }
        names = list(runners)
        walls = {name: [] for name in names}
        vs_same, vs_script = [], []
        for i in range(args.rounds):
            order = names[i % 3:] + names[:i % 3]
            wall = {name: runners[name](i) for name in order}
            for name in names:
                walls[name].append(wall[name])
            vs_same.append(wall["labkit"] / wall["same"])
            vs_script.append(wall["labkit"] / wall["script"])
            print(f"round {i + 1} ({', '.join(order)}): labkit {wall['labkit']:.2f} s, "
                  f"same command {wall['same']:.2f} s, script directly {wall['script']:.2f} s; "
                  f"labkit/same {vs_same[-1]:.3f}, labkit/script {vs_script[-1]:.3f}")

    print(f"\n{args.rounds} rounds, {args.nproc} ranks, gloo; wall times (median): "
          f"labkit {statistics.median(walls['labkit']):.2f} s, "
          f"same command {statistics.median(walls['same']):.2f} s, "
          f"script directly {statistics.median(walls['script']):.2f} s")
    median = statistics.median(vs_same)
    print(f"(a) labkit.launch / the same torchrun command: {spread(vs_same)}  "
          f"bar <= {BAR:.2f}: {'PASS' if median <= BAR else 'FAIL'}")
    print(f"(b) labkit.launch / torchrun running the script itself: {spread(vs_script)}  "
          f"(context, no bar)")
    print(f"machine after: {_machine.describe()}")


if __name__ == "__main__":
    main()
