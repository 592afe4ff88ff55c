"""Testing helpers for sharded code: equivalence against one device, and hypothesis strategies."""

from shardings.testing.equivalence import EquivalenceError, Report, Row, Tolerance, check_equivalence
from shardings.testing.strategies import layouts, meshes, specs

__all__ = ["EquivalenceError", "Report", "Row", "Tolerance", "check_equivalence", "layouts", "meshes", "specs"]
