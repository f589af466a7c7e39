"""Results: a run folder read back, compared and drawn.

Owns:
    run       ``Run``: one launch's folder (metrics, throughput, output, export)
    compare   ``loss_by_step``, ``loss_by_epoch``, ``compare_losses``: did two runs train alike?
    plots     ``plot_loss``, ``plot_metric``, ``plot_speedup``, ``plot_throughput``
    elastic   ``elastic_rounds``, ``elastic_losses``, ``plot_elastic``: an elastic run, round by
              round (lesson 09)
    diff      ``diff``, ``write_variant``: a lesson's change, and its pitfall as edits
    tryload   ``try_load``: a saved state dict opened as its user will

Imported by the kernel (the notebooks, the checks, the launcher's ``Run``). Reading a run
never imports torch (``tests/test_rundir.py``); ``tryload`` does, when it is used.
"""
