"""Interactive: what the learner types and moves in the notebook, with ipywidgets.

Owns:
    predict   ``predict``, ``Prediction``, ``Grade``: a guess typed before a launch, graded
              against the measurement after it
    guesses   ``predictions``: the grades kept in run folders (``predictions.jsonl``), read back
    boxes     the ipywidgets drawn, each with a plain-text fallback

Imported by the kernel only, and only when a lesson calls one of these names: ipywidgets and
IPython are imported inside the functions that draw, never when labkit is imported nor in a
rank (``tests/test_rundir.py``). Outside JupyterLab (nbmake, a terminal, ``python -c``) every
widget falls back to plain text.
"""
