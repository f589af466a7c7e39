"""labkit.diff: the change from one lesson's script to the next."""

from __future__ import annotations

import pytest

import labkit


def test_diff_counts_and_renders(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.py").write_text("import torch\nx = 1\nprint(x)\n")
    (tmp_path / "b.py").write_text("import torch\nx = 2\ny = 3\nprint(x)\n")
    d = labkit.diff("a.py", "b.py")
    assert (d.added, d.removed) == (2, 1)
    assert "-x = 1" in str(d) and "+y = 3" in str(d)
    assert "2 line(s) added, 1 removed" in d._repr_html_()
    with pytest.raises(FileNotFoundError, match="run the lesson's %%writefile cell first"):
        labkit.diff("a.py", "missing.py")


def test_write_variant_makes_each_edit_once_and_returns_the_diff(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.py").write_text("import torch\nx = 1\nprint(x)\n")
    d = labkit.write_variant("a.py", "variants/b.py", {"x = 1\n": "x = 2\ny = 3\n"})
    assert (tmp_path / "variants" / "b.py").read_text() == "import torch\nx = 2\ny = 3\nprint(x)\n"
    assert (d.added, d.removed) == (2, 1) and d.new == "variants/b.py"
    assert (tmp_path / "a.py").read_text() == "import torch\nx = 1\nprint(x)\n"   # untouched


def test_write_variant_refuses_stale_or_ambiguous_edits(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.py").write_text("x = 1\nx = 1\n")
    with pytest.raises(ValueError, match=r"a.py holds 'x = 1' 2 times, not once.*nothing was written"):
        labkit.write_variant("a.py", "b.py", {"x = 1": "x = 2"})
    with pytest.raises(ValueError, match=r"holds 'y' 0 times"):
        labkit.write_variant("a.py", "b.py", {"y": "z"})
    assert not (tmp_path / "b.py").exists()
    with pytest.raises(ValueError, match="is the script itself"):
        labkit.write_variant("a.py", "./a.py", {"x = 1\nx": "x"})
    with pytest.raises(ValueError, match="edits is empty"):
        labkit.write_variant("a.py", "b.py", {})
    with pytest.raises(FileNotFoundError, match="run the lesson's %%writefile cells first"):
        labkit.write_variant("missing.py", "b.py", {"x": "y"})
