"""The exercises' checks: each common mistake gets the message that names it.

A deliberately wrong solution is the solution notebook's own script with one mistake
put in (an exact text replacement: if the solution changes, the test says so). Each is
launched for real, as a learner's would be.
"""

from __future__ import annotations

import json
import re

import pytest

import labkit
from labkit._feedback import MIME, Feedback, attempt
from labkit._checks import fsdp as fsdp_check
from conftest import ROOT
from test_launch import MISMATCH

WRITEFILE = re.compile(r"^%%writefile\s+(\S+)\s*\n")


def solution_script(notebook: str) -> str:
    """The text of the script that solutions/<notebook> writes."""
    for cell in json.loads((ROOT / "solutions" / notebook).read_text())["cells"]:
        source = "".join(cell["source"])
        match = WRITEFILE.match(source)
        if cell["cell_type"] == "code" and match:
            return source[match.end():]
    raise AssertionError(f"solutions/{notebook} writes no script")


def wrong(notebook: str, old: str, new: str) -> str:
    text = solution_script(notebook)
    assert text.count(old) == 1, f"solutions/{notebook} no longer holds {old!r} exactly once"
    return text.replace(old, new)


# (check, solution notebook, text in the solution, the mistake, words the message must hold)
MISTAKES = {
    "00-no-all-reduce": (labkit.check_hello, "00_setup.ipynb",
                         "dist.all_reduce(value)\n", "",
                         "each rank's sum is its own rank number"),
    "00-max-instead-of-sum": (labkit.check_hello, "00_setup.ipynb",
                              "dist.all_reduce(value)", "dist.all_reduce(value, op=dist.ReduceOp.MAX)",
                              "not the sum"),
    "00-world-size-from-gpus": (labkit.check_hello, "00_setup.ipynb",
                                'world_size = int(os.environ["WORLD_SIZE"])',
                                "world_size = max(1, torch.cuda.device_count())",
                                "read WORLD_SIZE"),
    "01-one-rate-for-all": (labkit.check_training_loop, "01_single_device.ipynb",
                            "lr = args.lrs[rank]", "lr = args.lrs[0]", "pick args.lrs[rank]"),
    "01-no-zero-grad": (labkit.check_training_loop, "01_single_device.ipynb",
                        "        optimizer.zero_grad(set_to_none=True)\n", "",
                        "clear the old gradients"),
    "01-no-eval-mode": (labkit.check_training_loop, "01_single_device.ipynb",
                        "    model.eval()\n", "", "call model.eval() before"),
    "01-no-train-mode-after": (labkit.check_training_loop, "01_single_device.ipynb",
                               "    model.train()\n", "", "call model.train() after"),
    "01-winner-not-gathered": (labkit.check_training_loop, "01_single_device.ipynb",
                               "best_accuracy, best_lr = max(results)",
                               "best_accuracy, best_lr = accuracy, lr", "dist.all_gather_object"),
    "02-no-sampler-in-loader": (labkit.check_ddp, "02_ddp.ipynb",
                                "batch_size=args.batch_size, sampler=sampler, drop_last=True",
                                "batch_size=args.batch_size, shuffle=True, drop_last=True",
                                "rank 1 saw the same samples as rank 0: is the DistributedSampler in place"),
    "02-no-set-epoch": (labkit.check_ddp, "02_ddp.ipynb",
                        "    sampler.set_epoch(epoch)\n", "    pass\n", "sampler.set_epoch(epoch)"),
    "02-no-ddp-wrap": (labkit.check_ddp, "02_ddp.ipynb",
                       'model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)\n',
                       "", "wrap the model in DistributedDataParallel"),
    "02-accuracy-not-reduced": (labkit.check_ddp, "02_ddp.ipynb",
                                "    dist.all_reduce(counts)\n", "    pass\n",
                                "dist.all_reduce the counts"),
    "02-every-rank-prints": (labkit.check_ddp, "02_ddp.ipynb",
                             "    if rank == 0:\n", "    if True:\n", "print only where rank == 0"),
    "02-sampler-not-shuffled": (labkit.check_ddp, "02_ddp.ipynb",
                                "rank=rank, shuffle=True,", "rank=rank, shuffle=False,",
                                "keep the sampler's shuffle=True"),
    "02-no-destroy": (labkit.check_ddp, "02_ddp.ipynb",
                      "dist.destroy_process_group()\n", "", "never calls dist.destroy_process_group()"),
    "02-gpu-device-ids-on-cpu": (labkit.check_ddp, "02_ddp.ipynb",
                                 'device_ids=[local_rank] if device.type == "cuda" else None',
                                 "device_ids=[local_rank]", "DDP takes device_ids=None"),
}

# The hint that a check's closing line points to, for some mistakes: the one about that mistake.
HINT_FOR = {"00-no-all-reduce": 3, "01-no-eval-mode": 2, "02-no-sampler-in-loader": 2,
            "02-no-set-epoch": 2, "02-no-ddp-wrap": 3, "02-no-destroy": 3, "04-no-no-sync": 2,
            "06-root-sharded-first": 1, "06-measured-without-optimizer": 3}


@pytest.mark.launch
@pytest.mark.solutions
@pytest.mark.parametrize("mistake", MISTAKES)
def test_each_mistake_gets_the_message_that_names_it(mistake, workdir):
    check, notebook, old, new, words = MISTAKES[mistake]
    (workdir / "scripts").mkdir()
    (workdir / "scripts" / "mine.py").write_text(wrong(notebook, old, new))
    feedback = check("scripts/mine.py")
    assert feedback.status == "failed", feedback
    assert any(words in text for text in feedback.messages("fail")), feedback
    if mistake in HINT_FOR:
        assert f"labkit.hint({feedback.exercise!r}, {HINT_FOR[mistake]}) is about the first thing to fix" in str(feedback)


# -- Feedback and attempt, without launching ---------------------------------------------------
def test_feedback_status_follows_its_findings():
    feedback = Feedback("02-ddp")
    assert feedback.status == "unfinished", "no finding yet is not a pass"
    feedback.ok("the sampler is in place")
    assert feedback.passed
    feedback.todo("TODO: wrap the model")
    assert feedback.status == "unfinished"
    feedback.expect(False, "right", "the ranks ended with different weights")
    assert feedback.status == "failed" and feedback.messages("fail") == ["the ranks ended with different weights"]


def test_feedback_shows_text_html_and_a_machine_readable_part():
    feedback = Feedback("00-hello")
    feedback.ok("every rank holds the sum")
    feedback.fail("rank 2 says it is rank 0 <oops>")
    bundle = feedback._repr_mimebundle_()
    assert bundle[MIME] == {"exercise": "00-hello", "status": "failed",
                            "items": [["ok", "every rank holds the sum"],
                                      ["fail", "rank 2 says it is rank 0 <oops>"]]}
    assert "&lt;oops&gt;" in bundle["text/html"]
    assert "✗ rank 2 says it is rank 0" in bundle["text/plain"]
    assert "labkit.hint('00-hello', 1)" in bundle["text/plain"]


def test_the_hint_line_points_to_the_hint_about_the_first_thing_wrong():
    feedback = Feedback("02-ddp")
    feedback.ok("the sampler is in place", hint=2)
    feedback.fail("the ranks ended with different weights", hint=3)
    feedback.fail("something without a hint")
    assert "labkit.hint('02-ddp', 3) is about the first thing to fix" in str(feedback)
    assert "labkit.hint(&#x27;02-ddp&#x27;, 3)" in feedback._repr_html_()
    unsure = Feedback("02-ddp")
    unsure.fail("something without a hint")
    assert "labkit.hint('02-ddp', 1) gives a first hint" in str(unsure)


@pytest.mark.launch
def test_a_run_that_stopped_says_so_instead_of_counting_checks(workdir, write_script):
    write_script("mine.py", "raise RuntimeError('boom')\n")
    feedback, run = attempt("00-hello", "mine.py", nproc=1, device="cpu", timeout=120)
    assert run is None and feedback.stopped and feedback.status == "failed"
    assert "the run stopped before the checks could look at it" in str(feedback)
    assert "Fix what the ✗ line names first. Stuck?" in str(feedback)
    assert "labkit.hint('00-hello', 1)" in str(feedback)
    assert "checks pass" not in str(feedback)


@pytest.mark.launch
def test_a_run_that_failed_without_an_exception_is_explained_not_summarised(workdir, write_script):
    """A collective only rank 0 calls: gloo aborts rank 0 (SIGABRT). The check names the rank,
    the signal, its last output and what to look for, not "torchrun exited with code 1"."""
    write_script("mine.py", MISMATCH.replace("SIZE", "1000"))
    feedback, run = attempt("02-ddp", "mine.py", nproc=2, device="cpu", timeout=120)
    assert run is None and feedback.stopped and feedback.status == "failed"
    [message] = feedback.messages("fail")
    assert message.startswith("rank 0 failed (exit code -6): killed by SIGABRT; its last output: …")
    assert "Is there a distributed collective mismatch in your code?" in message
    assert ("Rank 0's output says the ranks' collectives did not match: every rank must call the same "
            "collectives in the same order") in message
    assert "torchrun exited with code" not in message


@pytest.mark.launch
def test_a_hang_names_where_each_rank_waited(workdir, write_script):
    write_script("mine.py", """
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        if dist.get_rank() == 0:
            dist.all_reduce(torch.ones(1))
        dist.barrier()
    """)
    feedback, run = attempt("02-ddp", "mine.py", nproc=2, device="cpu", timeout=20)
    assert run is None and feedback.status == "failed"
    [message] = feedback.messages("fail")
    assert message.startswith("the run did not finish within 20 s: rank 0 at mine.py:4 in <module>, "
                              "inside all_reduce")
    assert "rank 1 at mine.py:5 in <module>, inside barrier" in message
    assert "The ranks wait in different places" in message and "`if rank == 0:`" in message


def test_a_missing_scripts_folder_is_named(workdir):
    feedback, run = attempt("02-ddp", "scripts/ex02_ddp.py")
    assert run is None and feedback.status == "failed"
    assert "there is no folder 'scripts'" in feedback.messages("fail")[0]


def test_a_script_not_written_yet_is_a_todo_not_a_crash(workdir):
    (workdir / "scripts").mkdir()
    feedback, run = attempt("00-hello", "scripts/ex00_hello.py")
    assert run is None and feedback.status == "unfinished"
    assert "run the %%writefile cell above first" in feedback.messages("todo")[0]


def test_a_syntax_error_is_reported_with_its_line(workdir, write_script):
    write_script("mine.py", "x = (\n")
    feedback, run = attempt("00-hello", "mine.py")
    assert run is None and feedback.status == "failed"
    assert "mine.py, line 1" in feedback.messages("fail")[0]


# -- hints -----------------------------------------------------------------------------------
def test_hints_come_in_order_and_say_what_is_next():
    first = labkit.hint("02-ddp", 1)
    assert first.number == 1 and "labkit.hint('02-ddp', 2)" in str(first)
    last = labkit.hint("02-ddp", first.total)
    assert "the last one" in str(last)


@pytest.mark.parametrize("name", ["02-ddp", "02", "2", 2, "02_ddp", "02_ddp.ipynb"])
def test_a_hint_takes_the_exercise_as_make_restore_does(name):
    assert labkit.hint(name, 2).exercise == "02-ddp"


@pytest.mark.parametrize("exercise, number, match", [
    ("99-nope", 1, r"no exercise '99-nope'; the exercises are: .*02-ddp"),
    ("02-ddp", 0, r"02-ddp has hints 1 to \d, not 0"),
    ("02-ddp", 99, r"02-ddp has hints 1 to \d, not 99"),
])
def test_a_bad_hint_request_is_a_clear_error(exercise, number, match):
    with pytest.raises(ValueError, match=match):
        labkit.hint(exercise, number)


def test_every_exercise_has_hints_and_every_hint_is_used():
    from labkit._hints import HINTS
    ids = set()
    for path in sorted((ROOT / "exercises").glob("[0-9][0-9]_*.ipynb")):  # a hand-out has these too
        text = path.read_text()
        ids |= set(re.findall(r"labkit\.hint\(\\\"(\d\d-[a-z0-9-]+)\\\"", text))
    assert ids == set(HINTS), (ids, set(HINTS))


# -- exercises 03 to 06 ---------------------------------------------------------------------------

_BLOCKS_06 = ("for block in model.blocks:  # each block its own unit: gathered just before it runs, "
              "freed after\n    fully_shard(block)\n")
_ROOT_06 = "fully_shard(model)  # the root last: it takes the stem and the head, and drives the step\n"

_SUMS_03 = "total = AllReduceSum.apply(local)"
_RUNNING_03 = ("            self.running_mean.lerp_(mean, self.momentum)\n"
               "            self.running_var.lerp_(var * n / (n - 1), self.momentum)  # unbiased: what BatchNorm keeps\n")
_MICRO_04 = "with nullcontext() if last else model.no_sync():"
_OUTPUTS_03 = "every rank's outputs equal nn.BatchNorm2d's"
_GRADIENT_04 = "the gradient of every optimizer step, on every rank, is that of one batch"
# (check, solution notebook, text in the solution, the mistake, words a ✗ must hold,
#  words that ✓ findings must still hold: the check blames the mistake, not what is right)
MISTAKES_03_04 = {
    "03-local-statistics": (
        labkit.check_syncbn, "03_syncbn.ipynb", _SUMS_03, "total = local",
        "each rank normalised its slice with its own mean and variance", []),
    "03-all-reduce-autograd-cannot-see": (
        labkit.check_syncbn, "03_syncbn.ipynb", _SUMS_03,
        "dist.all_reduce(local)  # in place: autograd never sees it\n        total = local",
        "the gradient does not travel back through the all-reduce", [_OUTPUTS_03, "running_mean and running_var"]),
    "03-backward-not-summed": (
        labkit.check_syncbn, "03_syncbn.ipynb", "        dist.all_reduce(grad, op=dist.ReduceOp.SUM)\n", "",
        "AllReduceSum.backward must all-reduce grad_output too", [_OUTPUTS_03]),
    "03-means-averaged-not-weighted": (
        labkit.check_syncbn, "03_syncbn.ipynb",
        "local = torch.cat([x.sum(dims), (x * x).sum(dims), count])",
        "local = torch.cat([x.mean(dims), (x * x).mean(dims), torch.ones_like(count)])",
        "you took the mean as the plain average of the ranks' means", []),
    "03-biased-running-var": (
        labkit.check_syncbn, "03_syncbn.ipynb",
        "self.running_var.lerp_(var * n / (n - 1), self.momentum)", "self.running_var.lerp_(var, self.momentum)",
        "running_var holds the biased variance", [_OUTPUTS_03, "so are the input gradients"]),
    "03-no-running-update": (
        labkit.check_syncbn, "03_syncbn.ipynb", _RUNNING_03, "",
        "running_mean and running_var never changed", [_OUTPUTS_03]),
    "04-loss-not-scaled": (
        labkit.check_accumulation, "04_accumulation.ipynb",
        "loss = F.cross_entropy(model(x), y) / k", "loss = F.cross_entropy(model(x), y)",
        "the gradient is 4× too large", ["DDP all-reduced every gradient once per optimizer step"]),
    "04-no-no-sync": (
        labkit.check_accumulation, "04_accumulation.ipynb", _MICRO_04, "with nullcontext():",
        "Correct but wasteful", [_GRADIENT_04]),
    "04-no-sync-on-the-last-micro-step-too": (
        labkit.check_accumulation, "04_accumulation.ipynb", _MICRO_04, "with model.no_sync():",
        "DDP never all-reduced a gradient", ["optimizer.step() ran once per optimizer step"]),
    "04-step-every-micro-step": (
        labkit.check_accumulation, "04_accumulation.ipynb",
        "            loss.backward()  # adds into .grad\n    optimizer.step()\n",
        "            loss.backward()  # adds into .grad\n        optimizer.step()\n",
        "optimizer.step() ran 4 times per optimizer step", []),
    "04-zero-grad-inside-the-loop": (
        labkit.check_accumulation, "04_accumulation.ipynb",
        "        last = i == k - 1\n", "        last = i == k - 1\n        optimizer.zero_grad(set_to_none=True)\n",
        "zero_grad inside the micro-step loop clears what the earlier micro-steps added",
        ["optimizer.step() ran once per optimizer step"]),
    "04-gradients-never-cleared": (
        labkit.check_accumulation, "04_accumulation.ipynb",
        "    optimizer.zero_grad(set_to_none=True)  # the next optimizer step starts from nothing\n", "",
        "the first optimizer step is right, but from step 2 on the gradient still holds the previous step's", []),
}

MISTAKES_05_06 = {
    "05-optimizer-not-restored": (
        labkit.check_resume, "05_checkpointing.ipynb",
        '    optimizer.load_state_dict(state["optimizer"])\n', "",
        "the losses leave the uninterrupted run's from step 14 on: save and restore the optimizer's "
        "state (its momentum) too",
        ["exactly the weights saved at step 12", "random stream goes on where it was"]),
    "05-rng-not-restored": (
        labkit.check_resume, "05_checkpointing.ipynb",
        "    checkpoint.set_rng_state(state[\"rng\"][rank])  # this rank's own streams\n", "",
        "save every rank's checkpoint.rng_state() and restore it with checkpoint.set_rng_state",
        ["the optimizer's momentum came back"]),
    "05-rank-0-rng-for-every-rank": (
        labkit.check_resume, "05_checkpointing.ipynb",
        '"rng": rngs}', '"rng": [checkpoint.rng_state()] * world_size}',
        "went on with rank 0's random stream, not its own", []),
    "05-sampler-position-not-restored": (
        labkit.check_resume, "05_checkpointing.ipynb",
        'step, epoch, batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]',
        'step = state["step"]',
        "save epoch and batch_in_epoch, and restore both", ["random stream goes on where it was"]),
    "05-wrapper-state-dict-saved": (
        labkit.check_resume, "05_checkpointing.ipynb",
        '"model": model.module.state_dict()', '"model": model.state_dict()',
        "that is the DDP wrapper's state_dict. Save the unwrapped model", []),
    # Exercise 06's answer says that wrapping only the root keeps the bytes at rest and gathers
    # the whole model at once: this mistake checks both halves.
    "06-only-the-root-sharded": (
        labkit.check_fsdp, "06_fsdp.ipynb", _BLOCKS_06, "",
        "with only the root wrapped, FSDP gathers every weight when the forward pass starts",
        ["your prediction is exact on every rank", "your measurement is exact"]),
    "06-root-not-sharded": (
        labkit.check_fsdp, "06_fsdp.ipynb", _ROOT_06, "",
        "call fully_shard(model) after the blocks", ["each of the 4 blocks is an FSDP unit"]),
    "06-root-sharded-first": (
        labkit.check_fsdp, "06_fsdp.ipynb", _BLOCKS_06 + _ROOT_06, _ROOT_06 + _BLOCKS_06,
        "The order matters: fully_shard each block first, then the model", []),
    "06-no-step-counter-predicted": (
        labkit.check_fsdp, "06_fsdp.ipynb",
        "optimizer=2 * params + 4 * tensors", "optimizer=2 * params",
        "AdamW keeps a 4-byte step counter for each of the 30 parameter tensors",
        ["your measurement is exact"]),
    "06-measured-without-optimizer": (
        labkit.check_fsdp, "06_fsdp.ipynb",
        "measured = memory.model_bytes(model, optimizer)", "measured = memory.model_bytes(model)",
        "you measured no optimizer state: pass the optimizer too", ["your prediction is exact"]),
}


MISTAKES_03_06 = {**MISTAKES_03_04, **MISTAKES_05_06}


@pytest.mark.launch
@pytest.mark.solutions
@pytest.mark.parametrize("mistake", MISTAKES_03_06)
def test_each_03_to_06_mistake_gets_the_message_that_names_it(mistake, workdir):
    check, notebook, old, new, words, still_right = MISTAKES_03_06[mistake]
    (workdir / "scripts").mkdir()
    (workdir / "scripts" / "mine.py").write_text(wrong(notebook, old, new))
    feedback = check("scripts/mine.py")
    assert feedback.status == "failed", feedback
    assert any(words in text for text in feedback.messages("fail")), feedback
    if mistake in HINT_FOR:
        assert f"labkit.hint({feedback.exercise!r}, {HINT_FOR[mistake]}) is about the first thing to fix" in str(feedback)
    for right in still_right:
        assert any(right in text for text in feedback.messages("ok")), (right, str(feedback))


@pytest.mark.parametrize("check", [labkit.check_syncbn, labkit.check_accumulation, labkit.check_resume,
                                   labkit.check_fsdp])
def test_a_bad_target_is_a_finding_not_a_crash(check, workdir):
    (workdir / "scripts").mkdir()
    missing = check("scripts/nope.py")
    assert missing.status == "unfinished"
    assert "run the %%writefile cell above first" in missing.messages("todo")[0]
    folder = check("scripts")
    assert folder.status == "failed" and "is a folder" in folder.messages("fail")[0]
    number = check(42)
    assert number.status == "failed" and "not int 42" in number.messages("fail")[0]
    (workdir / "ex.ipynb").write_text(json.dumps({"cells": [
        {"cell_type": "code", "source": "%%writefile scripts/ex_mine.py\nprint('hi')\n"}]}))
    notebook = check("ex.ipynb")
    assert notebook.status == "failed" and notebook.messages("fail")[0] == (
        "ex.ipynb is not a Python script: pass the path of the .py file that the %%writefile cell "
        "wrote, e.g. scripts/ex_mine.py.")


def test_check_resume_asks_for_a_script_not_a_finished_run(workdir):
    from labkit._run import Run

    feedback = labkit.check_resume(Run(workdir, {"name": "earlier"}))
    assert feedback.status == "failed" and "pass the script's path" in feedback.messages("fail")[0]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("rows", [1, 6, 10, 64, 257])
def test_the_checks_shard_rows_are_torch_chunks(rows, world_size):
    import torch

    chunks = [len(c) for c in torch.chunk(torch.empty(rows), world_size)]
    chunks += [0] * (world_size - len(chunks))  # torch.chunk may make fewer chunks than ranks
    assert [fsdp_check._shard_rows(rows, world_size, r) for r in range(world_size)] == chunks


@pytest.mark.parametrize("predicted, words", [
    ((551_208, 551_208, 1_102_536), "you predicted the whole model's 551,208 bytes"),
    ((275_604, 551_208, 551_328), "each rank keeps only its own shard's gradient"),
    ((275_604, 275_604, 551_208), "120 bytes short"),
    ((275_604, 275_604, 275_724), "AdamW keeps two moments per weight"),
    ((275_604, 275_604, 9), "two moments the size of its shard, and a 4-byte step counter"),
])
def test_a_wrong_prediction_is_named_by_its_first_wrong_number(predicted, words):
    truth = fsdp_check._fsdp_bytes(64, 4, 2, 0)
    assert (truth["params"], truth["optimizer"], truth["tensors"]) == (275_604, 551_328, 30)
    assert words in fsdp_check._misprediction(0, predicted, truth, 551_208, 2, 30)


def test_an_even_share_is_wrong_where_rows_do_not_divide():
    truth = fsdp_check._fsdp_bytes(64, 4, 3, 2)  # 64, 256 and 10 rows: the last rank gets fewer
    whole = fsdp_check._fsdp_bytes(64, 4, 1, 0)["params"]
    assert whole % 3 == 0 and truth["params"] != whole // 3
    message = fsdp_check._misprediction(2, (whole // 3, 0, 0), truth, whole, 3, truth["tensors"])
    assert "ceil(rows / 3) to a rank, so the last rank(s) get fewer" in message


@pytest.mark.launch
@pytest.mark.solutions
def test_check_fsdps_byte_model_is_what_fsdp_holds_where_rows_do_not_divide(workdir):
    """3 ranks: 64, 256 and 10 rows split unevenly. The check's arithmetic must match FSDP's."""
    (workdir / "scripts").mkdir()
    (workdir / "scripts" / "ex06.py").write_text(solution_script("06_fsdp.ipynb"))
    run = labkit.launch("scripts/ex06.py", nproc=3, device="cpu", timeout=180, quiet=True)
    held = run.metrics().dropna(subset=["measured_params"]).set_index("rank")
    for rank in range(3):
        truth = fsdp_check._fsdp_bytes(64, 4, 3, rank)
        assert (held.loc[rank, "measured_params"], held.loc[rank, "measured_optim"]) == (
            truth["params"], truth["optimizer"]), rank
    assert held["measured_params"].nunique() == 2, "the last rank holds fewer rows"


def _fsdp_run(folder, *, units="1111", root=True, skip_rank_1_measurement=False):
    """A finished 2-rank Run of exercise 06, written by hand with the numbers FSDP holds."""
    import json as _json

    from labkit._run import Run

    (folder / "metrics").mkdir(parents=True)
    for rank in range(2):
        held = fsdp_check._fsdp_bytes(64, 4, 2, rank, units=units, root=root)
        lines = [{"step": 0, "dim": 64, "depth": 4, "predicted_params": 275_604,
                  "predicted_grads": 275_604, "predicted_optim": 551_328},
                 {"step": 0, "root_unit": root, "block_units": units}]
        if not (rank == 1 and skip_rank_1_measurement):
            lines.append({"step": 1, "measured_params": held["params"], "measured_grads": held["grads"],
                          "measured_optim": held["optimizer"],
                          "gathered_bytes": 152_616 if units == "1111" and root else 551_208})
        (folder / "metrics" / f"rank{rank}.jsonl").write_text("".join(
            _json.dumps({"rank": rank, "world_size": 2, "restart": 0, "time": 1.0 + i, **line}) + "\n"
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
