"""The steps of ``make test-gpu`` (``tools/gpu_check.py`` runs them): each lesson's GPU path that
one CUDA GPU can run, launched from the lessons' committed scripts without Jupyter.

Each step takes the check's ``Context`` and returns one line of what it found; it raises
``Skip`` with the reason when it cannot run here, and fails with an ``AssertionError`` (the
lesson's own check) or any other error. On a GPU a step runs with the arguments its lesson
uses on GPUs (plus ``--synthetic``: the GPU machine has no network for CIFAR-10). In a
rehearsal (``--rehearse``, CPU ranks) it runs the same flags with small sizes appended (argparse
keeps the last value), so a misspelt flag or a broken check is found before the GPU box.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import sys

import labkit


class Skip(Exception):
    """The step cannot run here; the message says why."""


def last_value(args: list[str], flag: str) -> str:
    """The value argparse takes for ``flag``: the last one given."""
    return args[len(args) - args[::-1].index(flag)]


def doctor(ctx) -> str:
    """labkit.doctor(launch=True): the set-up, and a first launch on every GPU (NCCL)."""
    report = labkit.doctor(launch=True)
    print(report)
    assert report.ok, "doctor warned: " + "; ".join(c.what for c in report.checks if c.status == "warn")
    return report["a first launch"].value


def pytest_gpu(ctx) -> str:
    """The tests marked ``gpu``, in the files that hold them (no other file is imported)."""
    files = sorted(str(p.relative_to(ctx.root)) for p in (ctx.root / "tests").glob("test_*.py")
                   if "pytest.mark.gpu" in p.read_text())
    done = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p",
                           "no:cacheprovider", *files], cwd=ctx.root, env=ctx.env(),
                          capture_output=True, text=True, timeout=ctx.left_s())
    print(done.stdout[-4000:], done.stderr[-2000:], sep="\n")
    last = (done.stdout.strip().splitlines() or ["no output"])[-1].strip("= ")
    assert done.returncode == 0, f"pytest exit code {done.returncode}: {last}"
    if not ctx.gpu:
        assert "skipped" in last and "passed" not in last, last
    return f"{last} ({', '.join(f.removeprefix('tests/') for f in files)})"


def single_gpu(ctx) -> str:
    """Lesson 01: one process trains on one GPU; the loss falls."""
    args = ctx.args(["--epochs", "5", "--synthetic"],
                    ["--train-size", "256", "--test-size", "64", "--width", "8", "--epochs", "2",
                     "--batch-size", "32", "--log-every", "2", "--workers", "0"])
    run = ctx.launch("scripts/01_single.py", nproc=1, args=args, name="01-single")
    loss = labkit.loss_by_step(run)
    assert run.info["device"] == ctx.device, run.info["device"]
    assert loss.iloc[-1] < loss.iloc[0], loss
    acc = run.metrics()["test_acc"].dropna()
    return f"{len(loss)} windows on {ctx.device}: loss {loss.iloc[0]:.3f} -> {loss.iloc[-1]:.3f}, accuracy {acc.iloc[-1]:.1%}"


def activation_memory(ctx) -> str:
    """Lesson 05: activation checkpointing holds less for backward; on a GPU, the allocator's
    peak in the forward pass is lower too, while the step's peak, set in backward when the
    largest checkpointed block is rebuilt, stays where it was (within 2%)."""
    args = ctx.args(["--batch-sizes", "128,256,512", "--repeats", "20", "--width", "32"],
                    ["--batch-sizes", "8,16", "--repeats", "2", "--width", "8"])
    run = ctx.launch("scripts/05_activations.py", nproc=1, args=args, name="05-activations")
    rows = run.metrics().dropna(subset=["saved_bytes"])
    off, on = (rows[rows["mode"] == mode].set_index("batch") for mode in ("off", "on"))
    assert (on["saved_bytes"] < off["saved_bytes"]).all(), (on["saved_bytes"], off["saved_bytes"])
    if not ctx.gpu:
        assert off["peak_cuda_bytes"].isna().all() and off["forward_peak_cuda_bytes"].isna().all(), off
        return "saved bytes lower with checkpointing; CUDA peaks: rehearsed as absent on CPU"
    forward = on["forward_peak_cuda_bytes"], off["forward_peak_cuda_bytes"]
    assert (forward[0] < forward[1]).all(), forward
    assert (off["peak_cuda_bytes"] > off["forward_peak_cuda_bytes"]).all(), off
    assert ((on["peak_cuda_bytes"] - off["peak_cuda_bytes"]).abs() <= 0.02 * off["peak_cuda_bytes"]).all(), (on["peak_cuda_bytes"], off["peak_cuda_bytes"])
    mib = lambda col, b: f"{on.loc[b, col] / 2**20:.0f}/{off.loc[b, col] / 2**20:.0f}"
    return ("CUDA MiB with/without checkpointing, forward peak then step peak: "
            + ", ".join(f"batch {b:g}: {mib('forward_peak_cuda_bytes', b)}, {mib('peak_cuda_bytes', b)}"
                        for b in off.index))


# Lesson 08's arguments on GPUs (its first cell, DEVICE == "auto"), and small sizes for a rehearsal.
SPEED = ["--epochs", "2", "--width", "32", "--batch-size", "128", "--norm", "group", "--lr", "0.02",
         "--data-delay-ms", "0.05", "--workers", "8", "--synthetic"]
SPEED_TINY = ["--train-size", "256", "--width", "8", "--batch-size", "32", "--workers", "0",
              "--log-every", "2"]  # two epochs still: compare_losses compares epochs


def fp16_gradscaler(ctx) -> str:
    """Lesson 08: fp16 autocast with a GradScaler trains like float32; the scale stays above 1.
    A rehearsal runs bf16 instead (the script refuses fp16 on CPU: checked too)."""
    reference = ctx.launch("scripts/08_speed.py", nproc=1, args=ctx.args(SPEED, SPEED_TINY),
                           name="08-fp32")
    if not ctx.gpu:
        refused = subprocess.run([sys.executable, "scripts/08_speed.py", *SPEED, "--precision", "fp16"],
                                 env=ctx.env(cpu=True), capture_output=True, text=True, timeout=120)
        assert refused.returncode == 2 and "needs a GPU" in refused.stderr, refused.stderr[-500:]
    precision = "fp16" if ctx.gpu else "bf16"
    half = ctx.launch("scripts/08_speed.py", nproc=1, args=ctx.args(SPEED, SPEED_TINY) + ["--precision", precision],
                      name=f"08-{precision}")
    # Lesson 08's tolerance on GPUs: 10% of float32's first-epoch loss (its section 1 says why).
    labkit.compare_losses(half, reference, label=precision, early_tol=0.01,
                          epoch_tol=0.10 if ctx.gpu else 0.05).check()
    formats = half.metrics()["logits_dtype"].dropna()   # the model's output at step 1: autocast's format
    assert len(formats) and (formats == {"fp16": "float16", "bf16": "bfloat16"}[precision]).all(), formats
    if not ctx.gpu:
        return "bf16 trained like float32; fp16 refused on CPU, as the script says"
    scale = half.metrics()["loss_scale"].dropna()
    assert len(scale) and (scale > 1).all(), scale
    return (f"fp16 trained like float32; loss scale {scale.min():g} ({math.log2(2**16 / scale.min()):.0f} "
            f"overflowed step(s) skipped); "
            f"{reference.throughput():,.0f} vs {half.throughput():,.0f} samples/s (fp32, fp16)")


def mfu(ctx) -> str:
    """Lesson 08: model FLOPs utilisation of one GPU against its datasheet peak (TF32)."""
    args = ctx.args(["--width", "32", "--batch-size", "128", "--steps", "5", "--repeats", "5"],
                    ["--width", "8", "--batch-size", "16", "--steps", "2", "--repeats", "2"])
    run = ctx.launch("scripts/08_scaling.py", nproc=1, args=args, name="08-mfu")
    df = run.metrics()
    batch = int(last_value(args, "--batch-size"))
    flops = df.dropna(subset=["flops_per_step"]).set_index("batch_size")["flops_per_step"]
    measured = df.dropna(subset=["peak_flops"])["peak_flops"].max()
    if ctx.gpu:
        name = labkit.doctor().gpus[0].name
        sheet = labkit.datasheet_tflops(name)
        peak, source = (sheet * 1e12, f"datasheet TF32 of {name}") if sheet else (measured, f"measured ({name} not in the table)")
        rates = labkit.one_process_rates(df)["per-rank batch"]
    else:
        peak, source = measured, "measured matmul peak (CPU)"
        rates = next(r for s, r in labkit.one_process_rates(df).items() if s.endswith("per-rank batch"))
    achieved = rates.median() * flops[batch] / batch
    value = achieved / peak
    assert 0 < value < 1, (achieved, peak)
    return f"MFU {value:.1%}: {achieved / 1e12:.2f} of {peak / 1e12:.1f} TFLOP/s ({source})"


def tensor_parallel_bf16(ctx) -> str:
    """Lesson 11: tensor parallel in bf16 on the ranks there are (one GPU: one rank), within
    0.05 of float32; where the ranks all-reduce, bf16 sends half the bytes."""
    args = ctx.args(["--dim", "1024", "--depth", "8", "--batch-size", "128", "--steps", "20", "--strategy", "tp"],
                    ["--dim", "64", "--depth", "2", "--batch-size", "16", "--steps", "4"])
    fp32 = ctx.launch("scripts/11_tp.py", nproc=1, args=args, name="11-tp")
    bf16 = ctx.launch("scripts/11_tp.py", nproc=1, args=args + ["--bf16"], name="11-tp-bf16")
    drift = (labkit.loss_by_step(bf16) - labkit.loss_by_step(fp32)).abs()
    assert drift.max() <= 0.05, drift
    sent = labkit.last_step(fp32).get("bytes_all_reduce")
    halved = "one rank all-reduces nothing: the bytes check needs 2 GPUs"
    if sent is not None and sent.sum() > 0:
        assert (labkit.last_step(bf16)["bytes_all_reduce"] * 2 == sent).all()
        halved = "bf16 all-reduced half the bytes"
    return f"loss within {drift.max():.4f} of float32 (tolerance 0.05); {halved}"


def nvtx_ranges(ctx) -> str:
    """Lesson 07: ``--nvtx`` turns the script's phases into NVTX ranges, which Nsight Systems
    (``nsys``, where installed) lists. A rehearsal checks that the script refuses it on CPU."""
    tiny = ["--synthetic", "--train-size", "256", "--width", "8", "--batch-size", "32", "--workers", "0",
            "--epochs", "1", "--log-every", "2", "--nvtx"]
    if not ctx.gpu:
        refused = subprocess.run([sys.executable, "scripts/07_profiling.py", *tiny], env=ctx.env(cpu=True),
                                 capture_output=True, text=True, timeout=120)
        assert refused.returncode == 2 and "--nvtx needs a GPU" in refused.stderr, refused.stderr[-500:]
        return "--nvtx refused on CPU, as the script says"
    nsys = shutil.which("nsys")
    if nsys is None:
        run = ctx.launch("scripts/07_profiling.py", nproc=1, args=tiny, name="07-nvtx")
        raise Skip(f"trained with --nvtx ({run.run_dir.name}), but Nsight Systems (nsys) is not installed "
                   f"here: its NVTX ranges were not read")
    report = ctx.runs_dir / "07-nvtx"
    done = subprocess.run([nsys, "profile", "--trace=cuda,nvtx", "--force-overwrite=true", "-o", str(report),
                           sys.executable, "scripts/07_profiling.py", *tiny], env=ctx.env(),
                          capture_output=True, text=True, timeout=ctx.left_s())
    assert done.returncode == 0, done.stderr[-1500:]
    stats = subprocess.run([nsys, "stats", "--report", "nvtx_sum", "--format", "csv", f"{report}.nsys-rep"],
                           capture_output=True, text=True, timeout=ctx.left_s())
    found = [name for name in ("forward", "backward", "optimizer") if re.search(rf"\b{name}\b", stats.stdout)]
    assert found == ["forward", "backward", "optimizer"], stats.stdout[-2000:] + stats.stderr[-500:]
    return f"Nsight Systems lists the NVTX ranges {', '.join(found)} ({report}.nsys-rep)"


def nccl_one_rank(ctx) -> str:
    """NCCL (gloo in a rehearsal) on one rank: labkit.bandwidth's collectives over sizes."""
    sizes = [2**k for k in range(10, 31, 4)] if ctx.gpu else [2**10, 2**16]
    bw = labkit.bandwidth(nproc=1, device=ctx.launch_device, sizes=sizes, warmup=2, iters=5,
                          runs_dir=ctx.runs_dir, timeout_s=ctx.left_s())
    table = bw.table()
    assert bw.backend == ("nccl" if ctx.gpu else "gloo"), bw.backend
    assert len(table) == 3 * len(sizes) and (table["algbw_GBps"] > 0).all(), table
    top = table[table["op"] == "all_reduce"].iloc[-1]
    return (f"{bw.backend}: every collective at {len(sizes)} sizes; {top['size']} all-reduce in "
            f"{top['time_us']:.0f} us (one rank sends nothing: the plumbing, not the bandwidth)")


def context_parallel_api(ctx) -> str:
    """Lesson 14: PyTorch's context_parallel on the GPU ranks (one here): each rank holds its
    share of the tokens; within 5e-3 of full attention, and 3e-2 in bf16 with flash attention on
    Ampere or newer. A rehearsal checks imports and flags."""
    if not ctx.gpu:
        done = subprocess.run([sys.executable, "scripts/14_cp_api.py", "--help"], env=ctx.env(cpu=True),
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and re.search(r"--seq-len", done.stdout), done.stderr[-500:]
        return "its imports and arguments only: it needs CUDA to run"
    run = ctx.launch("scripts/14_cp_api.py", nproc=1, args=[], name="14-cp-api")
    held, error = run.metrics()["tokens_held"].dropna(), run.metrics()["max_error"].dropna()
    assert (held == 8192).all() and error.max() <= 5e-3, (held, error)
    flash = run.metrics()["flash_error"].dropna()  # NaN: no flash attention before Ampere
    assert flash.empty or flash.max() <= 3e-2, flash
    return (f"held {int(held.iloc[0])} of 8192 tokens; within {error.max():.1e} of full attention; "
            + (f"bf16 flash attention within {flash.max():.1e}" if len(flash) else "no flash attention on this GPU"))


#: (name, lesson, step), in the order they run.
STEPS = [
    ("doctor", "00", doctor),
    ("pytest -m gpu", "all", pytest_gpu),
    ("one-GPU training", "01", single_gpu),
    ("activation memory", "05", activation_memory),
    ("fp16 + GradScaler", "08", fp16_gradscaler),
    ("MFU vs datasheet", "08", mfu),
    ("bf16 tensor parallel", "11", tensor_parallel_bf16),
    ("NVTX for Nsight Systems", "07", nvtx_ranges),
    ("NCCL, one rank", "07", nccl_one_rank),
    ("context_parallel API", "14", context_parallel_api),
]
