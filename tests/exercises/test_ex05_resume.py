"""Exercise 05-resume: each common mistake gets the message that names it (real launches on 2 ranks, or LABKIT_RANKS,
two per check: once whole, once with a crash)."""

from __future__ import annotations

import labkit
from mistakes import Mistake, each_named_by

NOTEBOOK = "05_checkpointing.ipynb"

MISTAKES = {
    "optimizer-not-restored": Mistake(
        '    optimizer.load_state_dict(state["optimizer"])\n', "",
        "the losses leave the uninterrupted run's from step 14 on: save and restore the optimizer's "
        "state (its momentum) too",
        ("exactly the weights saved at step 12", "random stream goes on where it was")),
    "rng-not-restored": Mistake(
        "    checkpoint.set_rng_state(state[\"rng\"][rank])  # this rank's own streams\n", "",
        "save every rank's checkpoint.rng_state() and restore it with checkpoint.set_rng_state",
        ("the optimizer's momentum came back",)),
    "rank-0-rng-for-every-rank": Mistake('"rng": rngs}', '"rng": [checkpoint.rng_state()] * world_size}',
                                         "went on with rank 0's random stream, not its own"),
    "sampler-position-not-restored": Mistake(
        'step, epoch, batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]', 'step = state["step"]',
        "save epoch and batch_in_epoch, and restore both", ("random stream goes on where it was",)),
    "no-barrier": Mistake("    dist.barrier()  # no rank goes on until the file is complete\n", "",
                          "came back from save_checkpoint before the file was there", ("rank 0 alone wrote",),
                          hint=2),
    "every-rank-writes": Mistake(
        "    rngs = [None] * world_size if rank == 0 else None\n"
        "    dist.gather_object(checkpoint.rng_state(), rngs, dst=0)  # each rank has its own streams\n"
        "    if rank == 0:  # the ranks hold the same weights: one writer is enough\n",
        "    rngs = [None] * world_size\n"
        "    dist.all_gather_object(rngs, checkpoint.rng_state())\n"
        "    if True:\n",
        "wrote the checkpoint too", ("the drill's losses equal the uninterrupted run's",), hint=2),
    "not-atomic": Mistake("        checkpoint.save_atomic(state, checkpoint.step_path(args.ckpt_dir, step))\n",
                          "        os.makedirs(args.ckpt_dir, exist_ok=True)\n"
                          "        torch.save(state, checkpoint.step_path(args.ckpt_dir, step))\n",
                          "rank 0 put no file in place with checkpoint.save_atomic",
                          ("the drill's losses equal the uninterrupted run's",),
                          hint=2),
    "wrapper-state-dict-saved": Mistake('"model": model.module.state_dict()', '"model": model.state_dict()',
                                        "that is the DDP wrapper's state_dict. Save the unwrapped model"),
}


test_each_mistake_gets_the_message_that_names_it = each_named_by(labkit.check_resume, NOTEBOOK, MISTAKES)


def test_check_resume_asks_for_a_script_not_a_finished_run(workdir):
    from labkit._results.run import Run

    feedback = labkit.check_resume(Run(workdir, {"name": "earlier"}))
    assert feedback.status == "failed" and "pass the script's path" in feedback.messages("fail")[0]
