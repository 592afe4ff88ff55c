"""The benchmarks' module names before they moved into ``experiments/bench/`` (#28): deprecated, kept one release.

Each old module (``experiments/bench_jit.py``, ...) is one call to :func:`forward`. Imported, the old name *is*
the new module (``experiments.native_gpt is experiments.bench.native_gpt``, so patching either patches both);
run with ``python -m``, it runs the new module's ``main`` with the same arguments. Either way a
``DeprecationWarning`` names the new module.
"""

from __future__ import annotations

import importlib
import sys
import warnings

__all__ = ["MOVED", "forward"]

MOVED = {  # old module -> new module
    "experiments.bench_jit": "experiments.bench.jit",
    "experiments.bench_optim": "experiments.bench.optim",
    "experiments.bench_pipeline": "experiments.bench.pipeline",
    "experiments.bench_pipeline_torch": "experiments.bench.pipeline_torch",
    "experiments.bench_random": "experiments.bench.random_normal",
    "experiments.native_gpt": "experiments.bench.native_gpt",
}


def forward(old: str, *, run: bool) -> None:
    """Stand the old module ``old`` in for its new one: run its ``main`` (``run``) or alias it in ``sys.modules``.

    Args:
        old: the old module's name (its ``__spec__.name``, also under ``python -m``).
        run: whether the old module runs as ``__main__``.
    """
    new = MOVED[old]
    how = f"python -m {new}" if run else f"import {new}"
    # stacklevel: under python -m the old module's own line (shown: __main__ warns by default), else the importer's
    warnings.warn(f"{old} is deprecated and goes in the next release: use {new} ({how})", DeprecationWarning,
                  stacklevel=2 if run else 3)
    module = importlib.import_module(new)
    if not run:
        sys.modules[old] = module
    elif hasattr(module, "main"):  # native_gpt is a model, not a benchmark: nothing to run
        module.main()
