"""The exercises' checks: run (or read) the learner's launch and say, in words, what is right and wrong.

Each ``check_*`` takes the exercise's script (it launches it, showing every rank's output) or
a finished Run, and returns a Feedback (``_feedback.py``). It never raises for a mistake in
the learner's code: a TODO not done yet, an exception in a rank or a wrong number all become
findings. Each check reads what the exercise's script logs outside its TODO regions.

Used by the notebooks in ``exercises/`` and ``solutions/``::

    labkit.check_ddp("scripts/ex02_ddp.py")

One module per exercise (``basics`` holds 00 to 02); ``_common`` holds what they share.
"""

from labkit._checks.accumulation import check_accumulation
from labkit._checks.basics import check_ddp, check_hello, check_training_loop
from labkit._checks.fsdp import check_fsdp
from labkit._checks.resume import check_resume
from labkit._checks.syncbn import check_syncbn

__all__ = ["check_hello", "check_training_loop", "check_ddp", "check_syncbn", "check_accumulation",
           "check_resume", "check_fsdp"]
