"""A wrong or old keyword gets a did-you-mean, not Python's bare "unexpected keyword argument".

Every time argument of labkit ends in ``_s`` and one number of ranks is always ``nproc``; the
names they replaced (``timeout``, ``hang_timeout``, sweep's ``nprocs``) say the new one. Used by
every public function that takes such a keyword. Standard library.
"""

from __future__ import annotations

import functools


def refuse_keywords(**messages):
    """Decorator: a call that passes one of these keywords gets a TypeError with its message
    (a "did you mean") instead of Python's bare "unexpected keyword argument". The function's
    own signature is unchanged (``inspect.signature`` follows ``__wrapped__``).

    Example::

        @refuse_keywords(nprocs="launch() takes nproc=<int>")
        def launch(script, *, nproc=None): ...
    """
    def decorate(func):
        @functools.wraps(func)
        def checked(*args, **kwargs):
            __tracebackhide__ = True  # IPython leaves this wrapper out of the learner's tracebacks
            for key in messages:
                if key in kwargs:
                    raise TypeError(f"{func.__name__}() got an unexpected keyword argument "
                                    f"{key!r}: {messages[key]}")
            return func(*args, **kwargs)
        return checked
    return decorate


def renamed(function: str, **new_names) -> dict[str, str]:
    """``refuse_keywords`` messages for keywords that were renamed: ``old -> new``.

    Every time argument of labkit ends in ``_s`` (seconds), as ``wall_s`` and ``after_quiet_s``
    do, and one number of ranks is always ``nproc``.

    Example::

        @refuse_keywords(**renamed("launch", timeout="timeout_s"))
        def launch(script, *, timeout_s=600): ...
    """
    return {old: f"did you mean {new}=? ({function}() names it {new}: "
                 f"{'a time in seconds ends in _s' if new.endswith('_s') else 'one spelling'})."
            for old, new in new_names.items()}
