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

The collectives are counted in :mod:`shardings.planner.comm_terms`, the bytes per role in
:mod:`shardings.planner.memory_terms`; :func:`estimate` adds them up with the compute and the pipeline's facts.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from shardings.pipeline import build
from shardings.planner import model_state
from shardings.planner.candidates import Candidate, layout_of
from shardings.planner.comm_terms import Comm, activation_comm, overlapped, param_rows
from shardings.planner.comm_terms import pipeline_send_phases as pipeline_send_phases  # re-exported
from shardings.planner.comm_terms import pipeline_sends as pipeline_sends  # re-exported
from shardings.planner.memory import StepMemory
from shardings.planner.memory_terms import (
    AWAITING_W,
    AWAITING_W_REMAT,
    DTYPES,
    buffer_bytes,
    cached_state,
    gradient_bytes,
    model_state_memory,
    reduction_copy,
    saved_bytes,
)
from shardings.planner.model_profile import Profile
from shardings.planner.prediction import Prediction, Work
from shardings.spec import layouts

__all__ = ["DTYPES", "ESTIMATE_BOUNDS", "ESTIMATE_TESTED", "busiest_blocks", "estimate", "model_state_memory",
           "pipeline_facts", "pipeline_send_phases", "pipeline_sends", "stage_blocks"]

# How far the exact numbers may lie from an estimate, exact / estimated (low, high), for the step time and the peak:
# what tests/shardings/planner/test_estimate_terms.py holds the estimate to on its grid of presets (it fails if a
# grid case falls outside). A search widens them by its own exact runs (shardings.planner.ranking.error_bounds).
ESTIMATE_BOUNDS = {"step": (0.9, 2.0), "peak": (0.5, 1.35)}
# The presets that grid covers: an estimate of a layout with any other (offload) has no tested bound.
ESTIMATE_TESTED = frozenset({"dp", "zero1", "zero2", "zero3", "tp", "sp", "pp"})

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


@functools.lru_cache(maxsize=4096)
def stage_blocks(layers: int, pp: int, stages: int) -> int:
    """The most blocks one pipeline rank runs: stages split evenly (one more on the first ones), round robin."""
    sizes = [layers // stages + (1 if s < layers % stages else 0) for s in range(stages)]
    return max(sum(sizes[s] for s in range(r, stages, pp)) for r in range(pp))


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
    state = cached_state(model, cfg, cand.layout, stage, cand.precision, blocks, period, optimizer)
    # the step runs on DTensors (its DTensor path) where the layout splits more than the batch
    split = t * c
    dtensor = split > 1 or any(layouts.preset(p).group in ("ep",) for p in layout.presets)
    comm = Comm()
    comm.rows = {k: list(v) for k, v in param_rows(model, cfg, cand.layout, cand.mesh, cand.precision, blocks,
                                                     period, m if not cand.pipelined else 1, dtensor).items()}
    width = (compute or torch.float32).itemsize
    activation_comm(comm, cfg, cand, local_rows / m, blocks, width, sp, layout)
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
    full = saved_bytes(profiles[(compute, False)], blocks, local_rows / m, t, c, sp, 1)
    one = saved_bytes(prof, blocks, local_rows / m, t, c, sp, 1)
    edge = saved_bytes(prof, 0, local_rows / m, t, c, sp, 1)
    awaiting_w = AWAITING_W_REMAT if cand.remat else AWAITING_W
    saved = edge + max(f * (one - edge) + w * awaiting_w * (full - edge) for f, w in held)
    buffers = buffer_bytes(leaves, reps, compute, layout, cand, prof, local_rows / m, split)
    if cand.pipelined:  # the reduction's copy, once the schedule's activations are freed
        buffers += max(0.0, reduction_copy(leaves, reps, DTYPES[cand.precision][1] or compute) - saved)
    elif m > 1:  # accumulation: a microbatch's gradients (reduce dtype) beside the running sum (the grads role)
        buffers += gradient_bytes(leaves, reps, DTYPES[cand.precision][1] or compute, "held")
    memory, host = StepMemory(state["params"], state["compute"], state["grads"], state["opt_state"], saved,
                              buffers).off_device(layout.host)
    rows_comm = comm.frozen()
    return Prediction(cand, False, rows_comm, rows_comm, memory._asdict(), host, mine.flops, mine.matmuls, mine.bytes,
                      mine.moves, mine.ops, bubble, overlapped(rows_comm, layout, cand), blocks, replica,
                      comm.phases())


def busiest_blocks(cfg: Any, cand: Candidate) -> int:
    """The most blocks one rank runs: all of them without ``pp``, else its stages' (:func:`stage_blocks`)."""
    if not cand.pipelined:
        return cfg.layers
    pp = cand.size("pp")
    return stage_blocks(cfg.layers, pp, pp * (cand.virtual_stages or _stages_per_rank(cand.schedule)))


def _stages_per_rank(schedule: str) -> int:
    from shardings.pipeline.schedule import stages_per_rank

    return stages_per_rank(schedule)
