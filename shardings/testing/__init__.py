"""Testing helpers for sharded code: equivalence against one device, the tolerance rule, what a comparison can see
(detection limits), hypothesis strategies.

The strategies (``meshes``, ``specs``, ``layouts``) need ``hypothesis`` (a dev dependency) and are
imported on first use, so ``import shardings`` works without it.

May import: everything in ``shardings``, through its public surface too (the top of the import order).
"""

from typing import Any

from shardings.testing.equivalence import EquivalenceError, check_equivalence, check_runs, compare_trees
from shardings.testing.many import check_equivalences
from shardings.testing.power import Limit
from shardings.testing.report import Report, Row
from shardings.testing.tolerance import LOW_PRECISION_ULPS, ULPS, Diff, Tolerance, assert_close, diff, tolerance

__all__ = [
    "LOW_PRECISION_ULPS",
    "ULPS",
    "Diff",
    "EquivalenceError",
    "Limit",
    "Report",
    "Row",
    "Tolerance",
    "assert_close",
    "check_equivalence",
    "check_equivalences",
    "check_runs",
    "compare_trees",
    "diff",
    "layouts",
    "meshes",
    "specs",
    "tolerance",
]

_STRATEGIES = ("layouts", "meshes", "specs")


def __getattr__(name: str) -> Any:
    if name in _STRATEGIES:
        from shardings.testing import strategies

        return getattr(strategies, name)
    raise AttributeError(f"module 'shardings.testing' has no attribute {name!r}")
