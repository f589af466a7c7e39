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


def write_variant(script: str | os.PathLike, target: str | os.PathLike,
                  edits: dict[str, str]) -> Diff:
    """Write a copy of ``script`` with a few exact edits to ``target``; return the diff.

    A pitfall is best shown as a small change to a script that works: the lesson makes the
    broken (or remedied) copy, shows the diff, launches it and checks what goes wrong. The
    lesson's own script stays clean, with no switch for every mistake it teaches.

    Args:
        script: the script to copy, e.g. ``"scripts/02_ddp.py"``.
        target: where the variant goes (its folder is created), e.g.
            ``"scripts/variants/02_no_sampler.py"``.
        edits: ``{old: new}``; each ``old`` must occur exactly once (after the edits before it)
            and is replaced by ``new``.

    Returns:
        the ``Diff`` from ``script`` to ``target``: the edits, in context.

    Raises:
        FileNotFoundError: ``script`` does not exist.
        ValueError: no edits, ``target`` is ``script``, or an ``old`` text occurs other than
            once (nothing is written then).

    Example (lesson 02, pitfall 1)::

        labkit.write_variant("scripts/02_ddp.py", "scripts/variants/02_no_sampler.py", {
            "sampler=sampler, drop_last": "shuffle=True, drop_last", ...})
    """
    source, out = Path(script), Path(target)
    if not source.is_file():
        raise FileNotFoundError(f"{os.fspath(script)!r} does not exist (looked in {Path.cwd()}). "
                                f"HINT: run the lesson's %%writefile cells first.")
    if not edits:
        raise ValueError("edits is empty: a variant differs from its script by at least one edit")
    if out.resolve() == source.resolve():
        raise ValueError(f"target {os.fspath(target)!r} is the script itself: a variant goes to "
                         f"a file of its own, so the lesson's script stays as it is")
    text = source.read_text()
    for old, new in edits.items():
        found = text.count(old)
        if found != 1:
            raise ValueError(
                f"{os.fspath(script)} holds {old!r} {found} times, not once: the edit is ambiguous "
                f"or stale (nothing was written). HINT: run the lesson's %%writefile cells again, "
                f"or quote a longer, unique piece of the script.")
        text = text.replace(old, new)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return diff(script, target)
