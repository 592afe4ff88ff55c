"""Interleaved 1F1B (Megatron-LM's virtual pipeline stages): each rank runs ``v`` chunks of the model.

The blocks split into ``pp * v`` contiguous stages placed round robin: stage ``s`` on rank ``s % pp``, so
rank ``r`` holds chunks ``r, r + pp, r + 2 pp, ...``. A microbatch crosses every rank ``v`` times, which
cuts the warm-up and cool-down (the bubble) by ``v`` at the price of ``v`` times the point-to-point messages.
The order is Megatron's ``forward_backward_pipelining_with_interleaving`` (Narayanan et al. 2021, §2.2):
microbatches go in groups of ``pp``; a rank runs a group through chunk 0, then chunk 1, ...; its warm-up is
``2 (pp - r - 1) + (v - 1) pp`` forwards, then one forward one backward, then the remaining backwards
(backwards visit the chunks in reverse).
"""

from __future__ import annotations

from shardings.pipeline.schedule import (
    DEFAULT_VIRTUAL_STAGES,
    Action,
    Schedule,
    ScheduleError,
    check_sizes,
    program,
    register_schedule,
)
from shardings.spec.errors import sharding_error

__all__ = ["interleaved_1f1b"]


def _virtual(pp: int, v: int, k: int, forward: bool) -> tuple[int, int]:
    """Megatron's k-th forward (or backward) of a rank as ``(chunk, microbatch)``."""
    in_group = k % (pp * v)
    chunk = in_group // pp
    return (chunk if forward else v - 1 - chunk), (k // (pp * v)) * pp + in_group % pp


@register_schedule("interleaved_1f1b", stages_per_rank=None)  # the caller chooses its virtual stages
def interleaved_1f1b(pp: int, microbatches: int, virtual_stages: int = DEFAULT_VIRTUAL_STAGES) -> Schedule:
    """Interleaved 1F1B with ``virtual_stages`` chunks per rank (module docstring).

    Raises:
        ScheduleError: ``microbatches`` not a multiple of ``pp`` (Megatron's groups of ``pp`` microbatches), or
            sizes below 1.

    >>> s = interleaved_1f1b(2, 2, virtual_stages=2)
    >>> [f"{a}@{a.stage}" for a in s.ranks[0] if a.kind in ("F", "B")]
    ['F0@0', 'F1@0', 'F0@2', 'F1@2', 'B0@2', 'B1@2', 'B0@0', 'B1@0']
    >>> s.bubble() == (2 - 1) / (2 * 2 + 2 - 1)
    True
    """
    name = "interleaved_1f1b"
    check_sizes(name, pp, microbatches)
    check_sizes(name, virtual_stages, 1, arg="virtual_stages")
    if microbatches % pp:
        raise sharding_error(
            f"{name}: microbatches={microbatches} is not a multiple of pp={pp} (microbatches go through each "
            "rank's chunks in groups of pp)",
            fix=f"use microbatches={max(pp, microbatches // pp * pp)} or {(microbatches // pp + 1) * pp}",
            cls=ScheduleError,
        )
    v, stages = virtual_stages, pp * virtual_stages
    total = microbatches * v  # each rank's forwards (and backwards)
    ranks = []
    for r in range(pp):
        # v = 1 is plain 1F1B (Megatron's non-interleaved schedule): pp - r - 1 warm-up forwards
        warmup = pp - r - 1 if v == 1 else 2 * (pp - r - 1) + (v - 1) * pp
        warmup = total if v > 1 and microbatches == pp else min(warmup, total)  # Megatron: m == pp, all forwards
        order = [("F", k) for k in range(warmup)]
        for k in range(total - warmup):
            order += [("F", k + warmup), ("B", k)]
        order += [("B", k) for k in range(total - warmup, total)]
        computes = []
        for kind, k in order:
            chunk, mb = _virtual(pp, v, k, kind == "F")
            computes.append(Action(kind, chunk * pp + r, mb))
        ranks.append(program(computes, stages))
    return Schedule(name, pp, microbatches, tuple(ranks), stages_per_rank=v)
