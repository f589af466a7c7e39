"""labkit.launch: checks at the door, and real gloo launches.

A launch test whose claim holds at any world size takes the ``ranks`` fixture (2, or
``--ranks N``; ``make test-scale`` runs them at 3, where an odd size finds what assumes 2). One
about exactly two ranks keeps its 2 and says why.
"""

from __future__ import annotations

import inspect
import json
import platform
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import labkit
from labkit import LaunchError, LaunchTimeout, ScriptError, _hardware
from labkit._rank import proc as _proc
from labkit._launch.plan import _written_scripts, plan
from conftest import python

HELLO = """
    import torch, torch.distributed as dist
    from labkit import metrics
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    for step in range(3):
        metrics.log(step, loss=1.0 / (step + 1), samples=4)
    print(f"hello from rank {rank}, sum {t.item():.0f}")
    dist.destroy_process_group()
"""

SLEEPER = """
    import time, torch.distributed as dist
    dist.init_process_group("gloo")
    print("ready", flush=True)
    time.sleep(120)
"""


# Rank 0 calls one all-reduce more than rank 1, so their collectives pair up wrongly.
# Sizes that differ: gloo aborts rank 0 (SIGABRT, "Is there a distributed collective
# mismatch"); sizes that match: rank 1 finishes and rank 0 waits for it, then loses it.
MISMATCH = """
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 0:
        dist.all_reduce(torch.ones(4))
    for step in range(3):
        dist.all_reduce(torch.ones(SIZE))
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()
"""


def no_run_started(workdir: Path) -> bool:
    runs = workdir / "runs"
    return not runs.exists() or not any(runs.iterdir())


# -- what a launch prints for the learner to type ------------------------------------
def test_the_command_to_type_yourself_keeps_elastic_nodes_and_restarts(write_script):
    """Each launch prints what a learner would type for it. An elastic launch's line keeps its
    MIN:MAX nodes and its --max-restarts (lesson 10's printed --nnodes=2 and no restarts: a job
    that dies with its first node); a launch that may restart says so on one machine too."""
    from labkit._launch.command import terminal_command

    write_script("train.py", "print('hi')")
    one = plan("train.py", nproc=2, device="cpu", args=["--epochs", "1"])
    assert terminal_command(one) == "torchrun --standalone --nproc-per-node=2 train.py --epochs 1"
    again = plan("train.py", nproc=2, device="cpu", max_restarts=2)
    assert terminal_command(again) == "torchrun --standalone --nproc-per-node=2 --max-restarts=2 train.py"
    fixed = plan("train.py", nproc=1, device="cpu", nnodes=2)
    assert terminal_command(fixed).startswith("torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d ")
    elastic = plan("train.py", nproc=1, device="cpu", nnodes=2, min_nodes=1, max_restarts=3, args=["--x", "a b"])
    assert terminal_command(elastic) == (
        "torchrun --nnodes=1:2 --nproc-per-node=1 --max-restarts=3 --rdzv-backend=c10d "
        "--rdzv-endpoint=<first node>:29500 --rdzv-id=<job id> train.py --x 'a b'")


# -- bad input: a clear error, and nothing launched ----------------------------------
def test_missing_script(workdir):
    with pytest.raises(FileNotFoundError, match=r"'nope.py' does not exist.*HINT: paths are relative"):
        labkit.launch("nope.py")
    assert no_run_started(workdir)


def test_script_that_is_a_folder(workdir):
    (workdir / "scripts").mkdir()
    with pytest.raises(FileNotFoundError, match="is a folder, not a file"):
        labkit.launch("scripts")


def test_syntax_error_is_the_scripts_error_with_its_line(workdir, write_script):
    write_script("broken.py", "import os\nx = (\n")
    with pytest.raises(ScriptError, match=r"broken.py, line 2: '\(' was never closed"):
        labkit.launch("broken.py")
    assert no_run_started(workdir)


@pytest.mark.parametrize("nproc, error, match", [
    (0, ValueError, "nproc must be >= 1, got 0"),
    (-2, ValueError, "nproc must be >= 1, got -2"),
    (1.5, TypeError, "nproc must be an int"),
    (True, TypeError, "nproc must be an int"),
])
def test_bad_nproc(workdir, write_script, nproc, error, match):
    write_script("ok.py", "print('hi')\n")
    with pytest.raises(error, match=match):
        labkit.launch("ok.py", nproc=nproc)
    assert no_run_started(workdir)


def test_nproc_above_the_gpus(workdir, write_script, monkeypatch):
    write_script("ok.py", "print('hi')\n")
    monkeypatch.setattr(_hardware, "gpu_count", lambda: 2)
    with pytest.raises(ValueError, match=r"nproc=3 but only 2 GPU\(s\) are visible.*HINT: nproc=2"):
        labkit.launch("ok.py", nproc=3)
    assert no_run_started(workdir)


def test_unknown_device(workdir, write_script):
    write_script("ok.py", "print('hi')\n")
    with pytest.raises(ValueError, match=r"device must be one of \('auto', 'cpu'\), got 'gpu'"):
        labkit.launch("ok.py", device="gpu")


def test_unknown_option(workdir, write_script):
    write_script("ok.py", "print('hi')\n")
    with pytest.raises(TypeError, match="unexpected keyword argument 'nproc_per_node'"):
        labkit.launch("ok.py", nproc_per_node=2)


def test_nproc_and_nprocs_mixed_up_say_which_function_takes_which(workdir, write_script):
    """One spelling, nproc: an int for launch, a list of world sizes for sweep."""
    write_script("ok.py", "print('hi')\n")
    with pytest.raises(TypeError, match=r"launch\(\) takes nproc=<int> \(one launch\); for several "
                                        r"world sizes use labkit.sweep\(script, nproc=\[1, 2"):
        labkit.launch("ok.py", nprocs=[1, 2])
    with pytest.raises(TypeError, match=r"sweep\(\) got an unexpected keyword argument 'nprocs': did "
                                        r"you mean nproc=\?"):
        labkit.sweep("ok.py", nprocs=[1, 2])
    with pytest.raises(TypeError, match=r"sweep's nproc must be a list of ints.*HINT: for one run use "
                                        r"labkit.launch\(script, nproc=2\)"):
        labkit.sweep("ok.py", nproc=2)
    assert no_run_started(workdir)
    # the public signatures still show the real parameters
    assert "nproc" in inspect.signature(labkit.launch).parameters
    assert "nproc" in inspect.signature(labkit.sweep).parameters


@pytest.mark.parametrize("call, old, new", [
    (lambda **kw: labkit.launch("ok.py", **kw), "timeout", "timeout_s"),
    (lambda **kw: labkit.launch("ok.py", **kw), "hang_timeout", "hang_timeout_s"),
    (lambda **kw: labkit.sweep("ok.py", nproc=[1], **kw), "timeout", "timeout_s"),
    (lambda **kw: labkit.sbatch("ok.sbatch", **kw), "timeout", "timeout_s"),
    (lambda **kw: labkit.slurm_status(**kw), "timeout", "timeout_s"),
    (lambda **kw: labkit.check_ddp("ok.py", **kw), "timeout", "timeout_s"),
])
def test_a_renamed_keyword_says_its_new_name(workdir, write_script, call, old, new):
    """Every time argument ends in _s: an old name gets a did-you-mean, before anything runs."""
    write_script("ok.py", "print('hi')\n")
    with pytest.raises(TypeError, match=rf"unexpected keyword argument '{old}': did you mean {new}=\?"):
        call(**{old: 60})
    assert no_run_started(workdir)


def test_a_notebook_is_not_a_script(workdir):
    (workdir / "00_setup.ipynb").write_text(json.dumps({"cells": [
        {"cell_type": "markdown", "source": ["# 00"]},
        {"cell_type": "code", "source": ["%%writefile scripts/00_hello.py\n", "print('hi')\n"]},
    ]}))
    with pytest.raises(ValueError, match=r"00_setup.ipynb is a notebook, not a script.*HINT: launch "
                                         r"the script its %%writefile cell writes, e.g. scripts/00_hello.py"):
        labkit.launch("00_setup.ipynb")
    (workdir / "02_ddp.ipynb").write_text(json.dumps({"cells": [   # a script told in steps
        {"cell_type": "code", "source": ["%%writefile scripts/02_ddp.py\n", "import os\n"]},
        {"cell_type": "markdown", "source": ["Next, the process group."]},
        {"cell_type": "code", "source": ["%%writefile -a scripts/02_ddp.py\n", "print('hi')\n"]},
        {"cell_type": "code", "source": ["%%writefile --append scripts/02_ddp.py\n", "pass\n"]},
        {"cell_type": "code", "source": ["%%writefile scripts/02_pitfall.py\n", "pass\n"]},
    ]}))
    assert _written_scripts(Path("02_ddp.ipynb")) == ["scripts/02_ddp.py", "scripts/02_pitfall.py"]
    (workdir / "notes.txt").write_text("print('hi')\n")
    with pytest.raises(ValueError, match=r"notes.txt is not a Python script \(.py\)"):
        labkit.launch("notes.txt")
    assert no_run_started(workdir)


def test_a_script_with_null_bytes_is_not_python_source(workdir):
    (workdir / "utf16.py").write_bytes("print('hi')\n".encode("utf-16"))
    with pytest.raises(ScriptError, match=r"utf16.py is not Python source: it contains null bytes") as info:
        labkit.launch("utf16.py")
    assert "line None" not in str(info.value)
    assert no_run_started(workdir)


def test_far_more_cpu_ranks_than_cores_is_refused(workdir, write_script, monkeypatch):
    write_script("ok.py", "print('hi')\n")
    monkeypatch.setattr(_hardware, "cpu_count", lambda: 2)
    with pytest.raises(ValueError, match=r"nproc=64 CPU ranks on 2 core\(s\) is too many: labkit "
                                         r"launches at most 4 CPU ranks per core \(8 here\).*HINT: nproc=2"):
        labkit.launch("ok.py", nproc=64, device="cpu")
    with pytest.raises(ValueError, match="nproc=9 CPU ranks"):
        labkit.sweep("ok.py", nproc=[1, 9], device="cpu")
    assert no_run_started(workdir)
    assert plan("ok.py", nproc=8, device="cpu").nproc == 8  # milder oversubscription: a note only


@pytest.mark.parametrize("kwargs, match", [
    ({"args": "--epochs 2"}, "args must be a list of strings"),
    ({"args": [["--epochs"]]}, "args must hold strings"),
    ({"timeout_s": 0}, "timeout_s must be a positive number"),
    ({"timeout_s": "10"}, "timeout_s must be a positive number"),
    ({"timeout_s": float("nan")}, "timeout_s must be a positive number of seconds or None, got nan"),
    ({"timeout_s": -5}, "timeout_s must be a positive number"),
    ({"timeout_s": float("inf")}, r"got inf. HINT: timeout_s=None means no limit"),
    ({"max_restarts": -1}, "max_restarts must be >= 0"),
    ({"threads_per_rank": 0}, "threads_per_rank must be >= 1"),
    ({"name": "  "}, "name must be a non-empty string"),
    ({"env": ["A=1"]}, "env must be a dict"),
    ({"env": {"NCCL_DEBUG": None}}, r"env\['NCCL_DEBUG'\] must be a string, got None. HINT: ranks get text"),
    ({"env": {"X": True}}, r"env\['X'\] must be a string, got True"),
    ({"env": {"A=B": "1"}}, "env names must be non-empty strings without '='"),
])
def test_bad_arguments(workdir, write_script, kwargs, match):
    write_script("ok.py", "print('hi')\n")
    with pytest.raises((ValueError, TypeError), match=match):
        labkit.launch("ok.py", **kwargs)
    assert no_run_started(workdir)


def test_unwritable_run_folder(workdir, write_script):
    write_script("ok.py", "print('hi')\n")
    (workdir / "a_file").write_text("")
    with pytest.raises(PermissionError, match=r"cannot write run folders under .*HINT: pass runs_dir="):
        labkit.launch("ok.py", runs_dir="a_file/runs")


def test_sweep_with_duplicate_world_sizes(workdir, write_script):
    write_script("ok.py", "print('hi')\n")
    with pytest.raises(ValueError, match=r"nproc has duplicates: \[1, 2, 1\]. HINT: name each "
                                         r"world size once; repeats=3 already runs each"):
        labkit.sweep("ok.py", nproc=[1, 2, 1], device="cpu")
    assert no_run_started(workdir)


def test_sweep_with_an_empty_list(workdir, write_script):
    write_script("ok.py", "print('hi')\n")
    with pytest.raises(ValueError, match="nproc is empty"):
        labkit.sweep("ok.py", nproc=[])
    with pytest.raises(TypeError, match="sweep's nproc must be a list of ints"):
        labkit.sweep("ok.py", nproc=2)
    with pytest.raises(ValueError, match="repeats must be an int >= 1"):
        labkit.sweep("ok.py", nproc=[1], repeats=0)
    assert no_run_started(workdir)


def test_default_nproc_is_two_cpu_ranks_without_gpus(monkeypatch):
    monkeypatch.delenv("LABKIT_RANKS", raising=False)  # --ranks sets it for the session
    monkeypatch.setattr(_hardware, "gpu_count", lambda: 0)
    assert labkit.default_nproc() == 2
    monkeypatch.setattr(_hardware, "gpu_count", lambda: 8)
    monkeypatch.delenv("LABKIT_SMOKE", raising=False)
    assert labkit.default_nproc() == 8
    assert labkit.default_nproc("cpu") == 2
    monkeypatch.setenv("LABKIT_SMOKE", "1")
    assert labkit.default_nproc() == 2


def test_labkit_ranks_sets_the_cpu_ranks_and_the_smoke_cap(monkeypatch):
    """make test-scale sets LABKIT_RANKS=4: CPU lessons launch 4 ranks, smoke mode caps GPUs at 4."""
    monkeypatch.setenv("LABKIT_RANKS", "4")
    monkeypatch.setattr(_hardware, "gpu_count", lambda: 0)
    assert labkit.default_nproc() == 4
    monkeypatch.setattr(_hardware, "gpu_count", lambda: 8)
    monkeypatch.setenv("LABKIT_SMOKE", "1")
    assert labkit.default_nproc() == 4
    assert labkit.default_nproc("cpu") == 4
    monkeypatch.delenv("LABKIT_SMOKE")
    assert labkit.default_nproc() == 8
    for bad in ("0", "four", "-2", "2.5"):
        monkeypatch.setenv("LABKIT_RANKS", bad)
        with pytest.raises(ValueError, match="LABKIT_RANKS must be a whole number"):
            labkit.default_nproc("cpu")


@pytest.mark.parametrize("gpus, ranks, device", [(0, 2, "cpu"), (1, 2, "cpu"), (2, 2, "auto"),
                                                  (8, 2, "auto"), (1, 1, "auto"), (3, 4, "cpu")])
def test_lesson_device_needs_a_gpu_for_every_rank(monkeypatch, gpus, ranks, device):
    """NCCL needs one GPU per rank: below ``ranks`` GPUs a lesson runs CPU ranks."""
    monkeypatch.setattr(_hardware, "gpu_count", lambda: gpus)
    assert labkit.lesson_device(ranks) == device
    if ranks == 2:
        assert labkit.lesson_device() == device


def test_lesson_device_refuses_a_bad_rank_count():
    with pytest.raises(ValueError, match="ranks must be >= 1, got 0"):
        labkit.lesson_device(0)
    with pytest.raises(TypeError, match="ranks must be an int"):
        labkit.lesson_device(2.0)


# -- real launches ------------------------------------------------------------------------
def all_gone(run_dir: Path, timeout: float = 10.0) -> bool:
    """True once torchrun and every recorded rank of the run have exited."""
    info = json.loads((run_dir / "run.json").read_text())
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = [json.loads(p.read_text()) for p in (run_dir / "pids").glob("rank*.json")]
        alive = [p for p in pids if _proc.is_same_process(p["pid"], p["token"])]
        if not alive and _proc.process_token(info["torchrun_pid"]) is None:
            return True
        time.sleep(0.2)
    return False


def git_repo(folder: Path) -> str:
    """Make ``folder`` a git repository with one commit; its commit id."""
    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.org", *args],
                              cwd=folder, check=True, capture_output=True, text=True).stdout.strip()
    git("init", "-q")
    git("add", "-A")
    git("commit", "-q", "-m", "scripts")
    return git("rev-parse", "HEAD")


@pytest.mark.launch
def test_every_rank_succeeds_with_metrics_and_prefixed_output(workdir, write_script, capsys, ranks):
    write_script("hello.py", HELLO)
    commit = git_repo(workdir)
    before = time.time()
    run = labkit.launch("hello.py", nproc=ranks, args=["--greeting", "hi"], timeout_s=120)
    after = time.time()
    out = capsys.readouterr().out
    assert run.returncode == 0 and run.status == "ok"
    for rank in range(ranks):
        assert f"[rank{rank}] hello from rank {rank}, sum {sum(range(ranks))}" in out
    assert run.command.split()[1:3] == ["-m", "torch.distributed.run"]
    assert "--rdzv-endpoint=127.0.0.1:0" in run.command and f"$ {run.command}" in out
    df = run.metrics()
    assert sorted(df["rank"].unique()) == list(range(ranks)) and len(df) == 3 * ranks
    assert labkit.Run.load(run.run_dir).metrics().equals(df)
    assert all_gone(run.run_dir, timeout=2)

    # run.json says what ran, where, with what, and when: enough to redo or redraw the run.
    saved = json.loads((run.run_dir / "run.json").read_text())
    assert saved["command"] == run.command and saved["command"].endswith("hello.py --greeting hi")
    assert saved["argv"][0] == sys.executable and saved["args"] == ["--greeting", "hi"]
    assert saved["script"] == "hello.py" and saved["nproc"] == ranks and saved["device"] == "cpu"
    assert saved["returncode"] == 0 and saved["status"] == "ok"
    assert saved["env"]["OMP_NUM_THREADS"] == str(run.info["threads_per_rank"])
    assert saved["versions"] == {"python": platform.python_version(), "torch": torch.__version__,
                                 "labkit": labkit.__version__}
    assert saved["hardware"]["cpu_count"] == _hardware.cpu_count() and saved["hardware"]["gpus"] == []
    assert saved["git_commit"] == commit
    assert before <= saved["start_time"] < saved["end_time"] <= after
    assert 0 < saved["wall_s"] <= after - before


def test_run_json_names_torch_with_its_build_without_importing_torch():
    """The package metadata says "2.14.1"; a reference run needs "2.14.1+cu130" or "+cpu"."""
    probe = ("import sys; from labkit._launch.command import _versions; v = _versions(); "
             "print(v['torch'], 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [torch.__version__, "False"]


@pytest.mark.launch
def test_a_rank_that_raises_is_named_first(workdir, write_script, ranks):
    write_script("fail.py", """
        import torch.distributed as dist
        dist.init_process_group("gloo")
        if dist.get_rank() == 1:
            raise ValueError("rank 1 is unhappy")
        dist.barrier()
    """)
    start = time.monotonic()
    with pytest.raises(LaunchError, match=r"rank 1 failed \(exit code 1\): ValueError: rank 1 is unhappy") as info:
        labkit.launch("fail.py", nproc=ranks, timeout_s=120)
    assert time.monotonic() - start < 30
    err = info.value
    assert err.failures[0].rank == 1 and not err.failures[0].secondary
    assert 'File "fail.py", line 4' in err.failures[0].traceback
    assert "HINT: read rank 1's traceback" in str(err)
    # torchrun's own error file for rank 1 (it sets TORCHELASTIC_ERROR_FILE under --log-dir)
    [error_file] = err.run.run_dir.glob("torchrun/*/attempt_0/1/error.json")
    recorded = json.loads(error_file.read_text())["message"]
    assert recorded["message"] == "ValueError: rank 1 is unhappy"
    callstack = recorded["extraInfo"]["py_callstack"]
    assert callstack.startswith("Traceback (most recent call last):")
    assert 'File "fail.py", line 4' in callstack and callstack.rstrip().endswith("ValueError: rank 1 is unhappy")
    assert all_gone(err.run.run_dir, timeout=5)


# Rank 1 frees one block twice: glibc notices, says so on stderr and aborts the process, as it
# does on any heap corruption it finds (CI met one inside PyTorch's gloo path, lesson 11).
DOUBLE_FREE = """
    import ctypes, os
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    print("rank", os.environ["RANK"], "allocates", flush=True)

    def free_twice():
        block = libc.malloc(64)
        libc.free(block)
        libc.free(block)

    if os.environ["RANK"] == "1":
        free_twice()
"""


@pytest.mark.launch
def test_a_rank_glibc_aborts_for_a_corrupted_heap_gets_that_hint(workdir, write_script):
    """A real abort, through torchrun and the rank's own output: glibc's words reach the
    failure's last lines, and the HINT quotes them (the test harness reruns on it)."""
    write_script("double_free.py", DOUBLE_FREE)
    with pytest.raises(LaunchError, match=r"rank 1 failed \(exit code -6\): killed by SIGABRT") as info:
        labkit.launch("double_free.py", nproc=2, timeout_s=120)
    err = info.value
    assert "free(): double free detected" in err.failures[0].output_tail
    assert err.hint.startswith("glibc found its heap memory corrupted and aborted rank 1 (\"free(): "
                               "double free detected"), err.hint
    # The rank's entry point printed its Python stack as it died: the failure says the line.
    assert err.failures[0].message == "killed by SIGABRT at double_free.py:9 in free_twice", err
    assert "Fatal Python error" not in err.failures[0].output_tail
    stack = err.failures[0].traceback
    assert 'File "double_free.py", line 9 in free_twice' in stack
    assert stack.rstrip().endswith('File "double_free.py", line 12 in <module>'), stack
    assert "its Python stack when it died (most recent call first):" in str(err)
    assert all_gone(err.run.run_dir, timeout=5)


@pytest.mark.launch
def test_a_collective_only_rank_0_calls_is_named_as_a_mismatch(workdir, write_script):
    """Exactly two ranks: which rank gloo aborts on a size mismatch depends on how its ring pairs
    them, and this test names the one it aborts with two."""
    write_script("mismatch.py", MISMATCH.replace("SIZE", "1000"))
    with pytest.raises(LaunchError, match=r"rank 0 failed \(exit code -6\): killed by SIGABRT") as info:
        labkit.launch("mismatch.py", nproc=2, timeout_s=120)
    err = info.value
    assert "Is there a distributed collective mismatch" in err.failures[0].output_tail
    assert "its last output:" in str(err) and "collective mismatch in your code?" in str(err)
    assert err.hint.startswith("rank 0's output says the ranks' collectives did not match: every rank "
                               "must call the same collectives in the same order")
    assert "out of memory" not in str(err)
    assert all_gone(err.run.run_dir, timeout=5)


@pytest.mark.launch
@pytest.mark.parametrize("ending", ["    dist.destroy_process_group()\n", ""], ids=["destroys-its-group", "just-ends"])
def test_a_rank_left_waiting_by_a_peer_that_finished_is_not_called_the_root_cause(workdir, write_script,
                                                                                    ranks, ending):
    """Whether the finished peer destroyed its group or just ended, the rank left waiting learns
    at once: a rank's process ends when its script does, and its connections close with it (a
    rank kept alive after its script, as torchrun keeps the ranks it forks, must close them)."""
    script = MISMATCH.replace("SIZE", "4")
    assert script.count("    dist.destroy_process_group()\n") == 1
    write_script("mismatch.py", script.replace("    dist.destroy_process_group()\n", ending))
    with pytest.raises(LaunchError) as info:
        labkit.launch("mismatch.py", nproc=ranks, timeout_s=120)
    err = info.value
    assert [(f.rank, f.secondary) for f in err.failures] == [(0, True)]
    assert "rank 1 done" in err.run.output(1)
    assert "root cause" not in err.hint
    assert "rank 0 lost its connection to a peer, but no rank reported an error of its own" in err.hint
    assert "look for a collective inside `if rank == 0:`" in err.hint


@pytest.mark.launch
def test_a_bad_script_option_shows_the_scripts_own_message(workdir, write_script):
    write_script("opts.py", """
        import argparse
        parser = argparse.ArgumentParser()
        parser.add_argument("--epochs", type=int)
        parser.parse_args()
    """)
    with pytest.raises(LaunchError, match=r"SystemExit") as info:
        labkit.launch("opts.py", nproc=1, args=["--lr", "2"], timeout_s=60)
    assert "unrecognized arguments: --lr 2" in info.value.failures[0].output_tail
    assert "exited on purpose" in str(info.value)


@pytest.mark.launch
def test_a_hang_becomes_a_timeout_that_says_where_each_rank_was(workdir, write_script, capsys, ranks):
    write_script("hang.py", """
        import time, torch, torch.distributed as dist
        from labkit import metrics
        dist.init_process_group("gloo")
        metrics.log(0, loss=1.0)
        if dist.get_rank() == 0:
            metrics.log(1, loss=0.5)
            dist.all_reduce(torch.ones(1))
        else:
            time.sleep(300)
    """)
    start = time.monotonic()
    with pytest.raises(LaunchTimeout) as info:  # 20 s: time for both ranks to start on a busy machine
        labkit.launch("hang.py", nproc=ranks, timeout_s=20)
    assert time.monotonic() - start < 20 + 10
    err = info.value
    assert err.last_steps == {0: 1, **{rank: 0 for rank in range(1, ranks)}}
    assert err.stacks[0].startswith("hang.py:7 in <module>, inside all_reduce")
    for rank in range(1, ranks):
        assert err.stacks[rank].startswith("hang.py:9 in <module>")
    assert "rank 0: last logged step 1; was at hang.py:7" in str(err)
    # The cell shows each rank's script thread, not all of its threads; the log keeps the rest.
    out = capsys.readouterr().out
    assert 'File "hang.py", line 7 in <module>' in out and "_sigterm_watch" not in out
    assert "more line(s) of its stack dump are in" in out
    assert "_sigterm_watch" in err.run.output(0)
    assert all_gone(err.run.run_dir, timeout=5)


@pytest.mark.launch
@pytest.mark.parametrize("blocked_in", ["time.sleep(300)", "dist.all_reduce(torch.ones(1))"])
def test_a_rank_ended_by_sigterm_keeps_the_metrics_it_logged(workdir, write_script, blocked_in):
    """torchrun ends the healthy ranks with SIGTERM when one fails: their last lines must reach disk.

    Two ranks, one blocked and one sending the signal: the claim is about one rank. The timed
    flush is switched off, so only the SIGTERM handling can save the line. In
    ``time.sleep`` Python runs the handler; inside a gloo collective the main thread never
    returns to Python, and a watcher thread must do it.
    """
    write_script("terminated.py", f"""
        import os, signal, time, torch, torch.distributed as dist
        from labkit import metrics
        metrics._FLUSH_EVERY_S = 3600  # no timed flush
        dist.init_process_group("gloo")
        pids = [None, None]
        dist.all_gather_object(pids, os.getpid())
        if dist.get_rank() == 0:
            metrics.log(7, loss=0.25)
            {blocked_in}
        else:
            time.sleep(2)  # rank 0 is blocked by now
            os.kill(pids[0], signal.SIGTERM)
            time.sleep(300)
    """)
    with pytest.raises(LaunchError) as info:
        labkit.launch("terminated.py", nproc=2, timeout_s=60)
    run = info.value.run
    assert "killed by SIGTERM" in str(info.value)
    logged = run.metrics()
    assert list(logged.loc[logged["rank"] == 0, "step"]) == [7], logged
    assert all_gone(run.run_dir, timeout=5)


@pytest.mark.launch
@pytest.mark.parametrize("rank1_ends", ["finished", "raised"])
def test_a_rank_already_ending_when_torchrun_stops_it_ends_by_itself(workdir, write_script, rank1_ends):
    """torchrun stops the other ranks with SIGTERM as soon as one fails. A rank whose script has
    already returned, or raised, is on its way out: killing it then called a rank that had
    finished "killed by SIGTERM", or lost its own error (CI saw both, on a slow machine). Here
    rank 1's way out is made slow on purpose, so that the signal always lands in it.
    """
    write_script("ending.py", f"""
        import atexit, os, time, torch.distributed as dist
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        dist.barrier()
        dist.destroy_process_group()
        if rank == 0:
            time.sleep(1)  # rank 1 is in its slow way out by now
            raise RuntimeError("rank 0 fails on its own")

        class SlowToSay(Exception):
            def __str__(self):
                time.sleep(3)  # formatting the error for errors/ takes this long
                return "rank 1 fails on its own, slowly"

        if "{rank1_ends}" == "raised":
            raise SlowToSay()
        atexit.register(time.sleep, 3)  # a slow exit, after a script that finished
        print("rank 1 done", flush=True)
    """)
    with pytest.raises(LaunchError) as info:
        labkit.launch("ending.py", nproc=2, timeout_s=60)
    err = info.value
    failed = {f.rank: f.message for f in err.failures}
    if rank1_ends == "finished":
        assert failed == {0: "rank 0 fails on its own"}, err.failures
        assert "rank 1 done" in err.run.output(1)
    else:
        assert failed == {0: "rank 0 fails on its own", 1: "rank 1 fails on its own, slowly"}, err.failures
    assert all_gone(err.run.run_dir, timeout=5)


@pytest.mark.launch
def test_a_rank_ends_like_python_but_skips_the_final_teardown(workdir, write_script):
    """atexit handlers and non-daemon threads still run; the interpreter's teardown does not.

    The teardown is where gloo's worker threads, freeing a finished collective,
    abort the process ("terminate called without an active exception"): see
    labkit._rank.entry._exit. A module global's __del__ runs only in that teardown.
    """
    write_script("ending.py", """
        import atexit, pathlib, threading, time

        def late_write():
            time.sleep(0.3)
            pathlib.Path("thread-finished").write_text("yes")

        class Witness:
            def __del__(self):
                pathlib.Path("teardown-ran").write_text("yes")

        witness = Witness()
        atexit.register(lambda: pathlib.Path("atexit-ran").write_text("yes"))
        threading.Thread(target=late_write).start()
        print("script done")
    """)
    run = labkit.launch("ending.py", nproc=1, timeout_s=60)
    assert run.status == "ok" and "script done" in run.output(0)
    assert (workdir / "atexit-ran").exists(), "atexit handlers must still run"
    assert (workdir / "thread-finished").exists(), "non-daemon threads must be waited for"
    assert not (workdir / "teardown-ran").exists(), "the interpreter's teardown must be skipped"


@pytest.mark.launch
def test_a_ranks_persistent_loader_workers_are_stopped_before_atexit(workdir, write_script):
    """Persistent DataLoader workers live until their iterator is freed, which a skipped
    teardown never does; older PyTorch's atexit handler then waited 5 s for each one that
    pins memory (lesson 08 on a GPU: 57 s for 2.4 s of training). The entry stops them as soon
    as the script returns: by the time the script's own atexit handler runs, none is alive."""
    write_script("loader.py", """
        import atexit, multiprocessing, pathlib
        import torch
        from torch.utils.data import DataLoader, TensorDataset

        loader = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2, num_workers=2,
                            persistent_workers=True)
        for epoch in range(2):
            print("epoch", epoch, sum(len(b[0]) for b in loader), "samples", flush=True)
        pathlib.Path("workers-running").write_text(str(len(multiprocessing.active_children())))
        atexit.register(lambda: pathlib.Path("workers-at-atexit").write_text(
            str(len(multiprocessing.active_children()))))
    """)
    run = labkit.launch("loader.py", nproc=1, timeout_s=60)
    assert run.status == "ok" and "epoch 1 8 samples" in run.output(0)
    assert (workdir / "workers-running").read_text() == "2", "the loader's workers must persist"
    assert (workdir / "workers-at-atexit").read_text() == "0"


@pytest.mark.launch
def test_a_rank_whose_thread_pool_is_never_shut_down_still_ends(workdir, write_script):
    """A concurrent.futures pool left running (torch.compile's Inductor leaves one) stops at
    exit because Python tells it to before joining threads; a rank must do the same, or it
    waits for the pool's idle workers for ever."""
    write_script("pool.py", """
        import json
        from concurrent.futures import ThreadPoolExecutor

        json.kept_pool = ThreadPoolExecutor(max_workers=2)  # held by a module, as a library holds it
        print("answer", json.kept_pool.submit(lambda: 6 * 7).result())
    """)
    run = labkit.launch("pool.py", nproc=1, timeout_s=60)
    assert run.status == "ok" and "answer 42" in run.output(0)


@pytest.mark.launch
@pytest.mark.parametrize("code", [0, 3])
def test_a_ranks_exit_code_is_kept(workdir, write_script, code):
    write_script("leave.py", f"""
        import sys
        print("leaving", flush=True)
        sys.exit({code})
    """)
    if code == 0:
        assert labkit.launch("leave.py", nproc=1, timeout_s=60).returncode == 0
    else:
        with pytest.raises(LaunchError, match=f"exited with code {code}"):
            labkit.launch("leave.py", nproc=1, timeout_s=60)


@pytest.mark.launch
def test_restarts_resume_and_are_stamped(workdir, write_script, ranks):
    write_script("flaky.py", """
        import os, torch, torch.distributed as dist
        from labkit import metrics
        dist.init_process_group("gloo")
        restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        metrics.log(restart, loss=1.0)
        if restart == 0 and dist.get_rank() == 1:
            raise RuntimeError("first attempt fails")
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)  # needs a sound gloo mesh in the restarted attempt
        metrics.log(restart, total=t.item())
        dist.destroy_process_group()
    """)
    run = labkit.launch("flaky.py", nproc=ranks, max_restarts=1, timeout_s=120)
    df = run.metrics()
    assert run.status == "ok"
    assert sorted(df["restart"].unique()) == [0, 1]
    assert df.loc[df["restart"] == 1, "total"].dropna().tolist() == [ranks * (ranks + 1) / 2] * ranks
    assert run.info["env"]["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"


@pytest.mark.launch
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_no_rank_outlives_its_launcher(workdir, write_script, sig, ranks):
    write_script("sleeper.py", SLEEPER)
    signal_launcher(workdir, f"""
        import labkit
        labkit.launch("sleeper.py", nproc={ranks}, timeout_s=300)
    """, nproc=ranks, sig=sig)


def started_run(root: Path, nproc: int, timeout: float = 60) -> Path | None:
    """The run folder under ``root`` (in a sweep's folder too) once its ``nproc`` ranks have
    recorded their pids; None if they never do."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pids in sorted(root.rglob("pids")) if root.exists() else ():
            if len(list(pids.glob("rank*.json"))) == nproc:
                return pids.parent
        time.sleep(0.2)
    return None


INTERRUPTED = re.compile(r"^interrupted: .*$", re.MULTILINE)


def signal_launcher(workdir: Path, code: str, nproc: int, sig: int = signal.SIGINT
                    ) -> tuple[Path, subprocess.CompletedProcess]:
    """Run ``code`` (a launch) in a process of its own and send it ``sig`` once ``nproc`` ranks
    run (SIGINT raises KeyboardInterrupt, as JupyterLab's interrupt button does in a kernel).
    Asserts that no process of the run is left 10 s later; returns the run folder and what the
    launching process printed."""
    # Said explicitly: a test suite started in the background of a shell without job control
    # inherits SIGINT ignored.
    code = "import signal\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n" + textwrap.dedent(code)
    launcher = python(code, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        run_dir = started_run(workdir / "runs", nproc)
        assert run_dir is not None, "the ranks never started"
        launcher.send_signal(sig)
        assert all_gone(run_dir, timeout=10), f"processes of {run_dir} outlived a {signal.Signals(sig).name}"
        out, err = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
        launcher.wait()
    return run_dir, subprocess.CompletedProcess(launcher.args, launcher.returncode, out, err)


@pytest.mark.launch
def test_an_interrupted_launch_says_what_it_stopped_then_shows_only_the_learners_frames(
        workdir, write_script, ranks):
    """JupyterLab's interrupt button: one plain line first, then IPython's traceback of the
    learner's cell, without labkit's wrapper or poll loop; the cell stops, no rank is left."""
    write_script("sleeper.py", SLEEPER)
    run_dir, done = signal_launcher(workdir, f"""
        from IPython.core.interactiveshell import InteractiveShell
        InteractiveShell.instance().run_cell(
            'import labkit\\nrun = labkit.launch("sleeper.py", nproc={ranks}, timeout_s=300)\\nprint("not " + "reached")')
        print("the kernel goes on", flush=True)
    """, nproc=ranks)
    out = re.sub(r"\x1b\[[0-9;]*m", "", done.stdout)
    assert INTERRUPTED.findall(out) == [
        f"interrupted: {ranks} ranks stopped, run folder {run_dir.relative_to(workdir)}"], out
    after = out[INTERRUPTED.search(out).end():]
    assert not re.search(r"^\[(rank\d+|torchrun)\]", after, re.MULTILINE), (
        "what the ranks print while they stop belongs in their logs, not after the line:\n" + after)
    assert "KeyboardInterrupt" in after and "Cell In[1], line 2" in after, after
    assert "labkit/_launch/" not in after and "keywords.py" not in after, after  # no frame of labkit
    assert "not reached" not in out and out.rstrip().endswith("the kernel goes on")
    assert json.loads((run_dir / "run.json").read_text())["status"] == "interrupted"


@pytest.mark.launch
def test_an_interrupted_sweep_stops_too(workdir, write_script):
    write_script("sleeper.py", SLEEPER)
    run_dir, done = signal_launcher(workdir, """
        import labkit
        labkit.sweep("sleeper.py", nproc=[1, 2], repeats=1, timeout_s=300)
    """, nproc=1)
    assert INTERRUPTED.findall(done.stdout) == [
        f"interrupted: 1 rank stopped, run folder {run_dir.relative_to(workdir)}"], done.stdout
    assert done.returncode != 0 and done.stderr.rstrip().endswith("KeyboardInterrupt"), done.stderr
    assert [p.name for p in run_dir.parent.iterdir()] == [run_dir.name], "the sweep went on"


@pytest.mark.launch
def test_two_concurrent_launches_both_succeed(workdir, write_script, ranks):
    write_script("hello.py", HELLO)
    code = f"""
        import labkit
        run = labkit.launch("hello.py", nproc={ranks}, timeout_s=120, quiet=True)
        print(run.status)
    """
    procs = [python(code, cwd=workdir, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert [o.strip().splitlines()[-1] for o in outs] == ["ok", "ok"]
    assert len(list((workdir / "runs").iterdir())) == 2


@pytest.mark.launch
def test_a_ranks_own_children_die_with_it_when_the_launcher_is_killed(workdir, write_script, ranks):
    """DataLoader workers are children of their rank: a kernel killed outright must take them too."""
    write_script("parent.py", """
        import os, subprocess, time, torch.distributed as dist
        dist.init_process_group("gloo")
        child = subprocess.Popen(["sleep", "300"])  # stands in for a DataLoader worker
        with open(f"child{dist.get_rank()}.pid", "w") as f:
            f.write(str(child.pid))
        time.sleep(300)
    """)
    launcher = python(f"""
        import labkit
        labkit.launch("parent.py", nproc={ranks}, timeout_s=300)
    """, cwd=workdir)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all((workdir / f"child{r}.pid").exists() for r in range(ranks)):
            time.sleep(0.2)
        children = [int((workdir / f"child{r}.pid").read_text()) for r in range(ranks)]
        tokens = [_proc.process_token(pid) for pid in children]
        launcher.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(
                _proc.is_same_process(pid, tok) for pid, tok in zip(children, tokens)):
            time.sleep(0.2)
        assert not any(_proc.is_same_process(p, t) for p, t in zip(children, tokens))
    finally:
        launcher.kill()
        launcher.wait()
