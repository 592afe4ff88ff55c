"""Fault drills (``python -m experiments.drill``, ``make drill``): faults x layout families on real gloo ranks,
each against an uninterrupted run of the same job; a table of what struck, how fast every rank exited, the error,
the steps lost and whether the restarted job ended bitwise equal.

Modules: :mod:`.families` (the jobs), :mod:`.faults` (what a rank plants), :mod:`.harness` (one drill),
:mod:`.table` (CSV and Markdown), ``__main__`` (the matrix and the CLI); :mod:`.mlp` and :mod:`.moe` are the
drill model modules.
"""
