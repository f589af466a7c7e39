"""The course around the lessons: the exercises' checks and hints, and the instructors' tools.

Owns:
    checks     one module per exercise (``checks/exNN_<name>.py``), found by its file name:
               ``labkit.check_<name>``
    feedback   what a check says (findings, its stop signal, ``@check``)
    attempt    a check's launch, and a failed launch said in words (``launched``)
    hints      ``labkit.hint``: the progressive hints
    exercises  ``exercises/`` generated from ``solutions/``, and restored (``python -m
               labkit.exercises``)
    handout    a workshop's hand-out on its own branch (``python -m labkit.handout``)
    git        git plumbing for the hand-out, without a work tree
    folder     the course folder, found from where you are

Imported by: ``import labkit`` itself (in every rank too) reads the names of the check modules,
so this ``__init__`` and ``checks/__init__`` are standard library only and import nothing
heavy; the rest by the kernel, and ``handout`` by a bare Python (``make handout``).
"""
