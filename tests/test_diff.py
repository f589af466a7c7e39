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
