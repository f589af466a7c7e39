"""labkit: launch, watch and measure the course's distributed PyTorch scripts.

Notebook side (see each name's docstring)::

    import labkit
    labkit.doctor()
    run = labkit.launch("scripts/02_ddp.py", nproc=2, args=["--epochs", "2"])
    run.metrics(); run.throughput()
    sweep = labkit.sweep("scripts/02_ddp.py", nprocs=[1, 2], repeats=3)
    labkit.plot_speedup(sweep); labkit.plot_loss([run_a, run_b])
    trace = labkit.read_trace(run.run_dir / "trace_rank0.json")   # a profiler trace, as a table
    labkit.plot_timeline(trace[trace["step"] == 5])                 # lesson 07
    DEVICE = labkit.lesson_device()            # "auto" on 2+ GPUs, else CPU ranks
    labkit.compare_losses(run, reference, epoch_tol=0.05).check()   # trained alike?
    labkit.launch("scripts/09_project/train.py", nproc=1, nnodes=2)   # two nodes, one machine
    labkit.sbatch("scripts/09_job.sbatch", nodes=2)                    # where Slurm answers
    labkit.launch(script, nproc=2, hang_timeout=5, events=[labkit.py_spy_dump()])   # a hang
    labkit.launch(script, nproc=1, nnodes=2, min_nodes=1, max_restarts=3,          # elastic
                  events=[labkit.kill_node(1, at_step=12), labkit.add_node(at_step=24)])
    labkit.prove_same(tp, reference, label="TP", loss_tol=1e-4, tensor_tol=1e-5)   # lessons 11, 12
    labkit.schedule_order("1f1b", 0, stages=2, microbatches=8)       # a pipeline stage's order (12)

Exercises (``exercises/``)::

    labkit.check_ddp("scripts/ex02_ddp.py")    # launch the learner's script, say what is right
    labkit.hint("02-ddp", 1)                   # progressive hints

Script side::

    from labkit import metrics                 # standard library only
    metrics.log(step, loss=loss.item(), samples=n)
    from labkit import syncbn, comm            # torch (lessons 03, 04):
    model = DDP(syncbn.convert_sync_batchnorm(model))   # BatchNorm over all ranks, any backend
    counter = comm.count_allreduces(model)              # DDP's gradient all-reduces, counted
    with comm.count_collectives() as seen: ...          # every collective, in bytes (lesson 11)
    from labkit import checkpoint, memory      # torch (lessons 05, 06): atomic saves, bytes

Names load lazily, so a rank that only imports ``labkit.metrics`` does not pay
for pandas or matplotlib.
"""

from __future__ import annotations

import importlib

from labkit import _checks

__version__ = "0.1.0"

_LAZY = {
    "launch": "labkit._launch",
    "default_nproc": "labkit._plan",
    "lesson_device": "labkit._plan",
    "loss_by_step": "labkit._compare",
    "loss_by_epoch": "labkit._compare",
    "compare_losses": "labkit._compare",
    "LossComparison": "labkit._compare",
    "sweep": "labkit._sweep",
    "Sweep": "labkit._sweep",
    "Run": "labkit._run",
    "doctor": "labkit._doctor",
    "Report": "labkit._doctor",
    "diff": "labkit._diff",
    "write_variant": "labkit._diff",
    "try_load": "labkit._tryload",
    "LoadReport": "labkit._tryload",
    "plot_loss": "labkit._plots",
    "plot_metric": "labkit._plots",
    "plot_speedup": "labkit._plots",
    "plot_throughput": "labkit._plots",
    "gpu_count": "labkit._hardware",
    "datasheet_tflops": "labkit._hardware",
    "read_trace": "labkit._trace",
    "overlap_ms": "labkit._trace",
    "plot_timeline": "labkit._trace",
    # lesson 07: one DDP step taken apart
    "step_events": "labkit._profile",
    "allreduce_bytes": "labkit._profile",
    "powersgd_numbers": "labkit._profile",
    # lesson 08: waits, step 1, scaling
    "data_wait_per_step": "labkit._speed",
    "first_step_s": "labkit._speed",
    "steady_step_s": "labkit._speed",
    "ddp_rate": "labkit._speed",
    "one_process_rates": "labkit._speed",
    "baseline_name": "labkit._speed",
    "scaling_report": "labkit._speed",
    "is_smoke": "labkit._hardware",
    "LabkitError": "labkit._errors",
    "LaunchError": "labkit._errors",
    "LaunchTimeout": "labkit._errors",
    "ScriptError": "labkit._errors",
    "NoMetricsError": "labkit._errors",
    "RankFailure": "labkit._errors",
    "Feedback": "labkit._feedback",
    "hint": "labkit._hints",
    # lesson 09: Slurm
    "sbatch": "labkit._slurm",
    "slurm_status": "labkit._slurm",
    "SlurmStatus": "labkit._slurm",
    # lesson 10: hangs and elastic training
    "py_spy_dump": "labkit._hang",
    "dump_stack": "labkit._hang",
    "flight_records": "labkit._flight",
    "kill_node": "labkit._elastic",
    "add_node": "labkit._elastic",
    "elastic_rounds": "labkit._elastic",
    "elastic_losses": "labkit._elastic",
    "plot_elastic": "labkit._elastic",
    # lessons 11 and 12: strategies compared
    "prove_same": "labkit._strategies",
    "saved_tensors": "labkit._strategies",
    "tensor_gap": "labkit._strategies",
    "held_shards": "labkit._strategies",
    "last_step": "labkit._strategies",
    "measured_cost": "labkit._strategies",
    "expected_cost": "labkit._costs",
    "collectives_per_step": "labkit._strategies",
    # lesson 12: pipeline schedules
    "schedule_order": "labkit._pipeline",
    "most_in_flight": "labkit._pipeline",
    "replay_schedule": "labkit._pipeline",
    "schedule_events": "labkit._pipeline",
    "stage_orders": "labkit._pipeline",
    "early_starts": "labkit._pipeline",
    "measured_bubble": "labkit._pipeline",
    "plot_schedule": "labkit._pipeline",
}
_SUBMODULES = {"metrics", "data", "models", "checkpoint", "memory", "exercises", "syncbn", "comm"}

# Every exercise's check_<name>, found by its module's file name (labkit/_checks/exNN_<name>.py).
__all__ = sorted([*_LAZY, *_SUBMODULES, *_checks.check_names()])


def __getattr__(name: str):
    if name in _LAZY or name.startswith("check_") and name in _checks.check_names():
        value = getattr(importlib.import_module(_LAZY.get(name, "labkit._checks")), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"labkit.{name}")
    raise AttributeError(f"module 'labkit' has no attribute {name!r}")


def __dir__():
    return sorted({*__all__, *_checks.check_names()})
