"""labkit.diff: what changed from one lesson's script to the next (the diff is the lesson)."""

from __future__ import annotations

import difflib
import html
import os
from pathlib import Path

_STYLE = {"+": "background:#e6ffec", "-": "background:#ffebe9", "@": "color:#8250df"}


class Diff:
    """A unified diff of two scripts; shows coloured in Jupyter, plain as text.

    Attributes:
        lines: the unified diff, one string per line.
        added, removed: how many lines were added and removed.
    """

    def __init__(self, old: str, new: str, lines: list[str]):
        self.old, self.new, self.lines = old, new, lines
        self.added = sum(1 for ln in lines if ln.startswith("+") and not ln.startswith("+++"))
        self.removed = sum(1 for ln in lines if ln.startswith("-") and not ln.startswith("---"))

    def __str__(self) -> str:
        return "\n".join(self.lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        body = []
        for line in self.lines:
            style = "" if line.startswith(("+++", "---")) else _STYLE.get(line[:1], "")
            body.append(f"<div style='{style}'>{html.escape(line) or '&nbsp;'}</div>")
        head = (f"<b>{html.escape(self.old)} → {html.escape(self.new)}</b>: "
                f"{self.added} line(s) added, {self.removed} removed")
        return (f"<div>{head}<pre style='font-size:12px;line-height:1.35'>"
                f"{''.join(body)}</pre></div>")


def diff(old: str | os.PathLike, new: str | os.PathLike, *, context: int = 2) -> Diff:
    """The unified diff from script ``old`` to script ``new``.

    Example (lesson 02)::

        labkit.diff("scripts/01_single.py", "scripts/02_ddp.py")
    """
    texts = []
    for path in (old, new):
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"{os.fspath(path)!r} does not exist (looked in {Path.cwd()}). "
                                    f"HINT: run the lesson's %%writefile cell first.")
        texts.append(p.read_text().splitlines())
    lines = list(difflib.unified_diff(texts[0], texts[1], os.fspath(old), os.fspath(new),
                                      n=context, lineterm=""))
    return Diff(os.fspath(old), os.fspath(new), lines)
