"""Exercise 06-fsdp: each common mistake gets the message that names it (real launches on 2 ranks, or LABKIT_RANKS), and
the check's byte model is what FSDP really holds."""

from __future__ import annotations

import json

import pytest

import labkit
from labkit._course.checks import ex06_fsdp
from mistakes import Mistake, each_named_by, solution_script

NOTEBOOK = "06_fsdp.ipynb"

_BLOCKS = ("for block in model.blocks:  # each block its own unit: gathered just before it runs, "
           "freed after\n    fully_shard(block)\n")
_ROOT = "fully_shard(model)  # the root last: it takes the stem and the head, and drives the step\n"

MISTAKES = {
    # The answer says that wrapping only the root keeps the bytes at rest and gathers the whole
    # model at once: this mistake checks both halves.
    "only-the-root-sharded": Mistake(
        _BLOCKS, "", "with only the root wrapped, FSDP gathers every weight when the forward pass starts",
        ("your prediction is exact on every rank", "your measurement is exact")),
    "root-not-sharded": Mistake(_ROOT, "", "call fully_shard(model) after the blocks",
                                ("each of the 4 blocks is an FSDP unit",)),
    "root-sharded-first": Mistake(_BLOCKS + _ROOT, _ROOT + _BLOCKS,
                                  "The order matters: fully_shard each block first, then the model", hint=1),
    "no-step-counter-predicted": Mistake("optimizer=2 * params + 4 * tensors", "optimizer=2 * params",
                                         "AdamW keeps a 4-byte step counter for each of the 30 parameter tensors",
                                         ("your measurement is exact",), hint=3),
    "measured-without-optimizer": Mistake("measured = memory.model_bytes(model, optimizer)",
                                          "measured = memory.model_bytes(model)",
                                          "you measured no optimizer state: pass the optimizer too",
                                          ("your prediction is exact",), hint=3),
}


test_each_mistake_gets_the_message_that_names_it = each_named_by(labkit.check_fsdp, NOTEBOOK, MISTAKES)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("rows", [1, 6, 10, 64, 257])
def test_the_checks_shard_rows_are_torch_chunks(rows, world_size):
    import torch

    chunks = [len(c) for c in torch.chunk(torch.empty(rows), world_size)]
    chunks += [0] * (world_size - len(chunks))  # torch.chunk may make fewer chunks than ranks
    assert [ex06_fsdp._shard_rows(rows, world_size, r) for r in range(world_size)] == chunks


@pytest.mark.parametrize("predicted, words", [
    ((551_208, 551_208, 1_102_536), "you predicted the whole model's 551,208 bytes"),
    ((275_604, 551_208, 551_328), "each rank keeps only its own shard's gradient"),
    ((275_604, 275_604, 551_208), "120 bytes short"),
    ((275_604, 275_604, 275_724), "AdamW keeps two moments per weight"),
    ((275_604, 275_604, 9), "two moments the size of its shard, and a 4-byte step counter"),
])
def test_a_wrong_prediction_is_named_by_its_first_wrong_number(predicted, words):
    truth = ex06_fsdp._fsdp_bytes(64, 4, 2, 0)
    assert (truth["params"], truth["optimizer"], truth["tensors"]) == (275_604, 551_328, 30)
    assert words in ex06_fsdp._misprediction(0, predicted, truth, 551_208, 2, 30)


def test_an_even_share_is_wrong_where_rows_do_not_divide():
    truth = ex06_fsdp._fsdp_bytes(64, 4, 3, 2)  # 64, 256 and 10 rows: the last rank gets fewer
    whole = ex06_fsdp._fsdp_bytes(64, 4, 1, 0)["params"]
    assert whole % 3 == 0 and truth["params"] != whole // 3
    message = ex06_fsdp._misprediction(2, (whole // 3, 0, 0), truth, whole, 3, truth["tensors"])
    assert "ceil(rows / 3) to a rank, so the last rank(s) get fewer" in message


@pytest.mark.launch
@pytest.mark.solutions
def test_check_fsdps_byte_model_is_what_fsdp_holds_where_rows_do_not_divide(workdir):
    """3 ranks: 64, 256 and 10 rows split unevenly. The check's arithmetic must match FSDP's."""
    (workdir / "scripts").mkdir()
    (workdir / "scripts" / "ex06.py").write_text(solution_script(NOTEBOOK))
    run = labkit.launch("scripts/ex06.py", nproc=3, device="cpu", timeout_s=180, quiet=True)
    held = run.metrics().dropna(subset=["measured_params"]).set_index("rank")
    for rank in range(3):
        truth = ex06_fsdp._fsdp_bytes(64, 4, 3, rank)
        assert (held.loc[rank, "measured_params"], held.loc[rank, "measured_optim"]) == (
            truth["params"], truth["optimizer"]), rank
    assert held["measured_params"].nunique() == 2, "the last rank holds fewer rows"


def _fsdp_run(folder, *, units="1111", root=True, skip_rank_1_measurement=False):
    """A finished 2-rank Run of exercise 06, written by hand with the numbers FSDP holds."""
    from labkit._results.run import Run

    (folder / "metrics").mkdir(parents=True)
    for rank in range(2):
        held = ex06_fsdp._fsdp_bytes(64, 4, 2, rank, units=units, root=root)
        lines = [{"step": 0, "dim": 64, "depth": 4, "predicted_params": 275_604,
                  "predicted_grads": 275_604, "predicted_optim": 551_328},
                 {"step": 0, "root_unit": root, "block_units": units}]
        if not (rank == 1 and skip_rank_1_measurement):
            lines.append({"step": 1, "measured_params": held["params"], "measured_grads": held["grads"],
                          "measured_optim": held["optimizer"],
                          "gathered_bytes": 152_616 if units == "1111" and root else 551_208})
        (folder / "metrics" / f"rank{rank}.jsonl").write_text("".join(
            json.dumps({"rank": rank, "world_size": 2, "restart": 0, "time": 1.0 + i, **line}) + "\n"
            for i, line in enumerate(lines)))
    return Run(folder, {"name": "by-hand", "nproc": 2, "device": "cpu"})


def test_check_fsdp_reads_a_finished_run(tmp_path):
    feedback = labkit.check_fsdp(_fsdp_run(tmp_path))
    assert feedback.passed and len(feedback.items) == 5, feedback
    assert "exactly 1/2 of the model's 551,208" in feedback.messages("ok")[3]


def test_check_fsdp_names_the_rank_that_logged_too_little(tmp_path):
    feedback = labkit.check_fsdp(_fsdp_run(tmp_path, skip_rank_1_measurement=True))
    assert feedback.messages("fail") == ["rank 1 did not log all the check reads (did the run stop early?): "
                                         "keep the skeleton's metrics.log(...) lines."]


def test_check_fsdp_says_when_nothing_is_sharded(tmp_path):
    feedback = labkit.check_fsdp(_fsdp_run(tmp_path, units="0000", root=False))
    fails = feedback.messages("fail")
    assert "no block is an FSDP unit" in fails[0] and "call fully_shard(model)" in fails[1], feedback
    assert fails[2] == "nothing is sharded: every rank holds all 551,208 bytes of weights, all the time."
    assert any("your measurement is exact: rank 0 holds 551,208" in m for m in feedback.messages("ok"))
