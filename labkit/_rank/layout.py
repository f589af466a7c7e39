"""Which node a rank is on: each rank's entry point appends one line to the layout file.

With several torchrun agents (``launch(nnodes=N)``) a rank's log folder names its node and
local rank, but not its global rank; the line each rank writes before its script starts does
(``labkit._rundir.read_layout`` reads it back). Standard library only: a rank imports it.
"""

from __future__ import annotations

import json
import os

from labkit import _rundir

#: Environment variable that tells each rank (and its entry point) its node, 0..nnodes-1.
NODE_ENV = "LABKIT_NODE"


def record_layout(run_dir: str) -> None:
    """Called by each rank's entry point: append where this rank runs to the layout file.

    Writes nothing with one node (``LABKIT_NODE`` unset).

    Example (labkit._rank.entry, before the script runs)::

        record_layout(_rundir.from_env())
    """
    env = os.environ
    if NODE_ENV not in env:
        return
    line = json.dumps({key: int(env.get(var, "0")) for key, var in (
        ("rank", "RANK"), ("node", NODE_ENV), ("local_rank", "LOCAL_RANK"),
        ("group_rank", "GROUP_RANK"), ("restart", "TORCHELASTIC_RESTART_COUNT"))} | {
        "pid": os.getpid()}) + "\n"
    fd = os.open(_rundir.layout_file(run_dir), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, line.encode())  # one small O_APPEND write: lines of ranks never mix
    finally:
        os.close(fd)
