"""One tolerance rule for every comparison with a reference: what floating point can promise.

Two computations of the same value that add in different orders (another matmul kernel, a sum
split over ranks, a reduction reassociated by a collective) differ by rounding. That difference
does not scale with each element's own magnitude — a logit near 0 can come out 1e-6 off while
its neighbours of size 1 agree to the last bit — but with the magnitude of what was *added* to
make it, and it grows with the number of terms. So the rule is

    |got − want| ≤ rtol · (|want| + max|want|),   rtol = ulps · eps(dtype) · √terms

elementwise, per tensor: a relative part for the large elements and an absolute floor
proportional to the tensor's largest magnitude for the small ones. ``terms`` is the longest
chain of additions behind one element (a matmul's contraction length, the tokens summed into a
gradient); rounding errors of sums in different orders grow like its square root. ``ulps``
(default :data:`ULPS`) is the margin over that estimate: across this project's suite the worst
comparison used 0.6 of the allowed difference (an AdamW equivalence run after two steps) and
parity tests of one forward used at most 0.25. A fixed ``atol=1e-6`` only held for the examples
drawn so far; this rule scales with the reference instead.

**Low precision** (``check_equivalence(precision=Policy(compute_dtype=torch.bfloat16))``): eps is the
compute or reduce dtype's, whichever is coarser, ``terms`` is 1 and ``ulps`` is :data:`LOW_PRECISION_ULPS`'s
(8 for bf16, 16 for fp16): rtol = 8·2⁻⁷ ≈ 6.3% in bf16, 16·2⁻¹⁰ ≈ 1.6% in fp16. Why no √terms: bf16 and fp16
matmuls accumulate in fp32 and round once, and the sums over ranks and microbatches run in the reduce dtype,
so the two sides differ by a few roundings of each *result*, not by rounding noise growing with the sum's
length; √terms (11 for 128 tokens) would let a 2× error through. Why these margins, measured as the share of
8 ulps the worst comparison used: across the layouts of ``tests/shardings/step/test_mixed_precision.py`` (dp,
ZeRO-1/2/3, tp, sp, cp, ep, pp, with accumulation and clipping, 3 AdamW steps) 0.51 in bf16 and 0.78 in fp16,
and 0.97 in fp16 on ``models.mlp`` (a model the suite does not use): the params after AdamW, whose m/√v turns
a gradient's rounding near zero into a learning-rate-sized step. fp16 rounds 8× finer than bf16, but the
fp32 parts of the step weigh more against its smaller eps; each dtype keeps a 2× margin over its worst.
What it cannot see: an error below a few percent in bf16 (about 1.5% in fp16). So ``check_equivalence`` also
runs each layout's fp32 twin (the policy with fp32 compute), judged by the fp32 rule, which catches a 1% error;
every run's report states its detection limits (``shardings.testing.power``); and a wrong reduction (a rank's
share missing, a sum taken twice) is ≥ 50% and fails in bf16 too. The params rows get one more bound there:
``UPDATE_FRACTION`` below (``check_equivalence``).

**Where the truth is zero: the floor.** A leaf of a tree whose reference is exactly (or nearly) zero — a
key bias ``bk``, whose gradient softmax's shift invariance makes exactly 0, or attention over one key — is
still *computed* from values that are not: terms that cancel. Its rounding is that of the values that
reach it, not of its own size (0), so judging it by its own size fails every layout on rounding noise.
Which values reach a leaf depends on the model; what holds for any model is that every leaf of a tree is
made in the same computation (one forward and backward) from values of the size of those behind the tree's
largest element, and a sum that cancels to ~0 is as exact as its terms: off by a few ulps of them, however
many there are (n terms of size a cancel with error ~eps·a·√n, and the tree's largest value is at least
~a·√n). So every leaf also gets an absolute floor of :data:`FLOOR_ULPS` (8) ulps of the tree's largest
magnitude: ``atol ≥ 8 · eps · max|tree|``, without √terms. A leaf of the tree's own scale never notices it
(its ``atol`` is ``32·√terms`` ulps of itself); a near-zero leaf is judged on it. Measured: the CPU flash
kernel's gradient for attention over one key (exactly 0 in the reference) came out 0.95 ulp of the tree's
largest value, 12% of the floor; the BERT-style encoder's ``bk`` (docs/models.md) 0.002 ulp. What it
costs: a 1% error is no longer caught by a leaf's own rows when its largest value is below ``100 · 8 ·
eps`` (9.5e-5 in fp32) of the tree's largest — the encoder's smallest nonzero gradient (``bq``, 3.4e-4 of
the largest) keeps it, at 3.5× its allowance. :func:`assert_close` on a tree applies the floor leaf by leaf;
on one tensor it changes nothing (the tensor is its own tree, and 8 ulps are below its 32·√terms).

The rule stays strict: a one-ulp difference in every element passes, and a 1e-3 relative error
in one element of a tensor's typical magnitude fails (``tests/shardings/testing/test_tolerance.py``), so
does a 1% error in a gradient.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from core import tree

__all__ = ["FLOOR_ULPS", "LOW_PRECISION_ULPS", "ULPS", "UPDATE_FRACTION", "Diff", "Tolerance", "assert_close", "diff",
           "largest", "tolerance"]

ULPS = 32.0
# the floor every leaf of a tree gets: this many ulps of the tree's largest magnitude (module docstring)
FLOOR_ULPS = 8.0
# check_equivalence's params rows: a leaf's params may differ from the reference's by at most this fraction of the
# norm of the step's own update to it (plus the rule), whatever the optimizer-noise allowance gives each element
UPDATE_FRACTION = 0.5
# the margin under a bf16/fp16 policy, with terms=1, by the coarser of its compute and reduce dtypes (module docstring)
LOW_PRECISION_ULPS = {torch.bfloat16: 8.0, torch.float16: 16.0}


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """``|got − want| ≤ rtol·|want| + atol`` elementwise (see :func:`tolerance` for the values)."""

    rtol: float
    atol: float


def _eps(x: torch.Tensor, dtype: torch.dtype | None) -> float:
    dtype = dtype or (x.dtype if x.is_floating_point() else torch.float32)
    return torch.finfo(dtype).eps


def tolerance(want: torch.Tensor, *, terms: int = 1, ulps: float = ULPS, dtype: torch.dtype | None = None,
              magnitude: float | None = None, floor: float | None = None) -> Tolerance:
    """The tolerance for comparing a computed tensor with the reference ``want``.

    Args:
        want: the reference value.
        terms: the longest chain of additions behind one element (>= 1).
        ulps: the margin, in units of ``eps(dtype)·√terms``.
        dtype: the precision the values were computed in (default ``want``'s floating dtype, fp32 for integers).
        magnitude: the size of the values added to make ``want``, when larger than ``max|want|`` (a
            difference of large terms that cancels: ``a - b`` is only as exact as ``max(|a|, |b|)``).
        floor: the largest magnitude of the tree ``want`` belongs to (:func:`largest`): ``atol`` is at least
            :data:`FLOOR_ULPS` ulps of it (module docstring: where the truth is zero).

    Returns:
        ``Tolerance(rtol, atol)`` with ``rtol = ulps·eps·√terms`` and
        ``atol = max(rtol·max(max|want|, magnitude), FLOOR_ULPS·eps·floor)``.

    >>> tolerance(torch.tensor([1.0, -4.0]), terms=4).atol == 4 * tolerance(torch.tensor([1.0]), terms=4).rtol
    True
    >>> tolerance(torch.zeros(3), floor=2.0).atol == FLOOR_ULPS * torch.finfo(torch.float32).eps * 2.0
    True
    """
    if terms < 1:
        raise ValueError(f"tolerance: terms must be >= 1, got {terms}. Fix: pass the reduction length (1 for none).")
    eps = _eps(want, dtype)
    rtol = ulps * eps * math.sqrt(terms)
    scale = float(want.detach().abs().max()) if want.numel() else 0.0
    return Tolerance(rtol=rtol, atol=max(rtol * max(scale, magnitude or 0.0), FLOOR_ULPS * eps * (floor or 0.0)))


def largest(tree_: Any) -> float:
    """The largest finite magnitude among the floating leaves of a tree (0 for none): the floor's scale.

    >>> largest({"a": torch.tensor([1.0, -3.0]), "b": [torch.zeros(2)]})
    3.0
    """
    scales = [float(torch.nan_to_num(x.detach().abs(), posinf=0.0).max()) for x in tree.leaves(tree_)
              if isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel()]
    return max(scales, default=0.0)


@dataclasses.dataclass(frozen=True)
class Diff:
    """How far ``got`` is from ``want``: max abs difference, relative norm, and the verdict.

    ``used`` is the largest fraction of the allowed difference any element used (``ok`` iff ``<= 1``).
    """

    max_abs: float
    rel_norm: float
    used: float
    ok: bool


def diff(got: torch.Tensor, want: torch.Tensor, tol: Tolerance | None = None, *,
         slack: torch.Tensor | None = None, **kw: Any) -> Diff:
    """Compare two tensors by the rule (``tol`` given, or :func:`tolerance` of ``want`` with ``kw``).

    ``slack`` (same shape as ``want``) adds a per-element allowance on top of the rule, for a
    difference the computation is known to amplify (see ``check_equivalence``'s optimizer noise).
    A shape mismatch, or a NaN/inf where the reference has none, never passes.
    """
    got_t, want_t = torch.as_tensor(got).detach(), torch.as_tensor(want).detach()
    if got_t.shape != want_t.shape:
        return Diff(math.inf, math.inf, math.inf, False)
    tol = tol or tolerance(want_t, **kw)
    a, b = got_t.double(), want_t.double()
    if not a.numel():
        return Diff(0.0, 0.0, 0.0, True)
    same_nonfinite = (a == b) | (a.isnan() & b.isnan())
    err = torch.where(same_nonfinite, torch.zeros_like(a), (a - b).abs())
    if not bool(err.isfinite().all()):
        return Diff(math.inf, math.inf, math.inf, False)
    allowed = tol.atol + tol.rtol * torch.where(b.isfinite(), b.abs(), torch.zeros_like(b))
    if slack is not None:
        allowed = allowed + slack.detach().double().abs()
    used = torch.where(err == 0, torch.zeros_like(err), err / allowed.clamp_min(torch.finfo(torch.float64).tiny))
    norm = float(torch.linalg.vector_norm(torch.where(b.isfinite(), b, torch.zeros_like(b))))
    rel_norm = float(torch.linalg.vector_norm(err)) / norm if norm else (0.0 if not err.any() else math.inf)
    worst = float(used.max())
    return Diff(float(err.max()), rel_norm, worst, worst <= 1.0)


def assert_close(got: Any, want: Any, *, terms: int = 1, ulps: float = ULPS, dtype: torch.dtype | None = None,
                 magnitude: float | None = None, msg: str = "") -> None:
    """Assert two tensors (or two trees of tensors, leaf by leaf) agree by the rule.

    Trees must have the same structure; the message names the first failing key path. Each leaf also gets
    the floor of ``want``'s largest magnitude (:func:`tolerance`'s ``floor``): a leaf whose reference is 0
    beside leaves that are not is judged by the rounding of the values that made them.

    Raises:
        AssertionError: a structure mismatch or a leaf past tolerance.

    >>> assert_close(torch.tensor([1.0, 1e-9]), torch.tensor([1.0, 0.0]))  # the floor absorbs rounding near 0
    """
    got_leaves, want_leaves = tree.leaves_with_path(got), tree.leaves_with_path(want)
    got_paths = [tree.keystr(p) for p, _ in got_leaves]
    want_paths = [tree.keystr(p) for p, _ in want_leaves]
    if got_paths != want_paths:
        raise AssertionError(f"{msg}{': ' if msg else ''}tree structures differ: got {got_paths}, want {want_paths}")
    floor = largest(want)
    for path, (_, g), (_, w) in zip(got_paths, got_leaves, want_leaves):
        w_t = torch.as_tensor(w)
        tol = (tolerance(w_t, terms=terms, ulps=ulps, dtype=dtype, magnitude=magnitude, floor=floor)
               if w_t.numel() else None)
        d = diff(g, w_t, tol)
        if not d.ok:
            where = f" at {path}" if path else ""
            shapes = f" (shapes {tuple(torch.as_tensor(g).shape)} vs {tuple(w_t.shape)})"
            shape = shapes if d.max_abs == math.inf else ""
            raise AssertionError(
                f"{msg}{': ' if msg else ''}not close{where}{shape}: max abs diff {d.max_abs:.3e}, relative norm "
                f"{d.rel_norm:.3e}, {d.used:.2f}x the allowed difference (rtol = {ulps:g} ulps · √{terms})"
            )
