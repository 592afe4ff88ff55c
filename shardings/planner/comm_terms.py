"""The estimate's communication terms (:mod:`shardings.planner.estimate`): each collective of a step by
``(kind, axis, phase)``, ring bytes as ``shardings.comms()`` counts them: the parameters' from each leaf's role
transitions, the activations' from the model's shape, the pipeline's carries from its schedule.
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction
from typing import Any

import torch

from shardings.pipeline import build
from shardings.planner import model_state
from shardings.planner.candidates import Candidate, layout_of
from shardings.planner.fake_step import PHASES
from shardings.planner.memory_terms import BUCKET_BYTES, DTYPES, stored_width
from shardings.spec import layouts

__all__ = ["Comm", "activation_comm", "overlapped", "param_rows", "pipeline_send_phases", "pipeline_sends"]

_RING = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "all_to_all": 1}




@functools.lru_cache(maxsize=1024)
def pipeline_sends(schedule: str, pp: int, microbatches: int, virtual_stages: int | None) -> tuple[int, int]:
    """``(messages in all, most messages one rank sends)`` per step: each stage boundary between two ranks
    carries every microbatch's activation forward and its gradient back."""
    s = build(schedule, pp, microbatches, virtual_stages=virtual_stages)
    crossing = [b for b in range(s.stages - 1) if s.rank_of(b) != s.rank_of(b + 1)]
    per_rank = [0] * pp
    for b in crossing:
        per_rank[s.rank_of(b)] += 1  # the activation forward
        per_rank[s.rank_of(b + 1)] += 1  # its gradient back
    return 2 * len(crossing) * microbatches, max(per_rank) * microbatches


@functools.lru_cache(maxsize=1024)
def pipeline_send_phases(schedule: str, pp: int, microbatches: int, virtual_stages: int | None) -> tuple[int, int]:
    """The busiest rank's messages per step (:func:`pipeline_sends`' second number) as ``(forward, backward)``:
    activations sent forward and gradients sent back (of the first such rank)."""
    s = build(schedule, pp, microbatches, virtual_stages=virtual_stages)
    per_rank = [[0, 0] for _ in range(pp)]
    for b in range(s.stages - 1):
        if s.rank_of(b) != s.rank_of(b + 1):
            per_rank[s.rank_of(b)][0] += microbatches  # the activation forward
            per_rank[s.rank_of(b + 1)][1] += microbatches  # its gradient back
    forward, backward = max(per_rank, key=sum)
    return forward, backward


def _sent(kind: str, n: int, nbytes: float) -> float:
    return _RING.get(kind, 1) * (n - 1) / n * nbytes if n > 1 else 0.0


class Comm:
    """Collectives by ``(kind, axis, phase)`` (:data:`~shardings.planner.fake_step.PHASES`): count, bytes sent."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, str, str], list[float]] = {}

    def add(self, kind: str, axis: str, phase: str, nbytes: float, count: float = 1.0, n: int | None = None) -> None:
        assert phase in PHASES, phase
        sent = nbytes if n is None else _sent(kind, n, nbytes)
        if sent <= 0:
            return
        row = self.rows.setdefault((kind, axis, phase), [0.0, 0.0])
        row[0] += count
        row[1] += sent

    def phases(self) -> dict[tuple[str, str, str], tuple[int, Fraction]]:
        return {k: (max(1, round(c)), Fraction(round(b))) for k, (c, b) in self.rows.items()}

    def frozen(self) -> dict[tuple[str, str], tuple[int, Fraction]]:
        """The rows summed over phases."""
        out: dict[tuple[str, str], list[float]] = {}
        for (kind, axis, _), (c, b) in self.rows.items():
            row = out.setdefault((kind, axis), [0.0, 0.0])
            row[0] += c
            row[1] += b
        return {k: (max(1, round(c)), Fraction(round(b))) for k, (c, b) in out.items()}


@functools.lru_cache(maxsize=65536)
def param_rows(model: Any, cfg: Any, layout: str, mesh: tuple[tuple[str, int], ...], precision: str, blocks: int,
                period: int, gathers_per_step: int, dtensor: bool) -> dict[tuple[str, str, str], tuple[float, float]]:
    """The parameter collectives' rows (:func:`_param_comm`), one per signature: microbatches only count under
    ZeRO-3 (its gathers per step), remat and the schedule not at all; ``dtensor``: the step's DTensor path."""
    compute, reduce = DTYPES[precision]
    stage = tuple((a, n) for a, n in mesh if a != "pp") or (("dp", 1),)
    comm = Comm()
    _param_comm(comm, model_state.leaves(model, cfg, layout, stage, period), blocks / period, dict(mesh), compute,
                reduce, gathers_per_step, layout_of(layout), dtensor)
    return {k: tuple(v) for k, v in comm.rows.items()}


def _param_comm(comm: Comm, leaves: model_state.Leaves, reps: float, sizes: dict[str, int],
                compute: torch.dtype | None, reduce: torch.dtype | None, gathers_per_step: int,
                layout: layouts.Layout, dtensor: bool) -> None:
    """Each leaf's collectives by phase: ZeRO-3's gathers in forward, a block's again in backward (not under ``pp``:
    once a step); gradient reductions in backward where the step reduces there (the local path's bucketed hooks,
    a ZeRO-3 gather's backward, the DTensor path's sharded grads: ``Leaf.in_backward``), else after backward (the
    update: ``pp`` reduces once after the schedule); the updated parameters' gather in the update."""
    master = model_state.keeps_master(leaves, compute)
    for group, k in ((leaves.edge, 1.0), (leaves.period, reps)):
        for leaf in group:
            width = compute.itemsize if compute and leaf.floating else leaf.itemsize
            stored = leaf.numel["params"] * stored_width(leaf, compute, master)
            grad = (reduce.itemsize if reduce and leaf.floating else leaf.itemsize) * leaf.numel["arrives"]
            full = leaf.numel["compute"] * width
            gathers = {"forward": gathers_per_step,
                       "backward": gathers_per_step if leaf.in_blocks and not layout.pipelined else 0}
            for a in leaf.gather:
                for phase, times in gathers.items():
                    comm.add("all_gather", a, phase, k * times * full, k * times * full / BUCKET_BYTES, sizes[a])
            shard = grad
            reduced = "backward" if not layout.pipelined and (not dtensor or leaf.in_backward) else "update"
            for a in _reduction_order(leaf, sizes, layout):
                comm.add("reduce_scatter" if a in leaf.scatter else "all_reduce", a, reduced, k * shard,
                         k * shard / BUCKET_BYTES, sizes[a])
                shard /= sizes[a] if a in leaf.scatter else 1
            for a in leaf.regather:  # updated shards gathered back in their stored dtype
                comm.add("all_gather", a, "update", k * stored, k * stored / BUCKET_BYTES, sizes[a])
            if "opt_state" in layout.host:  # gradient (and param, unless the master is there) blocks, both ways
                moved = leaf.numel["opt_state"] * leaf.itemsize
                back = leaf.numel["opt_state"] * stored_width(leaf, compute, master)
                comm.add("d2h", "host", "update", k * (moved if master else 2 * moved), k)
                comm.add("h2d", "host", "update", k * back, k)
            if "params" in layout.host:
                comm.add("h2d", "host", "update", k * stored, k)
                comm.add("d2h", "host", "update", k * stored, k)


def _reduction_order(leaf: model_state.Leaf, sizes: dict[str, int], layout: layouts.Layout) -> list[str]:
    """The data axes a gradient is reduced over, in order: in backward, scattered first and the shard all-reduced;
    under ``pp`` (reduced once after the schedule, one redistribute from ``Partial``) in mesh order, major first,
    so an HSDP gradient is all-reduced over ``dp`` whole before it is scattered over ``fsdp``."""
    if layout.pipelined:
        return [a for a in sizes if a in leaf.scatter or a in leaf.reduce]
    return [*leaf.scatter, *leaf.reduce]


def activation_comm(comm: Comm, cfg: Any, cand: Candidate, rows_mb: float, blocks: int, width: int, sp: bool,
                     layout: layouts.Layout) -> None:
    """Collectives of activations per step on one rank, by phase, from the model's shape (``dim``, heads, experts)."""
    t, c, m = cand.size("tp"), cand.size("cp"), cand.microbatches
    dim = getattr(cfg, "dim", 0)
    tokens = rows_mb * cfg.seq_len / c  # one microbatch's tokens on this rank
    residual = tokens * dim * width
    if t > 1:
        # per block and microbatch 2 in forward (attention's and the MLP's output), 2 in backward (their inputs'
        # gradients), and under remat the recomputation's up to the block's last saved tensor (not its output's);
        # plus the vocab-parallel edges: the embedding's output in forward, the head's input gradient in backward
        per, again = blocks * m, (blocks * m if cand.remat else 0)
        if sp:  # an all-gather (the sequence, into a column-parallel matmul) and a reduce-scatter in place of each
            for phase, gathers, scatters in (("forward", 2 * per + m, 2 * per + m),
                                             ("backward", 2 * per + m + 2 * again, 2 * per + m + again)):
                comm.add("all_gather", "tp", phase, gathers * residual, gathers, t)
                comm.add("reduce_scatter", "tp", phase, scatters * residual, scatters, t)
        else:
            for phase, n in (("forward", 2 * per + m), ("backward", 2 * per + m + again)):
                comm.add("all_reduce", "tp", phase, n * residual, n, t)
        comm.add("all_reduce", "tp", "forward", 3 * m * tokens * 4, 3 * m, t)  # the vocab-parallel loss's scalars
    if c > 1:  # not on the tested grid (ESTIMATE_TESTED): forward's passes, backward's of K/V and their gradients
        kv = tokens * max(1, getattr(cfg, "n_kv_heads", 1) // t) * getattr(cfg, "d_head", dim) * width * 2
        if "cp_allgather" in layout.presets:
            for phase in ("forward", "backward"):
                comm.add("all_gather", "cp", phase, blocks * m * kv * c, blocks * m, c)
            comm.add("reduce_scatter", "cp", "backward", blocks * m * kv * c, blocks * m, c)
        else:  # ring attention (shardings/ops/ring_attention.py): forward passes K/V c-1 times; backward sends
            # K/V with the dK/dV accumulators (fp32 at least) as one message c-1 times, then dK/dV home: c messages.
            # Not counted: 2 more sends a block each way (measured on fake tensors, gpt, cp2: 0.6-0.7 of the bytes
            # here are counted), which an exact run of the candidate corrects
            calls = blocks * m
            comm.add("ppermute", "cp", "forward", (c - 1) * calls * kv, (c - 1) * calls)
            grads = kv * max(width, 4) / width
            comm.add("ppermute", "cp", "backward", ((c - 1) * kv + c * grads) * calls, c * calls)
    if cand.size("ep") > 1 and getattr(cfg, "experts", 0):  # not on the tested grid: dispatch and combine, each way
        n, k, e = cand.size("ep"), getattr(cfg, "top_k", 1), cfg.experts
        factor = getattr(cfg, "capacity_factor", None)
        slots = cfg.seq_len if factor is None else math.ceil(factor * cfg.seq_len * k / e)
        buffer = rows_mb * e * slots * dim * width
        moe = blocks / getattr(cfg, "moe_every", 1)
        for phase in ("forward", "backward"):
            comm.add("all_to_all", "ep", phase, 2 * moe * m * buffer, 2 * moe * m, n)
    if t > 1 and cand.size("dp") > 1:  # per microbatch, the loss's per-token values (fp32) over dp, as measured
        n = cand.size("dp")
        comm.add("reduce_scatter", "dp", "backward", m * rows_mb * n * cfg.seq_len * 4, m, n)
    if cand.pipelined:  # the busiest rank's carries: activations sent forward, their gradients back
        for phase, sends in zip(("forward", "backward"),
                                pipeline_send_phases(cand.schedule, cand.size("pp"), m, cand.virtual_stages)):
            comm.add("send", "pp", phase, sends * residual / (t if sp else 1), sends)


def overlapped(rows: dict[tuple[str, str], Any], layout: layouts.Layout, cand: Candidate) -> frozenset:
    """Collectives the local path overlaps with compute: data-parallel reductions launched in backward, ZeRO-3's
    prefetched gathers (layouts that split only the batch, without ``pp``)."""
    if cand.pipelined or any(cand.size(a) > 1 for a in ("tp", "cp", "ep")):
        return frozenset()
    sharded = any(layouts.preset(p).layout.params.names for p in layout.presets)  # storage split: zero3, hsdp
    return frozenset(k for k in rows if k[1] in ("dp", "fsdp") and (k[0] != "all_gather" or sharded))
