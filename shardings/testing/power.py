"""What a comparison can see: the per-leaf rule of a tree (floor, overrides, exclusions), and detection limits.

A comparison that passes says nothing unless it *could* have failed. :func:`detection_limit` measures how
small an error it catches: it plants a relative error ``ε`` in one leaf of the compared side (the value scaled
by ``1 + ε``, or for params the step's update scaled by ``1 + ε``), for ``ε`` down a ladder (:data:`LADDER`),
and records the smallest ``ε`` the rule still rejects. The planted values are the run's own, honest rounding
included, so the limit is that of this comparison, not of an idealized one.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

import torch

from core import tree
from shardings.testing.tolerance import ULPS, UPDATE_FRACTION, Diff, diff, largest, tolerance

__all__ = ["LADDER", "Judge", "Limit", "detection_limit", "summarize"]

# the planted relative errors, largest first: a limit is one of these (or inf: not even the first is caught)
LADDER = (1.0, 0.5, 0.2, 0.1, 0.05, 0.02, 0.01, 5e-3, 2e-3, 1e-3, 5e-4, 2e-4, 1e-4, 5e-5, 2e-5, 1e-5, 5e-6, 2e-6, 1e-6)


@dataclasses.dataclass(frozen=True)
class Limit:
    """The smallest relative error one run's comparison of a quantity catches, in any one leaf.

    ``limit`` is the largest over the leaves whose relative error means something (:meth:`Judge.counted`) of each
    leaf's smallest caught ``ε`` (over steps: the error is planted at every step); ``worst_path`` is that leaf;
    ``uncounted`` counts the leaves left out (at some step the rule could not tell them from zero, or, for
    params, their gradient: a relative error of rounding noise means nothing).
    """

    layout: str
    quantity: str  # "loss" | "grads" | "params"
    limit: float
    worst_path: str
    uncounted: int = 0
    median: float = math.inf  # the median over the counted leaves: what a typical leaf's rows catch


class Judge:
    """The rule for one reference tree: each leaf's tolerance (its ``ulps``, an override, the tree's floor)
    and slack, and which leaves are not compared.

    Args:
        want: the reference tree.
        terms, ulps, dtype: the rule's (:func:`shardings.testing.tolerance.tolerance`).
        slack: key path -> a per-element allowance added to the rule (``check_equivalence``'s optimizer noise).
        tolerances: key-path regex -> ulps for the leaves it matches (``re.search``; the first match wins).
        exclude: key-path regexes of leaves not compared.
        update: for params, key path -> the step's own update of the leaf (reference after minus before): the
            norm of the leaf's difference may not exceed :data:`~shardings.testing.tolerance.UPDATE_FRACTION` of
            the update's norm, plus the rounding of the params in their own dtype (the fp32 rule for fp32 master
            weights, whatever the compute dtype), whatever the rule and slack allow element by element.
        noise_driven: key paths whose update is driven by rounding (their gradient's truth is ~0): no cap.
    """

    def __init__(self, want: Any, *, terms: int = 1, ulps: float = ULPS, dtype: torch.dtype | None = None,
                 slack: dict[str, torch.Tensor] | None = None, tolerances: dict[str, float] | None = None,
                 exclude: Sequence[str] = (), update: dict[str, torch.Tensor] | None = None,
                 noise_driven: Sequence[str] = ()):
        leaves = {tree.keystr(p): torch.as_tensor(x).detach() for p, x in tree.leaves_with_path(want)}
        self.excluded = [k for k in leaves if any(re.search(rx, k) for rx in exclude)]
        self.want = {k: v for k, v in leaves.items() if k not in self.excluded}
        self.overridden = {k: next(u for rx, u in (tolerances or {}).items() if re.search(rx, k))
                           for k in self.want if any(re.search(rx, k) for rx in (tolerances or {}))}
        self.slack = slack or {}
        floor = largest(list(self.want.values()))
        self.tol = {k: tolerance(w, terms=terms, ulps=self.overridden.get(k, ulps), dtype=dtype, floor=floor)
                    for k, w in self.want.items() if w.numel()}
        self.noise_driven = set(noise_driven)
        self.cap = {k: UPDATE_FRACTION * _norm(u) + _norm(_allowed(self.want[k], tolerance(self.want[k], terms=terms)))
                    for k, u in (update or {}).items() if k in self.tol and k not in self.noise_driven}

    def leaf(self, key: str, got: Any) -> Diff:
        """``got`` against the reference leaf at ``key`` by its rule (and the update cap, for params)."""
        d = diff(got, self.want[key], self.tol.get(key), slack=self.slack.get(key))
        cap = self.cap.get(key)
        if cap is None or not math.isfinite(d.used):
            return d
        norm = _norm(torch.as_tensor(got).double() - self.want[key].double())
        used = max(d.used, norm / cap if norm else 0.0)
        return Diff(d.max_abs, d.rel_norm, used, used <= 1.0)

    def on_floor(self, key: str) -> bool:
        """Whether the rule cannot tell the leaf from zero: every element within its ``atol`` of 0 (the tree's
        floor, for a leaf whose truth is ~0). A relative error of such a leaf means nothing."""
        tol, w = self.tol.get(key), self.want[key]
        return tol is None or float(w.abs().max()) <= tol.atol

    def counted(self, key: str) -> bool:
        """Whether a relative error of the leaf means something: a params leaf whose update is capped, or a leaf
        the rule can tell from zero (and, for params, whose update is not rounding: its gradient not ~0)."""
        return key in self.cap or (not self.on_floor(key) and key not in self.noise_driven)


def _norm(x: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(x.detach().double()))


def _allowed(want: torch.Tensor, tol: Any) -> torch.Tensor:
    return tol.atol + tol.rtol * want.detach().double().abs()


def unknown_patterns(paths: Sequence[str], tolerances: dict[str, float] | None, exclude: Sequence[str]) -> list[str]:
    """The regexes of ``tolerances`` and ``exclude`` that match none of ``paths`` (a typo compares everything)."""
    return [rx for rx in [*(tolerances or {}), *exclude] if not any(re.search(rx, p) for p in paths)]


def detection_limit(judge: Judge, got: Any, before: Any = None, ladder: Sequence[float] = LADDER) -> dict[str, float]:
    """Per leaf whose relative error means something (:meth:`Judge.counted`), the smallest ``ε`` of ``ladder``
    whose planted error the rule rejects.

    Args:
        judge: the rule of the reference tree.
        got: the compared side's tree (one rank's).
        before: for params, the reference params before the step: the planted error scales the update,
            ``before + (1 + ε)·(got − before)``; ``None`` scales the value, ``(1 + ε)·got``.
        ladder: the planted errors, largest first.

    Returns:
        ``{key path: ε}`` (``inf`` where even the largest is not caught).
    """
    got_leaves = {tree.keystr(p): torch.as_tensor(x).detach() for p, x in tree.leaves_with_path(got)}
    base = {tree.keystr(p): torch.as_tensor(x).detach() for p, x in tree.leaves_with_path(before)} if before else {}
    out = {}
    for key in judge.want:
        if key not in got_leaves or not judge.counted(key):
            continue
        g = got_leaves[key].double()
        b = base[key].double() if key in base else torch.zeros_like(g)
        caught = math.inf
        for eps in ladder:
            if judge.leaf(key, b + (g - b) * (1 + eps)).ok:
                break
            caught = eps
        out[key] = caught
    return out


def summarize(layout: str, caught: dict[str, dict[str, float]], uncounted: dict[str, set[str]]) -> list[Limit]:
    """One :class:`Limit` per quantity of a run: ``caught[quantity][leaf]`` is the leaf's smallest caught ``ε``
    over the steps, ``uncounted[quantity]`` the leaves left out at some step."""
    out = []
    for quantity, by_leaf in caught.items():
        counted = {leaf: eps for leaf, eps in by_leaf.items() if leaf not in uncounted[quantity]}
        if counted:
            leaf = max(counted, key=counted.get)
            median = sorted(counted.values())[len(counted) // 2]
            out.append(Limit(layout, quantity, counted[leaf], leaf or "<scalar>", len(uncounted[quantity]), median))
    return out
