"""labkit: launch, watch and measure the course's distributed PyTorch scripts.

Notebook side (see each name's docstring)::

    import labkit
    labkit.doctor()
    run = labkit.launch("scripts/02_ddp.py", nproc=2, args=["--epochs", "2"])
    run.metrics(); run.throughput()
    sweep = labkit.sweep("scripts/02_ddp.py", nproc=[1, 2], repeats=3)
    labkit.plot_speedup(sweep); labkit.plot_loss([run_a, run_b])
    trace = labkit.read_trace(run.run_dir / "trace_rank0.json")   # a profiler trace, as a table
    labkit.plot_timeline(trace[trace["step"] == 5])                 # lesson 07
    DEVICE = labkit.lesson_device()            # "auto" on 2+ GPUs, else CPU ranks
    labkit.compare_losses(run, reference, epoch_tol=0.05).check()   # trained alike?
    labkit.launch("scripts/09_project/train.py", nproc=1, nnodes=2)   # two nodes, one machine
    labkit.sbatch("scripts/09_job.sbatch", nodes=2)                    # where Slurm answers
    labkit.launch(script, nproc=2, hang_timeout_s=5, events=[labkit.py_spy_dump()])   # a hang
    labkit.launch(script, nproc=1, nnodes=2, min_nodes=1, max_restarts=3,          # elastic
                  events=[labkit.kill_node(1, at_step=12), labkit.add_node(at_step=24)])
    labkit.prove_same(tp, reference, label="TP", loss_tol=1e-4, tensor_tol=1e-5)   # lessons 11, 12
    labkit.schedule_order("1f1b", 0, stages=2, microbatches=8)       # a pipeline stage's order (12)
    p = labkit.predict("bytes all-reduced per step", unit="MB")     # the learner's guess, then
    p.grade(measured_mb, run=run)                                    # graded, kept in the run folder
    labkit.planner(dim=1024, depth=8, world_size=8)                  # memory and bytes per strategy
    labkit.plan_table(model, world_size=4)                           # the same, as a DataFrame

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

from labkit._course import checks as _checks

__version__ = "0.1.0"

# The one registry of public names: name -> the module that defines it (loaded on first use).
_LAZY = {
    # launching (labkit/_launch/)
    "launch": "labkit._launch.launch",
    "default_nproc": "labkit._launch.plan",
    "lesson_device": "labkit._launch.plan",
    "sweep": "labkit._launch.sweep",
    "Sweep": "labkit._launch.sweep",
    "sbatch": "labkit._launch.sbatch",            # lesson 09: Slurm
    "slurm_status": "labkit._launch.sbatch",
    "SlurmStatus": "labkit._launch.sbatch",
    "kill_node": "labkit._launch.elastic",        # lesson 10: elastic training
    "add_node": "labkit._launch.elastic",
    # reading results (labkit/_results/)
    "Run": "labkit._results.run",
    "loss_by_step": "labkit._results.losses",
    "loss_by_epoch": "labkit._results.losses",
    "compare_losses": "labkit._results.compare",
    "logged": "labkit._results.logged",            # lessons 02-06: what a run logged, by rank and step
    "steps_per_epoch": "labkit._results.logged",
    "late_loss": "labkit._results.logged",
    "bn_allreduces_per_step": "labkit._results.logged",
    "ddp_allreduces_per_step": "labkit._results.logged",
    "step_s": "labkit._results.logged",
    "LossComparison": "labkit._results.compare",
    "plot_loss": "labkit._results.plots",
    "plot_metric": "labkit._results.plots",
    "plot_speedup": "labkit._results.plots",
    "plot_throughput": "labkit._results.plots",
    "diff": "labkit._results.diff",
    "write_variant": "labkit._results.diff",
    "try_load": "labkit._results.tryload",
    "LoadReport": "labkit._results.tryload",
    "elastic_rounds": "labkit._results.elastic",
    "elastic_losses": "labkit._results.elastic",
    "elastic_resumes": "labkit._results.elastic",
    "plot_elastic": "labkit._results.elastic",
    # the interactive layer (labkit/_interact/): predict, then measure
    "predict": "labkit._interact.predict",
    "Prediction": "labkit._interact.predict",
    "Grade": "labkit._interact.predict",
    "predictions": "labkit._interact.guesses",
    "planner": "labkit._interact.planner",           # lessons 12, 13: the memory calculator
    "Planner": "labkit._interact.planner",
    "plan_table": "labkit._interact.plan",
    # diagnosing (labkit/_diagnose/)
    "doctor": "labkit._diagnose.doctor",
    "Report": "labkit._diagnose.doctor",
    "read_trace": "labkit._diagnose.trace",
    "overlap_ms": "labkit._diagnose.trace",
    "plot_timeline": "labkit._diagnose.trace",
    "py_spy_dump": "labkit._diagnose.hang",       # lesson 10: hangs
    "dump_stack": "labkit._diagnose.hang",
    "flight_records": "labkit._diagnose.flight",
    "bandwidth": "labkit._diagnose.bandwidth",    # lesson 07: what the links carry
    "Bandwidth": "labkit._diagnose.bandwidth",
    "AlphaBeta": "labkit._diagnose.ring",
    "preflight": "labkit._diagnose.preflight",    # lesson 09: before a launch on several nodes
    "Preflight": "labkit._diagnose.preflight",
    # the machine
    "gpu_count": "labkit._hardware",
    "datasheet_tflops": "labkit._hardware",
    # lesson 07: one DDP step taken apart
    "step_events": "labkit._diagnose.profile",
    "allreduce_bytes": "labkit._diagnose.profile",
    "powersgd_numbers": "labkit._diagnose.profile",
    "is_smoke": "labkit._hardware",
    # errors
    "LabkitError": "labkit._errors",
    "LaunchError": "labkit._errors",
    "LaunchTimeout": "labkit._errors",
    "ScriptError": "labkit._errors",
    "NoMetricsError": "labkit._errors",
    "RankFailure": "labkit._errors",
    # the course's exercises (labkit/_course/; every check_<name> is found by its file name)
    "Feedback": "labkit._course.feedback",
    "hint": "labkit._course.hints",
    # lessons 08, 11, 12: speed, strategies, pipelines (labkit/_results/)
    "data_wait_per_step": "labkit._results.speed",
    "first_step_s": "labkit._results.speed",
    "steady_step_s": "labkit._results.speed",
    "ddp_rate": "labkit._results.speed",
    "one_process_rates": "labkit._results.speed",
    "baseline_name": "labkit._results.speed",
    "scaling_report": "labkit._results.speed",
    "prove_same": "labkit._results.strategies",
    "saved_tensors": "labkit._results.strategies",
    "tensor_gap": "labkit._results.strategies",
    "tensor_gaps": "labkit._results.strategies",
    "held_shards": "labkit._results.strategies",
    "last_step": "labkit._results.strategies",
    "measured_cost": "labkit._results.strategies",
    "collectives_per_step": "labkit._results.strategies",
    "expected_cost": "labkit._results.costs",
    "zero_bytes": "labkit._results.zero",          # lesson 13: ZeRO's table
    "zero_traffic": "labkit._results.zero",
    "zero_table": "labkit._results.zero",
    "schedule_order": "labkit._results.pipeline",
    "most_in_flight": "labkit._results.pipeline",
    "replay_schedule": "labkit._results.pipeline",
    "schedule_events": "labkit._results.pipeline",
    "stage_orders": "labkit._results.pipeline",
    "early_starts": "labkit._results.pipeline",
    "measured_bubble": "labkit._results.pipeline",
    "plot_schedule": "labkit._results.pipeline",
}
_SUBMODULES = {"metrics", "data", "models", "checkpoint", "memory", "exercises", "syncbn", "comm"}

# Every exercise's check_<name>, found by its module's file name (labkit/_course/checks/exNN_<name>.py).
__all__ = sorted([*_LAZY, *_SUBMODULES, *_checks.check_names()])


def __getattr__(name: str):
    if name in _LAZY or name.startswith("check_") and name in _checks.check_names():
        value = getattr(importlib.import_module(_LAZY.get(name, "labkit._course.checks")), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"labkit.{name}")
    raise AttributeError(f"module 'labkit' has no attribute {name!r}")


def __dir__():
    return sorted({*__all__, *_checks.check_names()})
