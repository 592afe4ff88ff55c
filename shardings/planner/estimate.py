"""The quick estimate of a candidate, for every candidate of a search: formulas over exact per-leaf counts.

Model state is exact: each leaf's bytes per role come from its specs (:mod:`shardings.planner.model_state`),
as the train step's ``metrics["memory"]`` counts them. The rest is estimated, in microseconds, so that tens of
thousands of candidates can be ranked before the best few are run on fake tensors
(:mod:`shardings.planner.exact`):

- parameter collectives from each leaf's role transitions, ring bytes as ``shardings.comms()`` counts them:
  ZeRO-3 gathers (forward, and again in backward for the blocks; once per step under ``pp``), gradient
  reduce-scatters and all-reduces in the reduce dtype (in backward where the step reduces there, else after it),
  ZeRO-1/2's gather of the updated parameters (the update);
- activation collectives per block and microbatch from the model's shape (``cfg.dim``, heads, experts): tensor
  parallelism's 2 all-reduces of the residual stream in forward and 2 in backward (sequence parallelism: an
  all-gather and a reduce-scatter in place of each), one more in backward per block under remat (the recomputation
  stops at the block's last saved tensor: its output's reduction is not run again), the embedding's and the head's;
  ring attention's passes of K/V, the experts' 4 all-to-alls, the pipeline's carries.

Every collective is counted in the phase it runs in (``Prediction.phases``, the fake step's
:data:`~shardings.planner.fake_step.PHASES`: forward, backward, update), ``Prediction.comm`` their sum;
- FLOPs, other ops' bytes, ops and saved activations per row from the model's one-device profile
  (:mod:`shardings.planner.model_profile`), divided by the tensor and context split.
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction
from typing import Any

import torch

import core
from shardings.comm.buckets import DEFAULT_BUCKET_MB
from shardings.pipeline import build
from shardings.planner import model_state
from shardings.planner.candidates import Candidate, layout_of
from shardings.planner.fake_step import PHASES
from shardings.planner.memory import StepMemory
from shardings.planner.model_profile import Profile
from shardings.planner.prediction import Prediction, Work
from shardings.spec import layouts

__all__ = ["DTYPES", "ESTIMATE_BOUNDS", "ESTIMATE_TESTED", "busiest_blocks", "estimate", "model_state_memory",
           "pipeline_facts", "pipeline_send_phases", "pipeline_sends", "stage_blocks"]

DTYPES = {n: (m().compute_dtype, m().reduce_dtype) if m else (None, None) for n, m in core.precision.NAMED.items()}
_BUCKET = int(DEFAULT_BUCKET_MB * 2**20)  # bytes per bucketed collective, the step's default
# How far the exact numbers may lie from an estimate, exact / estimated (low, high), for the step time and the peak:
# what tests/shardings/planner/test_estimate_terms.py holds the estimate to on its grid of presets (it fails if a
# grid case falls outside). A search widens them by its own exact runs (shardings.planner.ranking.error_bounds).
ESTIMATE_BOUNDS = {"step": (0.9, 2.0), "peak": (0.5, 1.35)}
# The presets that grid covers: an estimate of a layout with any other (offload) has no tested bound.
ESTIMATE_TESTED = frozenset({"dp", "zero1", "zero2", "zero3", "tp", "sp", "pp"})
_RING = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "all_to_all": 1}


# What a microbatch awaiting W holds, in forwards' saved activations (without remat): its weight ops' inputs and the
# output gradients B recorded for them (at most 2); under remat also what B's recomputation saved, kept for W (an
# upper bound: exact / estimated peak 0.93 for zero1+pp zb_h1 m4, 0.89 bf16 zero2+pp zb_h1 m4, 0.54 zero3+pp zb_v
# m4; the three zero-bubble remat cases of tests/shardings/planner/test_estimate_terms.py hold it to ESTIMATE_BOUNDS).
_AWAITING_W, _AWAITING_W_REMAT = 2.0, 3.5


@functools.lru_cache(maxsize=4096)
def pipeline_facts(schedule: str, pp: int, microbatches: int,
                   virtual_stages: int | None) -> tuple[float, tuple[tuple[int, int], ...]] | None:
    """``(bubble, held)`` of a registered schedule, or ``None`` if it cannot be built for these sizes (its own
    checks). ``held``: the ``(forwards held, backwards awaiting W)`` a rank holds at once, every pair no other
    moment of any rank holds at least as many of both (a schedule that does not split the backward: ``(n, 0)``)."""
    try:
        s = build(schedule, pp, microbatches, virtual_stages=virtual_stages)
    except ValueError:
        return None
    pairs: set[tuple[int, int]] = set()
    for actions in s.ranks:
        forwards = awaiting = 0
        for a in actions:
            forwards += {"F": 1, "B": -1}.get(a.kind, 0)
            awaiting += {"B": 1, "W": -1}.get(a.kind, 0) if s.split_backward else 0
            pairs.add((forwards, awaiting))
    return s.bubble(), tuple(p for p in pairs if not any(q != p and q[0] >= p[0] and q[1] >= p[1] for q in pairs))


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


@functools.lru_cache(maxsize=4096)
def stage_blocks(layers: int, pp: int, stages: int) -> int:
    """The most blocks one pipeline rank runs: stages split evenly (one more on the first ones), round robin."""
    sizes = [layers // stages + (1 if s < layers % stages else 0) for s in range(stages)]
    return max(sum(sizes[s] for s in range(r, stages, pp)) for r in range(pp))


def _sent(kind: str, n: int, nbytes: float) -> float:
    return _RING.get(kind, 1) * (n - 1) / n * nbytes if n > 1 else 0.0


class _Comm:
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


def estimate(model: Any, cfg: Any, rows: int, cand: Candidate, optimizer: Any, profiles: dict[Any, Profile],
             period: int) -> Prediction | None:
    """The estimated :class:`~shardings.planner.prediction.Prediction` of ``cand`` (``None``: its pipeline
    schedule cannot be built for its sizes).

    Args:
        model: the model module.
        cfg: its config (``seq_len``: tokens per row).
        rows: the global batch in rows.
        cand: the candidate.
        optimizer: the optimizer (its state per parameter element).
        profiles: the model's one-device profile per ``(compute dtype, remat)``.
        period: the blocks' period.
    """
    if cand.seq_chunks > 1:  # TeraPipe: the whole sequences' estimate, rescaled
        from shardings.planner import seq_chunks

        return seq_chunks.estimate(estimate, model, cfg, rows, cand, optimizer, profiles, period)
    layout = layout_of(cand.layout)
    sizes = cand.sizes
    compute = DTYPES[cand.precision][0]
    stage = tuple((a, n) for a, n in sizes.items() if a != "pp") or (("dp", 1),)  # as Mesh.without("pp")
    leaves = model_state.leaves(model, cfg, cand.layout, stage, period)
    pp, m = cand.size("pp"), cand.microbatches
    bubble, held, blocks = 0.0, ((1, 0),), busiest_blocks(cfg, cand)
    if cand.pipelined:
        facts = pipeline_facts(cand.schedule, pp, m, cand.virtual_stages)
        if facts is None:
            return None
        bubble, held = facts
    reps = blocks / period  # periods of blocks on the busiest rank
    prof = profiles[(compute, bool(cand.remat))]
    data = cand.size("dp") * cand.size("fsdp") * cand.size("ep")
    local_rows = rows / data
    t, c = cand.size("tp"), cand.size("cp")
    sp = "sp" in layout.presets
    state = _cached_state(model, cfg, cand.layout, stage, cand.precision, blocks, period, optimizer)
    # the step runs on DTensors (its DTensor path) where the layout splits more than the batch
    split = t * c
    dtensor = split > 1 or any(layouts.preset(p).group in ("ep",) for p in layout.presets)
    comm = _Comm()
    comm.rows = {k: list(v) for k, v in _param_rows(model, cfg, cand.layout, cand.mesh, cand.precision, blocks,
                                                     period, m if not cand.pipelined else 1, dtensor).items()}
    width = (compute or torch.float32).itemsize
    _activation_comm(comm, cfg, cand, local_rows / m, blocks, width, sp, layout)
    # compute: the profile's per-row numbers, this rank's rows, split over tp (and cp's sequence)

    def work(n: int, opt_bytes: float) -> Work:  # n blocks' and the edges' compute on local_rows
        ops = (prof.block.ops * n + prof.edge.ops) * m * (1.3 if dtensor else 1.2)
        return Work({dtype: (prof.block.flops * n + prof.edge.flops) * local_rows / split},
                    {dtype: (prof.block.matmuls * n + prof.edge.matmuls) * m},
                    (prof.block.bytes * n + prof.edge.bytes) * local_rows / split + 7 * opt_bytes,
                    (prof.block.moves * n + prof.edge.moves) * m,
                    {"local": ops, "dtensor": ops * 0.05 if dtensor else 0.0})

    dtype = str(compute or torch.float32).removeprefix("torch.")
    mine = work(blocks, state["opt_bytes"])
    replica = work(cfg.layers, state["opt_bytes"] * cfg.layers / blocks) if cand.pipelined else None
    full = _saved(profiles[(compute, False)], blocks, local_rows / m, t, c, sp, 1)
    one = _saved(prof, blocks, local_rows / m, t, c, sp, 1)
    edge = _saved(prof, 0, local_rows / m, t, c, sp, 1)
    awaiting_w = _AWAITING_W_REMAT if cand.remat else _AWAITING_W
    saved = edge + max(f * (one - edge) + w * awaiting_w * (full - edge) for f, w in held)
    buffers = _buffers(leaves, reps, compute, layout, cand, prof, local_rows / m, split)
    if cand.pipelined:  # the reduction's copy, once the schedule's activations are freed
        buffers += max(0.0, _reduction_copy(leaves, reps, DTYPES[cand.precision][1] or compute) - saved)
    elif m > 1:  # accumulation: a microbatch's gradients (reduce dtype) beside the running sum (the grads role)
        buffers += _gradients(leaves, reps, DTYPES[cand.precision][1] or compute, "held")
    memory, host = StepMemory(state["params"], state["compute"], state["grads"], state["opt_state"], saved,
                              buffers).off_device(layout.host)
    rows_comm = comm.frozen()
    return Prediction(cand, False, rows_comm, rows_comm, memory._asdict(), host, mine.flops, mine.matmuls, mine.bytes,
                      mine.moves, mine.ops, bubble, _overlapped(rows_comm, layout, cand), blocks, replica,
                      comm.phases())


def busiest_blocks(cfg: Any, cand: Candidate) -> int:
    """The most blocks one rank runs: all of them without ``pp``, else its stages' (:func:`stage_blocks`)."""
    if not cand.pipelined:
        return cfg.layers
    pp = cand.size("pp")
    return stage_blocks(cfg.layers, pp, pp * (cand.virtual_stages or _stages_per_rank(cand.schedule)))


@functools.lru_cache(maxsize=65536)
def model_state_memory(model: Any, cfg: Any, layout: str, mesh: tuple[tuple[str, int], ...], precision: str,
                       blocks: int, period: int, optimizer: Any) -> dict[str, float]:
    """Device bytes per rank of the model state (params, compute copy, grads, optimizer state) of a layout on a mesh
    with ``blocks`` blocks on the busiest rank: exact (per-leaf specs), the same numbers :func:`estimate` reports,
    without the rest of it. Shared by every candidate with the same signature (microbatches, schedule and remat
    do not change it), so the search drops what cannot fit before estimating anything else."""
    stage = tuple((a, n) for a, n in mesh if a != "pp") or (("dp", 1),)
    state = _cached_state(model, cfg, layout, stage, precision, blocks, period, optimizer)
    host = layout_of(layout).host
    return {r: (0.0 if r in host else state[r]) for r in ("params", "compute", "grads", "opt_state")}


@functools.lru_cache(maxsize=65536)
def _cached_state(model: Any, cfg: Any, layout: str, stage: tuple[tuple[str, int], ...], precision: str, blocks: int,
                  period: int, optimizer: Any) -> dict[str, float]:
    compute, reduce = DTYPES[precision]
    leaves = model_state.leaves(model, cfg, layout, stage, period)
    return _state(leaves, blocks / period, compute, reduce, model_state.optimizer_factor(optimizer))


@functools.lru_cache(maxsize=65536)
def _param_rows(model: Any, cfg: Any, layout: str, mesh: tuple[tuple[str, int], ...], precision: str, blocks: int,
                period: int, gathers_per_step: int, dtensor: bool) -> dict[tuple[str, str, str], tuple[float, float]]:
    """The parameter collectives' rows (:func:`_param_comm`), one per signature: microbatches only count under
    ZeRO-3 (its gathers per step), remat and the schedule not at all; ``dtensor``: the step's DTensor path."""
    compute, reduce = DTYPES[precision]
    stage = tuple((a, n) for a, n in mesh if a != "pp") or (("dp", 1),)
    comm = _Comm()
    _param_comm(comm, model_state.leaves(model, cfg, layout, stage, period), blocks / period, dict(mesh), compute,
                reduce, gathers_per_step, layout_of(layout), dtensor)
    return {k: tuple(v) for k, v in comm.rows.items()}


def _stages_per_rank(schedule: str) -> int:
    from shardings.pipeline.schedule import stages_per_rank

    return stages_per_rank(schedule)


def _stored_width(leaf: model_state.Leaf, compute: torch.dtype | None, master: bool) -> int:
    """Bytes per element of a leaf's stored params: the compute copy's when the master lives in the state."""
    return compute.itemsize if master and leaf.floating else leaf.itemsize


def _state(leaves: model_state.Leaves, reps: float, compute: torch.dtype | None, reduce: torch.dtype | None,
           factor: float) -> dict[str, float]:
    out = dict.fromkeys(("params", "compute", "grads", "opt_state", "opt_bytes"), 0.0)
    master = model_state.keeps_master(leaves, compute)  # ZeRO-1/2 + policy: the fp32 master sharded with the state
    for group, k in ((leaves.edge, 1.0), (leaves.period, reps)):
        for leaf in group:
            size = leaf.itemsize
            out["params"] += k * leaf.numel["params"] * _stored_width(leaf, compute, master)
            if compute is not None and leaf.floating and not master:
                out["compute"] += k * leaf.numel["params"] * compute.itemsize
            out["grads"] += k * leaf.numel["held"] * (reduce.itemsize if reduce and leaf.floating else size)
            out["opt_state"] += k * leaf.numel["opt_state"] * size * (factor + (master and leaf.floating))
            out["opt_bytes"] += k * leaf.numel["opt_state"] * size
    return out


def _param_comm(comm: _Comm, leaves: model_state.Leaves, reps: float, sizes: dict[str, int],
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
            stored = leaf.numel["params"] * _stored_width(leaf, compute, master)
            grad = (reduce.itemsize if reduce and leaf.floating else leaf.itemsize) * leaf.numel["arrives"]
            full = leaf.numel["compute"] * width
            gathers = {"forward": gathers_per_step,
                       "backward": gathers_per_step if leaf.in_blocks and not layout.pipelined else 0}
            for a in leaf.gather:
                for phase, times in gathers.items():
                    comm.add("all_gather", a, phase, k * times * full, k * times * full / _BUCKET, sizes[a])
            shard = grad
            reduced = "backward" if not layout.pipelined and (not dtensor or leaf.in_backward) else "update"
            for a in _reduction_order(leaf, sizes, layout):
                comm.add("reduce_scatter" if a in leaf.scatter else "all_reduce", a, reduced, k * shard,
                         k * shard / _BUCKET, sizes[a])
                shard /= sizes[a] if a in leaf.scatter else 1
            for a in leaf.regather:  # updated shards gathered back in their stored dtype
                comm.add("all_gather", a, "update", k * stored, k * stored / _BUCKET, sizes[a])
            if "opt_state" in layout.host:  # gradient (and param, unless the master is there) blocks, both ways
                moved = leaf.numel["opt_state"] * leaf.itemsize
                back = leaf.numel["opt_state"] * _stored_width(leaf, compute, master)
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


def _activation_comm(comm: _Comm, cfg: Any, cand: Candidate, rows_mb: float, blocks: int, width: int, sp: bool,
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
        else:
            for phase, n in (("forward", 1), ("backward", 2)):
                comm.add("ppermute", "cp", phase, n * (c - 1) * blocks * m * kv, n * (c - 1) * blocks * m)
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


def _saved(prof: Profile, blocks: int, rows_mb: float, t: int, c: int, sp: bool, in_flight: int) -> float:
    def split(part: Any) -> float:
        rest = part.saved - part.saved_residual
        return (part.saved_residual / (t if sp else 1) + rest / t) / c

    return (split(prof.block) * blocks * in_flight + split(prof.edge)) * rows_mb


def _buffers(leaves: model_state.Leaves, reps: float, compute: torch.dtype | None, layout: layouts.Layout,
             cand: Candidate, prof: Profile, rows_mb: float, split: int) -> float:
    """Gathered parameters and transient gradients: ZeRO-3 holds two blocks gathered (one prefetched) and their
    gradients, or under ``pp`` the whole stage gathered for the step; a remat block's activations in backward.
    Under ``pp`` a rank also holds its stage's unreduced gradients (compute layout, compute dtype: the microbatches
    accumulate them) until their reduction after the schedule ends (:func:`_reduction_copy`)."""
    def gathered(group: Any, k: float) -> float:
        return sum(k * leaf.numel["compute"] * (compute.itemsize if compute and leaf.floating else leaf.itemsize)
                   for leaf in group if leaf.gather)

    block = gathered(leaves.period, 1.0 / leaves.period_blocks)
    out = gathered(leaves.edge, 1.0) + (gathered(leaves.period, reps) if cand.pipelined else 4 * block)
    if cand.pipelined:
        out += _gradients(leaves, reps, compute)
    if cand.remat:
        out += prof.block.saved * rows_mb / split  # one block's activations, recomputed in backward
    return out


def _gradients(leaves: model_state.Leaves, reps: float, dtype: torch.dtype | None, role: str = "compute") -> float:
    """Bytes of a pipelined rank's unreduced gradients (compute layout) in ``dtype``; ``role="held"``: as the step
    holds them (``Leaf.numel``)."""
    size = lambda leaf: leaf.numel[role] * (dtype.itemsize if dtype and leaf.floating else leaf.itemsize)
    return sum(size(leaf) for leaf in leaves.edge) + reps * sum(size(leaf) for leaf in leaves.period)


def _reduction_copy(leaves: model_state.Leaves, reps: float, dtype: torch.dtype | None) -> float:
    """The transient of a pipelined rank's gradient reduction after the schedule (its activations freed by then):
    one bucket's flat copy in reduce dtype (``shardings.comm.buckets.reduce`` casts a bucket at a time), the larger
    of a bucket and the largest gradient, at most all of them."""
    largest = max(_gradients(model_state.Leaves((leaf,), (), 1), 0, dtype) for leaf in (*leaves.edge, *leaves.period))
    return min(max(_BUCKET, largest), _gradients(leaves, reps, dtype))


def _overlapped(rows: dict[tuple[str, str], Any], layout: layouts.Layout, cand: Candidate) -> frozenset:
    """Collectives the local path overlaps with compute: data-parallel reductions launched in backward, ZeRO-3's
    prefetched gathers (layouts that split only the batch, without ``pp``)."""
    if cand.pipelined or any(cand.size(a) > 1 for a in ("tp", "cp", "ep")):
        return frozenset()
    sharded = any(layouts.preset(p).layout.params.names for p in layout.presets)  # storage split: zero3, hsdp
    return frozenset(k for k in rows if k[1] in ("dp", "fsdp") and (k[0] != "all_gather" or sharded))
