"""The estimate's memory terms (:mod:`shardings.planner.estimate`): the model state's bytes per role, exact from each
leaf's specs (what the step's ``metrics["memory"]`` counts), and a step's saved activations and transient buffers,
estimated from the model's one-device profile and the layout.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

import core
from shardings.comm.buckets import DEFAULT_BUCKET_MB
from shardings.planner import model_state
from shardings.planner.candidates import Candidate, layout_of
from shardings.planner.model_profile import Profile
from shardings.spec import layouts

__all__ = ["AWAITING_W", "AWAITING_W_REMAT", "BUCKET_BYTES", "DTYPES", "buffer_bytes", "cached_state",
           "gradient_bytes", "model_state_memory", "reduction_copy", "saved_bytes", "state_bytes", "stored_width"]

DTYPES = {n: (m().compute_dtype, m().reduce_dtype) if m else (None, None) for n, m in core.precision.NAMED.items()}
BUCKET_BYTES = int(DEFAULT_BUCKET_MB * 2**20)  # bytes per bucketed collective, the step's default

# What a microbatch awaiting W holds, in forwards' saved activations (without remat): its weight ops' inputs and the
# output gradients B recorded for them (at most 2); under remat also what B's recomputation saved, kept for W (an
# upper bound: exact / estimated peak 0.93 for zero1+pp zb_h1 m4, 0.89 bf16 zero2+pp zb_h1 m4, 0.54 zero3+pp zb_v
# m4; the three zero-bubble remat cases of tests/shardings/planner/test_estimate_terms.py hold it to ESTIMATE_BOUNDS).
AWAITING_W, AWAITING_W_REMAT = 2.0, 3.5


@functools.lru_cache(maxsize=65536)
def model_state_memory(model: Any, cfg: Any, layout: str, mesh: tuple[tuple[str, int], ...], precision: str,
                       blocks: int, period: int, optimizer: Any) -> dict[str, float]:
    """Device bytes per rank of the model state (params, compute copy, grads, optimizer state) of a layout on a mesh
    with ``blocks`` blocks on the busiest rank: exact (per-leaf specs), the same numbers :func:`estimate` reports,
    without the rest of it. Shared by every candidate with the same signature (microbatches, schedule and remat
    do not change it), so the search drops what cannot fit before estimating anything else."""
    stage = tuple((a, n) for a, n in mesh if a != "pp") or (("dp", 1),)
    state = cached_state(model, cfg, layout, stage, precision, blocks, period, optimizer)
    host = layout_of(layout).host
    return {r: (0.0 if r in host else state[r]) for r in ("params", "compute", "grads", "opt_state")}


@functools.lru_cache(maxsize=65536)
def cached_state(model: Any, cfg: Any, layout: str, stage: tuple[tuple[str, int], ...], precision: str, blocks: int,
                  period: int, optimizer: Any) -> dict[str, float]:
    compute, reduce = DTYPES[precision]
    leaves = model_state.leaves(model, cfg, layout, stage, period)
    return state_bytes(leaves, blocks / period, compute, reduce, model_state.optimizer_factor(optimizer))


def stored_width(leaf: model_state.Leaf, compute: torch.dtype | None, master: bool) -> int:
    """Bytes per element of a leaf's stored params: the compute copy's when the master lives in the state."""
    return compute.itemsize if master and leaf.floating else leaf.itemsize


def state_bytes(leaves: model_state.Leaves, reps: float, compute: torch.dtype | None, reduce: torch.dtype | None,
           factor: float) -> dict[str, float]:
    out = dict.fromkeys(("params", "compute", "grads", "opt_state", "opt_bytes"), 0.0)
    master = model_state.keeps_master(leaves, compute)  # ZeRO-1/2 + policy: the fp32 master sharded with the state
    for group, k in ((leaves.edge, 1.0), (leaves.period, reps)):
        for leaf in group:
            size = leaf.itemsize
            out["params"] += k * leaf.numel["params"] * stored_width(leaf, compute, master)
            if compute is not None and leaf.floating and not master:
                out["compute"] += k * leaf.numel["params"] * compute.itemsize
            out["grads"] += k * leaf.numel["held"] * (reduce.itemsize if reduce and leaf.floating else size)
            out["opt_state"] += k * leaf.numel["opt_state"] * size * (factor + (master and leaf.floating))
            out["opt_bytes"] += k * leaf.numel["opt_state"] * size
    return out


def saved_bytes(prof: Profile, blocks: int, rows_mb: float, t: int, c: int, sp: bool, in_flight: int) -> float:
    def split(part: Any) -> float:
        rest = part.saved - part.saved_residual
        return (part.saved_residual / (t if sp else 1) + rest / t) / c

    return (split(prof.block) * blocks * in_flight + split(prof.edge)) * rows_mb


def buffer_bytes(leaves: model_state.Leaves, reps: float, compute: torch.dtype | None, layout: layouts.Layout,
             cand: Candidate, prof: Profile, rows_mb: float, split: int) -> float:
    """Gathered parameters and transient gradients: ZeRO-3 holds two blocks gathered (one prefetched) and their
    gradients, or under ``pp`` the whole stage gathered for the step; a remat block's activations in backward.
    Under ``pp`` a rank also holds its stage's unreduced gradients (compute layout, compute dtype: the microbatches
    accumulate them) until their reduction after the schedule ends (:func:`reduction_copy`)."""
    def gathered(group: Any, k: float) -> float:
        return sum(k * leaf.numel["compute"] * (compute.itemsize if compute and leaf.floating else leaf.itemsize)
                   for leaf in group if leaf.gather)

    block = gathered(leaves.period, 1.0 / leaves.period_blocks)
    out = gathered(leaves.edge, 1.0) + (gathered(leaves.period, reps) if cand.pipelined else 4 * block)
    if cand.pipelined:
        out += gradient_bytes(leaves, reps, compute)
    if cand.remat:
        out += prof.block.saved * rows_mb / split  # one block's activations, recomputed in backward
    return out


def gradient_bytes(leaves: model_state.Leaves, reps: float, dtype: torch.dtype | None, role: str = "compute") -> float:
    """Bytes of a pipelined rank's unreduced gradients (compute layout) in ``dtype``; ``role="held"``: as the step
    holds them (``Leaf.numel``)."""
    size = lambda leaf: leaf.numel[role] * (dtype.itemsize if dtype and leaf.floating else leaf.itemsize)
    return sum(size(leaf) for leaf in leaves.edge) + reps * sum(size(leaf) for leaf in leaves.period)


def reduction_copy(leaves: model_state.Leaves, reps: float, dtype: torch.dtype | None) -> float:
    """The transient of a pipelined rank's gradient reduction after the schedule (its activations freed by then):
    one bucket's flat copy in reduce dtype (``shardings.comm.buckets.reduce`` casts a bucket at a time), the larger
    of a bucket and the largest gradient, at most all of them."""
    largest = max(gradient_bytes(model_state.Leaves((leaf,), (), 1), 0, dtype)
                  for leaf in (*leaves.edge, *leaves.period))
    return min(max(BUCKET_BYTES, largest), gradient_bytes(leaves, reps, dtype))
