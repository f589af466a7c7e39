"""Script side: log numbers from a training script, one JSON line per call.

Used by every lesson script::

    from labkit import metrics
    metrics.log(step, loss=loss.item(), samples=samples_since_last_log)

Standard library only and cheap: a call formats one line and appends it to a
buffered file (no device sync, no fsync; a background thread flushes the
buffer twice a second so the notebook's live chart can follow). Under labkit.launch each rank
writes ``<run folder>/metrics/rank<R>.jsonl``; under a bare ``torchrun`` or
``python`` (no run folder set) ``log`` does nothing, so the script runs the same
everywhere.

Every line is stamped with ``rank``, ``world_size``, ``restart`` (torchrun's
restart count), ``step`` and ``time`` (seconds since the epoch).

A script that knows how many steps it will take says so once, before its loop:
``metrics.log(0, total_steps=N)``. The notebook's live view then shows ``step k/N`` and
estimates the time left from the rate so far.

Logging the loss with ``loss.item()`` forces the host to wait for the device.
Do it every k steps, not every step: the lessons explain why.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time

from labkit import _rundir
from labkit._rundir import RUN_DIR_ENV  # the variable labkit.launch sets to the run folder

__all__ = ["log", "flush", "enabled", "RUN_DIR_ENV"]

_FLUSH_EVERY_S = 0.5


class _Sink:
    """The open metrics file of this process (one per rank).

    Lines go into a binary buffered writer (it holds a lock, so the flusher
    thread may flush while the training loop writes). The flusher pushes the
    buffer to disk every half second when there is something new, so the live
    chart follows the run and a rank that hangs after logging still shows
    where it got to.
    """

    def __init__(self, path: str, stamp: dict):
        self.pid = os.getpid()
        self.file = open(path, "ab", buffering=64 * 1024)
        self.stamp = stamp
        self.dirty = False
        threading.Thread(target=self._flush_loop, name="labkit-metrics", daemon=True).start()

    def write(self, line: str) -> None:
        self.file.write(line.encode("utf-8"))
        self.dirty = True

    def _flush_loop(self) -> None:
        while not self.file.closed:
            time.sleep(_FLUSH_EVERY_S)
            if self.dirty:
                self.flush()

    def flush(self) -> None:
        # A forked child (a DataLoader worker) has a copy of the buffer: only
        # the process that opened the file may flush it, or lines are doubled.
        if os.getpid() == self.pid and not self.file.closed:
            self.dirty = False
            try:
                self.file.flush()
            except ValueError:  # closed meanwhile, at interpreter exit
                pass


_sink: _Sink | None = None
_disabled = False


def enabled() -> bool:
    """True when this process logs to a run folder (it runs under labkit.launch)."""
    return _rundir.from_env() is not None


def _open() -> _Sink | None:
    global _sink, _disabled
    run_dir = _rundir.from_env()
    if run_dir is None:
        _disabled = True
        return None
    rank = int(os.environ.get("RANK", "0"))
    path = _rundir.metrics_file(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    stamp = {
        "rank": rank,
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
    }
    _sink = _Sink(path, stamp)
    atexit.register(flush)
    return _sink


def _plain(name: str, value):
    """A JSON-ready number (or string) from what the script passed."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value  # NaN and inf are kept: a diverging loss must show as one
    if hasattr(value, "item"):  # a 1-element tensor or NumPy scalar
        return _plain(name, value.item())
    raise TypeError(
        f"metrics.log({name}=...) got a {type(value).__name__}; log numbers or strings. "
        f"HINT: pass loss.item() (every k steps), not the tensor or a list."
    )


def log(step: int, **values) -> None:
    """Append one line: this rank's ``values`` at ``step``.

    Args:
        step: the optimizer step (an int); charts use it as their x axis.
        **values: numbers to record, e.g. ``loss=0.71, samples=256``.
            ``samples`` means samples this rank processed since its previous
            ``log`` call; ``Run.throughput`` uses it.

    Raises:
        TypeError: a value is not a number or string.

    Example::

        if step % 10 == 0:
            metrics.log(step, loss=loss.item(), samples=10 * batch_size)
    """
    sink = _sink
    if sink is None:
        if _disabled:
            return
        sink = _open()
        if sink is None:
            return
    record = dict(sink.stamp)
    record["step"] = int(step)
    record["time"] = time.time()
    for name, value in values.items():
        record[name] = _plain(name, value)
    sink.write(json.dumps(record, separators=(",", ":")) + "\n")


def flush() -> None:
    """Write buffered lines to disk now (labkit calls it when a rank exits)."""
    if _sink is not None:
        _sink.flush()
