"""Tracebacks without labkit's frames: an interrupted launch ends in the learner's cell.

Kernel side (IPython is imported only when a traceback is shown).
"""

from __future__ import annotations

import functools
import os
import types

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # labkit/


def _labkit_frame(frame: types.FrameType) -> bool:
    return os.path.realpath(frame.f_code.co_filename).startswith(_PACKAGE_DIR + os.sep)


def without_labkit_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """The traceback ``tb`` with every frame of labkit's own files left out."""
    kept = []
    while tb is not None:
        if not _labkit_frame(tb.tb_frame):
            kept.append(tb)
        tb = tb.tb_next
    out = None
    for entry in reversed(kept):
        out = types.TracebackType(out, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return out


def _render_without_labkit(err: BaseException) -> list[str]:
    from IPython import get_ipython

    formatter = get_ipython().InteractiveTB
    tb = err.__traceback__
    if getattr(formatter, "skip_hidden", True):  # a user who asked for every frame gets them
        tb = without_labkit_frames(tb)
    return formatter.structured_traceback(type(err), err, tb)


def hide_labkit_frames(err: BaseException) -> BaseException:
    """Let IPython (Jupyter) show ``err`` without labkit's frames; returns ``err``.

    IPython leaves out a frame whose locals set ``__tracebackhide__``, but never the innermost
    one, and for an interrupted launch that is labkit's poll loop: plumbing, in the learner's
    way. Before it formats an exception, IPython asks it for ``_render_traceback_()`` (its hook
    for exceptions that format themselves), so ``err`` gets one that formats its traceback
    without any frame from labkit's files: the learner's cell is the last frame shown. Plain
    Python does not know the hook and prints every frame, as always.
    """
    err._render_traceback_ = functools.partial(_render_without_labkit, err)
    return err
