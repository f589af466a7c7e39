"""Results: a run folder read back, compared and drawn.

Owns:
    run       ``Run``: one launch's folder (metrics, throughput, output, export)
    losses    ``loss_by_step``, ``loss_by_epoch``: a run's loss, the mean over ranks, by window
              and by epoch
    compare   ``compare_losses``, ``LossComparison``: did two runs train alike?
    logged    ``logged``, ``steps_per_epoch``, ``late_loss``, ``bn_allreduces_per_step``,
              ``ddp_allreduces_per_step``, ``step_s``: what a run logged, by rank and step (02-06)
    plots     ``plot_loss``, ``plot_metric``, ``plot_speedup``, ``plot_throughput``
    elastic   ``elastic_rounds``, ``elastic_losses``, ``plot_elastic``: an elastic run, round by
              round (lesson 10)
    rounds    ``round_starts``, ``round_of``, ``what_changed``: where a run's rounds begin (a
              restart, a node that left or joined) and which round each line is in
    diff      ``diff``, ``write_variant``: a lesson's change, and its pitfall as edits
    tryload   ``try_load``: a saved state dict opened as its user will
    speed     ``data_wait_per_step``, ``scaling_report``, ...: waits, step 1, strong and weak
              scaling against both baselines (lesson 08)
    strategies ``prove_same``, ``measured_cost``, ``held_shards``, ...: a strategy's run proved
              against one process; what each rank held and sent (lessons 11, 12)
    shapes    ``Shapes``: a model's parameters as the cost arithmetic sees them (from a module,
              from MLPStack's arguments, or a bare count), without torch
    costs     ``per_rank``, ``expected_cost``: what each strategy holds and sends per rank, the one
              arithmetic of it (lessons 06, 11-13, the planner; ``labkit.comm`` and ``zero`` use
              it; standard library only)
    zero      ``zero_bytes``, ``zero_traffic``, ``zero_table``: ZeRO's table, what each stage holds
              and sends per rank (lesson 13)
    pipeline  ``schedule_order``, ``replay_schedule``, ``plot_schedule``, ...: pipeline schedules
              written out, replayed and read back from a run (lesson 12)

Imported by the kernel (the notebooks, the checks, the launcher's ``Run``). Reading a run
never imports torch (``tests/test_rundir.py``); ``tryload`` does, when it is used.
"""
