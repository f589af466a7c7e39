"""``python -m labkit.handout``: a workshop's hand-out, the course without its answers.

The command ``make handout`` runs (README: For instructors). Standard library and git only,
so it runs with any Python 3.11; the work is in ``labkit._course.handout``.
"""

import sys

from labkit._course.handout import *  # noqa: F403 - the public names, where they always were
from labkit._course.handout import __all__, main  # noqa: F401

if __name__ == "__main__":
    sys.exit(main())
