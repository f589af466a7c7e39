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
from conftest import ROOT

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
}


@pytest.mark.launch
@pytest.mark.parametrize("mistake", MISTAKES)
def test_each_mistake_gets_the_message_that_names_it(mistake, workdir):
    check, notebook, old, new, words = MISTAKES[mistake]
    (workdir / "scripts").mkdir()
    (workdir / "scripts" / "mine.py").write_text(wrong(notebook, old, new))
    feedback = check("scripts/mine.py")
    assert feedback.status == "failed", feedback
    assert any(words in text for text in feedback.messages("fail")), feedback


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


def test_a_script_not_written_yet_is_a_todo_not_a_crash(workdir):
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
    for path in sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb")):
        text = path.read_text()
        ids |= set(re.findall(r"labkit\.hint\(\\\"(\d\d-[a-z0-9-]+)\\\"", text))
    assert ids == set(HINTS), (ids, set(HINTS))
