"""``python -m labkit.exercises generate | check | restore NN``: ``exercises/`` from ``solutions/``.

The command the README and the Makefile name (``make exercises``, ``make restore EX=02``), and
its functions (``labkit.exercises.generate``, ``restore``, ...); they live in
``labkit._course.exercises``.

Example (a terminal in the course folder)::

    python -m labkit.exercises restore 02     # exercises/02_ddp.ipynb as handed out
"""

import sys

from labkit._course.exercises import *  # noqa: F403 - the public names, where they always were
from labkit._course.exercises import __all__, main  # noqa: F401

if __name__ == "__main__":
    sys.exit(main())
