"""The exercises' checks, apart from any one exercise: Feedback and its stop signal, the launch
a check attempts, the registry that finds every exercise's module, and the hints.

Each exercise's wrong answers, and every test that quotes an answer, are in tests/exercises/.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest

import labkit
from labkit._course import checks as _checks
from labkit._course.attempt import attempt
from labkit._course.feedback import MIME, Feedback, _Stop, check
from conftest import ROOT
from test_launch import MISMATCH


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
                                      ["fail", "rank 2 says it is rank 0 <oops>"]],
                            "notes": [], "world_size": None}
    assert "&lt;oops&gt;" in bundle["text/html"]
    assert "✗ rank 2 says it is rank 0" in bundle["text/plain"]
    assert "labkit.hint('00-hello', 1)" in bundle["text/plain"]


def test_a_note_is_shown_but_counts_neither_way():
    feedback = Feedback("00-hello")
    feedback.ok("every rank holds the sum")
    feedback.note("this check runs on 3 ranks <always>")
    assert feedback.passed and feedback.messages() == ["every rank holds the sum"]
    bundle = feedback._repr_mimebundle_()
    assert bundle[MIME]["notes"] == ["this check runs on 3 ranks <always>"]
    assert "  note: this check runs on 3 ranks <always>" in bundle["text/plain"]
    assert "note: this check runs on 3 ranks &lt;always&gt;" in bundle["text/html"]


def test_a_check_launches_the_ranks_a_lesson_launches(monkeypatch):
    """_ranks follows LABKIT_RANKS (make test-scale: 4), at least the check's minimum."""
    from labkit import _hardware
    from labkit._course.checks._common import _ranks

    monkeypatch.setattr(_hardware, "gpu_count", lambda: 0)
    monkeypatch.delenv("LABKIT_RANKS", raising=False)
    assert _ranks(2) == {"nproc": 2, "device": "cpu"} and _ranks(3) == {"nproc": 3, "device": "cpu"}
    monkeypatch.setenv("LABKIT_RANKS", "4")
    assert _ranks(2) == {"nproc": 4, "device": "cpu"} and _ranks(5) == {"nproc": 5, "device": "cpu"}
    monkeypatch.setattr(_hardware, "gpu_count", lambda: 8)
    monkeypatch.setenv("LABKIT_SMOKE", "1")
    assert _ranks(2) == {"nproc": 4, "device": "auto"}, "smoke mode: as many GPUs as LABKIT_RANKS"
    monkeypatch.delenv("LABKIT_SMOKE")
    assert _ranks(2) == {"nproc": 8, "device": "auto"}


def test_a_check_that_holds_at_one_size_says_so_when_asked_for_another(monkeypatch):
    from labkit import _hardware
    from labkit._course.checks._common import _only_at

    monkeypatch.setattr(_hardware, "gpu_count", lambda: 0)
    monkeypatch.delenv("LABKIT_RANKS", raising=False)
    feedback = Feedback("11-tp-plan")
    assert _only_at(feedback, 2, "the plan cuts each layer in two") == {"nproc": 2, "device": "cpu"}
    assert feedback.notes == [], "the default size: nothing to say"
    monkeypatch.setenv("LABKIT_RANKS", "4")
    _only_at(feedback, 2, "the plan cuts each layer in two")
    assert feedback.notes == ["this check runs on 2 ranks, not the 4 that LABKIT_RANKS asks for: the "
                              "plan cuts each layer in two"]


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


# -- the stop signal ---------------------------------------------------------------------------
@check
def _two_phases(first_right: bool, *, stop_with: str | None = None) -> Feedback:
    feedback = Feedback("09-demo")
    feedback.require(first_right, "the first phase is right", "the first phase is wrong", hint=1)
    if stop_with is not None:
        feedback.stop(stop_with, hint=2)
    feedback.ok("the second phase ran")
    return feedback


def test_a_finding_that_ends_the_check_returns_the_findings_so_far():
    assert _two_phases(True).messages() == ["the first phase is right", "the second phase ran"]
    stopped = _two_phases(False)
    assert stopped.items == [("fail", "the first phase is wrong")] and stopped.hints == [1]
    ended = _two_phases(True, stop_with="nothing more can be judged")
    assert ended.items[-1] == ("fail", "nothing more can be judged") and ended.hints[-1] == 2
    assert "the second phase ran" not in ended.messages()


def test_stop_without_a_text_keeps_the_findings_already_made():
    @check
    def launch_failed() -> Feedback:
        feedback = Feedback("09-demo")
        feedback.todo("TODO: write this part (scripts/ex09.py, line 3)")
        feedback.stop()

    assert launch_failed().messages() == ["TODO: write this part (scripts/ex09.py, line 3)"]


def test_check_keeps_the_checks_name_signature_and_docstring():
    import inspect

    assert _two_phases.__name__ == "_two_phases"
    assert list(inspect.signature(labkit.check_ddp).parameters) == ["target", "timeout_s"]
    assert labkit.check_ddp.__doc__.startswith("Exercise 02-ddp:")


def test_a_stop_outside_a_check_is_a_clear_error_not_a_silent_exit():
    with pytest.raises(_Stop, match="stopped outside a @check function"):
        Feedback("09-demo").stop("wrong")
    assert not issubclass(_Stop, Exception), "a check's `except Exception` must not swallow it"


@pytest.mark.launch
def test_a_run_that_stopped_says_so_instead_of_counting_checks(workdir, write_script):
    write_script("mine.py", "raise RuntimeError('boom')\n")
    feedback, run = attempt("00-hello", "mine.py", nproc=1, device="cpu", timeout_s=120)
    assert run is None and feedback.stopped and feedback.status == "failed"
    assert "the run stopped before the checks could look at it" in str(feedback)
    assert "Fix what the ✗ line names first. Stuck?" in str(feedback)
    assert "labkit.hint('00-hello', 1)" in str(feedback)
    assert "checks pass" not in str(feedback)


@pytest.mark.launch
def test_a_run_that_failed_without_an_exception_is_explained_not_summarised(workdir, write_script):
    """A collective only rank 0 calls: gloo aborts rank 0 (SIGABRT). The check names the rank,
    the signal, the line it was on, its last output and what to look for, not "torchrun exited with code 1". Exactly
    two ranks: which rank gloo aborts depends on how its ring pairs them."""
    write_script("mine.py", MISMATCH.replace("SIZE", "1000"))
    feedback, run = attempt("02-ddp", "mine.py", nproc=2, device="cpu", timeout_s=120)
    assert run is None and feedback.stopped and feedback.status == "failed"
    [message] = feedback.messages("fail")
    # The line rank 0 was on when gloo aborted it: the collective only it calls (its Python
    # stack, which the rank's entry point prints on a fatal signal).
    assert message.startswith("rank 0 failed (exit code -6): killed by SIGABRT at mine.py:5 in "
                              "<module>, inside all_reduce (distributed_c10d.py); its last output: …")
    assert "Is there a distributed collective mismatch in your code?" in message
    assert ("Rank 0's output says the ranks' collectives did not match: every rank must call the same "
            "collectives in the same order") in message
    assert "torchrun exited with code" not in message


@pytest.mark.launch
def test_a_hang_names_where_each_rank_waited(workdir, write_script, ranks):
    write_script("mine.py", """
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        if dist.get_rank() == 0:
            dist.all_reduce(torch.ones(1))
        dist.barrier()
    """)
    feedback, run = attempt("02-ddp", "mine.py", nproc=ranks, device="cpu", timeout_s=20)
    assert run is None and feedback.status == "failed"
    [message] = feedback.messages("fail")
    assert message.startswith("the run did not finish within 20 s: rank 0 at mine.py:4 in <module>, "
                              "inside all_reduce")
    for rank in range(1, ranks):
        assert f"rank {rank} at mine.py:5 in <module>, inside barrier" in message
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
    ids = set()
    for path in sorted((ROOT / "exercises").glob("[0-9][0-9]_*.ipynb")):  # a hand-out has these too
        text = path.read_text()
        ids |= set(re.findall(r"labkit\.hint\(\\\"(\d\d-[a-z0-9-]+)\\\"", text))
    assert ids == set(_checks.exercises()), (ids, set(_checks.exercises()))



@pytest.mark.parametrize("name", _checks.check_names())
def test_a_bad_target_is_a_finding_not_a_crash(name, workdir):
    check = getattr(labkit, name)
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


# -- the registry: one module per exercise, found by its name ------------------------------------
_DEMO = """
    from labkit._course.feedback import Feedback, check

    EXERCISE = "99-demo"
    HINTS = ["a nudge", "all but the answer"]


    @check
    def check_demo(target="scripts/ex99_demo.py", *, timeout: float = 1) -> Feedback:
        feedback = Feedback(EXERCISE)
        feedback.stop(f"looked at {target}")
"""


@pytest.fixture
def demo_exercise(tmp_path, monkeypatch):
    """A new exercise module, ex99_demo.py, in a second folder of the _checks package."""
    (tmp_path / "ex99_demo.py").write_text(textwrap.dedent(_DEMO))
    monkeypatch.setattr(_checks, "__path__", [*_checks.__path__, str(tmp_path)])
    yield
    sys.modules.pop("labkit._course.checks.ex99_demo", None)
    vars(labkit).pop("check_demo", None)


def test_a_new_exercise_module_is_found_with_no_other_edit(demo_exercise):
    assert "check_demo" in dir(labkit) and _checks.check_names()[-1] == "check_demo"
    assert labkit.check_demo("mine.py").messages("fail") == ["looked at mine.py"]
    assert labkit.hint("99-demo", 2).text == "all but the answer"
    assert labkit.hint("99", 1).text == labkit.hint("99_demo.ipynb", 1).text == "a nudge"
    assert list(_checks.exercises())[-1] == "99-demo"


def test_two_modules_for_one_exercise_are_refused(tmp_path, monkeypatch):
    (tmp_path / "ex02_other.py").write_text("")
    monkeypatch.setattr(_checks, "__path__", [*_checks.__path__, str(tmp_path)])
    with pytest.raises(RuntimeError, match=r"ex02_ddp.py and ex02_other.py: one module per exercise"):
        _checks.check_names()


def test_a_module_whose_id_has_another_number_is_refused(tmp_path, monkeypatch):
    (tmp_path / "ex98_wrong.py").write_text('EXERCISE = "97-wrong"\nHINTS = []\n')
    monkeypatch.setattr(_checks, "__path__", [*_checks.__path__, str(tmp_path)])
    try:
        with pytest.raises(RuntimeError, match=r"ex98_wrong.py sets EXERCISE = '97-wrong': it should be '98-<id>'"):
            _checks.exercises()
    finally:
        sys.modules.pop("labkit._course.checks.ex98_wrong", None)


@pytest.mark.parametrize("which, parsed", [
    ("02", ("02", None, None)), ("2", ("02", None, None)), (2, ("02", None, None)),
    ("02-ddp", ("02", "02-ddp", None)), ("02_ddp", ("02", None, "02_ddp")),
    ("02_ddp.ipynb", ("02", None, "02_ddp")), (" 05_checkpointing ", ("05", None, "05_checkpointing")),
    ("ddp", None), ("", None), ("02 ddp", None),
])
def test_one_parser_reads_every_way_an_exercise_is_named(which, parsed):
    assert _checks.parse_exercise(which) == parsed


@pytest.mark.parametrize("folder", [pytest.param("solutions", marks=pytest.mark.solutions), "exercises"])
def test_every_exercise_notebook_has_its_check_module_and_every_module_a_notebook(folder):
    titled = {}
    for path in sorted((ROOT / folder).glob("[0-9][0-9]_*.ipynb")):
        title = "".join(json.loads(path.read_text(encoding="utf-8"))["cells"][0]["source"])
        found = re.search(r"Exercise id: `(\d\d-[a-z0-9-]+)`", title)
        assert found, f"{folder}/{path.name}: its first cell names no 'Exercise id: `NN-id`'"
        assert found[1][:2] == path.name[:2], f"{folder}/{path.name} has the id {found[1]}"
        titled[found[1]] = path.name
    assert set(titled) == set(_checks.exercises()), (
        f"ids in {folder}/ notebook titles: {sorted(titled)}; EXERCISE of the modules in labkit/_checks: "
        f"{sorted(_checks.exercises())}")


@pytest.mark.parametrize("name", _checks.check_names())
def test_every_check_wears_check_so_that_a_stop_ends_it_not_the_notebook(name):
    assert getattr(labkit, name).__code__ is check(lambda: None).__code__, (
        f"{name} is not decorated with @check (labkit._course.feedback): a finding that stops it would raise")


@pytest.mark.parametrize("exercise", list(_checks.exercises()))
def test_every_hint_a_check_points_to_exists(exercise):
    import ast
    import inspect

    module = _checks.exercises()[exercise]
    assert module.HINTS and all(isinstance(text, str) and text for text in module.HINTS), exercise
    hints = [keyword.value for node in ast.walk(ast.parse(inspect.getsource(module)))
             if isinstance(node, ast.Call) for keyword in node.keywords if keyword.arg == "hint"]
    numbers = {h.value for h in hints if isinstance(h, ast.Constant) and h.value is not None}
    assert numbers <= set(range(1, len(module.HINTS) + 1)), (exercise, sorted(numbers), len(module.HINTS))


def test_listing_the_checks_and_reading_the_hints_import_no_torch():
    """A rank imports labkit; a notebook asks for hints: neither may pay for torch or pandas."""
    code = ("import sys, labkit; names = dir(labkit); "
            "assert not [m for m in sys.modules if m.startswith('labkit._course.checks.')], 'a check was imported'; "
            "assert 'check_ddp' in names and 'check_ddp' in labkit.__all__; "
            "from labkit._course import checks; checks.exercises(); labkit.hint('02', 1); "
            "heavy = {'torch', 'pandas', 'matplotlib', 'numpy'} & set(sys.modules); "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_what_a_learner_reads_says_optimizer():
    """PyTorch's word, in every hint, check message, labkit docstring and error, and practice notebook."""
    sources = [*(ROOT / "labkit").rglob("*.py"), *(ROOT / "exercises").glob("*.ipynb"),
               *(ROOT / "solutions").glob("*.ipynb")]
    found = [f"{path.relative_to(ROOT)}:{number}" for path in sources
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if re.search(r"optimis", line, re.I)]
    assert not found, found
