"""Several equivalence checks, each its own model, mesh and options, run on real ranks in one launch per world
size: what compiled checks need (``jit=True`` runs on real ranks only, and a launch costs ~8 s before the
compiler's own warm-up), so that a property test's draws share their processes."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from shardings.testing.equivalence import check_equivalence, judge, plan, raise_if_failed
from shardings.testing.report import Report
from shardings.testing.sharded_runs import runners

__all__ = ["check_equivalences"]


def check_equivalences(checks: Mapping[str, Mapping[str, Any]], *, runtime: str = "multiprocess",
                       raise_on_failure: bool = True) -> dict[str, Report]:
    """:func:`~shardings.testing.check_equivalence` of each of ``checks`` (by name: its arguments, as keywords),
    their layouts' runs grouped by the number of ranks their mesh has: one launch per group runs them all in turn.

    Every check is judged as :func:`check_equivalence` judges it (its reference, rule, detection limits).

    Args:
        checks: name -> ``check_equivalence``'s arguments (``init``, ``loss``, ``axes``, ``cfg``, ``batch``,
            ``layouts``, ``mesh`` and any of its options), less ``runtime`` and ``raise_on_failure``.
        runtime: ``"multiprocess"`` (one launch per world size) or ``"simulate"``.
        raise_on_failure: raise :class:`~shardings.testing.EquivalenceError` for the first check (in ``checks``'
            order) that fails, named, with its table, once every check has been judged.

    Returns:
        name -> its :class:`Report`.

    >>> reports = check_equivalences({"zero3": dict(init=gpt.init, loss=gpt.loss, axes=gpt.axes, cfg=cfg,
    ...     batch=batch, layouts=["zero3"], mesh=Mesh(dp=4), optimizer=adamw)})  # doctest: +SKIP
    """
    signature = inspect.signature(check_equivalence)
    planned = {}
    for name, check in checks.items():
        bound = signature.bind(**check)
        bound.apply_defaults()
        options = {k: v for k, v in bound.arguments.items() if k not in ("runtime", "raise_on_failure")}
        planned[name] = plan(**options)
    by_size: dict[int, dict[str, tuple]] = {}  # world size -> {"check: run": job}; a job's mesh is its [-2]
    for name, p in planned.items():
        for run, job in p.jobs().items():
            by_size.setdefault(job[-2].size, {})[f"{name}: {run}"] = job
    runs = {}
    for jobs in by_size.values():
        runs.update(runners(runtime, jobs))
    reports = {name: judge(p, {run: runs[f"{name}: {run}"] for run in p.jobs()}) for name, p in planned.items()}
    if raise_on_failure:
        for name, report in reports.items():
            raise_if_failed(report, f" on {checks[name]['mesh']!r} (check {name!r})")
    return reports
