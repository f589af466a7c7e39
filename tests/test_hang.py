"""py-spy, from outside a process (lesson 10): dumps read, parsed and shown briefly."""

from __future__ import annotations

import stat
import subprocess
import sys
import textwrap

import pytest

import labkit
from labkit._diagnose import hang as _hang
from labkit._diagnose.stacks import PY_SPY, where

def _fake_py_spy(tmp_path, monkeypatch, output: str, code: int) -> None:
    exe = tmp_path / "py-spy"
    exe.write_text(f"#!{sys.executable}\nimport sys\nprint({output!r})\nsys.exit({code})\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(_hang, "py_spy_executable", lambda: str(exe))


@pytest.mark.parametrize("output", [
    "Permission Denied: Try running again with elevated permissions by going 'sudo env \"PATH=$PATH\" !!'",
    "Error: Operation not permitted (os error 1)",
])
def test_no_ptrace_permission_is_said_plainly(tmp_path, monkeypatch, output):
    _fake_py_spy(tmp_path, monkeypatch, output, 1)
    with pytest.raises(PermissionError, match=r"py-spy could not attach to pid 1.*HINT: attaching to "
                                              r"another process needs ptrace permission.*SYS_PTRACE"):
        labkit.dump_stack(1)


def test_colour_codes_are_left_out(tmp_path, monkeypatch):
    _fake_py_spy(tmp_path, monkeypatch, "\x1b[32mall_reduce\x1b[0m (x.py:1)", 0)
    assert labkit.dump_stack(1).strip() == "all_reduce (x.py:1)"


def test_without_py_spy_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(_hang, "py_spy_executable", lambda: None)
    with pytest.raises(FileNotFoundError, match="py-spy is not installed. HINT: pip install py-spy"):
        labkit.dump_stack(1)


def test_py_spy_reads_a_running_process(tmp_path):
    """The real py-spy on a sleeping Python: the stack names its function. Needs ptrace
    permission on this machine (root, or SYS_PTRACE in a container); skipped, saying so, without."""
    script = tmp_path / "sleeper.py"
    script.write_text(textwrap.dedent("""
        import time
        def wait_here():
            print("ready", flush=True)
            time.sleep(60)
        wait_here()
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        try:
            dump = labkit.dump_stack(proc.pid)
        except PermissionError as err:
            pytest.skip(f"py-spy may not attach here: {err}")
        assert "wait_here (sleeper.py:" in dump
        assert where(dump, str(script), PY_SPY).startswith(f"{script}:5 in wait_here")
    finally:
        proc.kill()
        proc.wait()
