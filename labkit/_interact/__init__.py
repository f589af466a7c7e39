"""Interactive: what the learner types and moves in the notebook, with ipywidgets.

Owns:
    predict   ``predict``, ``Prediction``, ``Grade``: a guess typed before a launch, graded
              against the measurement after it
    guesses   ``predictions``: the grades kept in run folders (``predictions.jsonl``), read back
    plan      ``plan_table``: memory per rank and bytes per step for each strategy, from
              ``labkit/_results/costs.py`` (the arithmetic the lessons check), its chart
    planner   ``planner``, ``Planner``: the same with sliders and menus (lessons 12, 13)
    boxes     the ipywidgets drawn, each with a plain-text fallback

Imported by the kernel only, and only when a lesson calls one of these names: ipywidgets and
IPython are imported inside the functions that draw, never when labkit is imported nor in a
rank (``tests/test_rundir.py``). Outside JupyterLab (nbmake, a terminal, ``python -c``) every
widget falls back to plain text.
"""
