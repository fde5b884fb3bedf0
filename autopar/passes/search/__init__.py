"""The search: from a captured Graph to one strategy per node.

``fold`` finds repeated layers, ``strategies`` lists each op's candidates (and resolves hints),
``build`` prices them into a ``Problem`` (``problem.py``: nodes, edges, ``evaluate``), ``merge``
folds followers into their producers, ``recipes``/``complete`` turn hand-written recipes into
complete choices, and ``solve``/``solve_axis`` (or ``propagate``) pick the plan.
"""
