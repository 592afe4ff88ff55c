"""What check_equivalence reports: a row per comparison, the detection limits, the overridden and excluded leaves."""

from __future__ import annotations

import dataclasses
import math

from shardings.testing.power import Limit

__all__ = ["Report", "Row"]


@dataclasses.dataclass(frozen=True)
class Row:
    """One comparison: a quantity of one layout at one step."""

    layout: str
    step: int
    quantity: str  # "loss" | "grads" | "params"
    max_abs: float
    rel_norm: float  # the worst leaf's ‖got − want‖ / ‖want‖
    used: float  # the largest fraction of the allowed difference any element used (ok iff <= 1)
    worst_path: str
    ok: bool


@dataclasses.dataclass
class Report:
    """Every comparison made by :func:`check_equivalence`, what each run's comparison can see, and its overrides.

    ``limits``: per run and quantity, the smallest relative error in one leaf the comparison catches
    (:mod:`shardings.testing.power`). ``overridden``: key path -> the ulps a ``tolerances`` pattern gave it;
    ``excluded``: the key paths an ``exclude`` pattern took out of every comparison.
    """

    rows: list[Row]
    limits: list[Limit] = dataclasses.field(default_factory=list)
    overridden: dict[str, float] = dataclasses.field(default_factory=dict)
    excluded: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)

    def worst(self) -> Row:
        """The failing row with the largest excess (or the largest difference when all pass)."""
        return max(self.rows, key=lambda r: r.used)

    def limit(self, layout: str, quantity: str) -> float:
        """The detection limit of one run's quantity (``inf`` when not measured)."""
        return next((x.limit for x in self.limits if (x.layout, x.quantity) == (layout, quantity)), math.inf)

    def table(self) -> str:
        """A text table: layout, step, quantity, max abs difference, relative norm, tolerance used, verdict;
        then the detection limits, and the leaves whose tolerance was overridden or that were not compared."""
        width = max([18, *(len(r.layout) for r in self.rows)])
        head = (f"{'layout':<{width}} {'step':>4} {'quantity':<8} {'max_abs':>10} {'rel_norm':>10} {'used':>7}  "
                f"{'':4} worst path")
        lines = [head, "-" * len(head)]
        for r in self.rows:
            lines.append(f"{r.layout:<{width}} {r.step:>4} {r.quantity:<8} {r.max_abs:>10.3e} {r.rel_norm:>10.3e} "
                         f"{r.used:>7.3f}  {'ok' if r.ok else 'FAIL':4} {r.worst_path}")
        if self.limits:
            lines += ["", "detection limit: the smallest relative error in one leaf (at every step) that fails, in any "
                          "leaf (limit) and in the median leaf",
                      f"{'layout':<{width}} {'quantity':<8} {'limit':>7} {'median':>7}  set by"]
            lines += [f"{x.layout:<{width}} {x.quantity:<8} {_eps_text(x.limit):>7} {_eps_text(x.median):>7}  "
                      f"{x.worst_path}" + (f" ({x.uncounted} leaves within rounding of 0 not counted)" if x.uncounted
                                           else "") for x in self.limits]
        if self.overridden:
            lines.append("tolerance overridden: " + ", ".join(f"{k} ({u:g} ulps)" for k, u in self.overridden.items()))
        if self.excluded:
            lines.append("not compared (excluded): " + ", ".join(self.excluded))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _eps_text(eps: float) -> str:
    return "none" if eps == math.inf else f"{eps:.0e}" if eps < 0.01 else f"{eps:g}"
