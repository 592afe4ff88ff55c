"""A TeraPipe candidate's estimate (``Candidate.seq_chunks = k``): its whole-sequence estimate, rescaled.

Cutting each microbatch's sequence into ``k`` chunks changes neither the FLOPs (every token's matmuls and every
causal query-key pair run once) nor the bytes any collective moves in a step; it changes what the schedule does
with them:

- the bubble: the chunked schedule's unit-time ``bubble()``, (p−1)/(m·k+p−1) for GPipe and 1F1B;
- the activations held at the peak: the chunked schedule's most chunks in flight on a rank, each ``1/k`` of a
  microbatch, against the whole-sequence schedule's microbatches (1F1B: (p+k−1)/k instead of p); measured within
  1.2× of this above it (each chunk's attention also saves its concatenated prefix: ``docs/pipeline.md``);
- the counts of per-microbatch ops and of the activations' messages and collectives (on ``pp`` and ``tp``): ``k``
  times as many, each ``1/k`` the size.

The exact runs (:mod:`shardings.planner.exact`) run the chunked schedule itself (the fake steps and each rank's
peak probe cut every microbatch into the candidate's ``k`` chunks of the plan's sizes), so a TeraPipe candidate's
measured memory, ops and collectives correct this estimate as any other candidate's do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from shardings.pipeline.schedule import build
from shardings.planner.candidates import Candidate

__all__ = ["estimate"]

_PER_MICROBATCH_AXES = ("pp", "tp")  # activations' messages and collectives: one per chunk


def estimate(whole: Callable[..., Any], model: Any, cfg: Any, rows: int, cand: Candidate, *args: Any) -> Any:
    """``whole(model, cfg, rows, cand, *args)`` (the planner's estimate) of ``cand`` on whole sequences, rescaled for
    its ``seq_chunks`` (module docstring); ``None`` where the schedule cannot be built."""
    base = whole(model, cfg, rows, dataclasses.replace(cand, seq_chunks=1), *args)
    if base is None:
        return None
    k, pp, m = cand.seq_chunks, cand.size("pp"), cand.microbatches
    try:
        chunked = build(cand.schedule, pp, m, virtual_stages=cand.virtual_stages, seq_chunks=k)
    except ValueError:
        return None
    held = max(chunked.peak_in_flight()) / k / max(build(cand.schedule, pp, m).peak_in_flight())

    def counts(comm: dict) -> dict:
        return {key: (n * k if key[1] in _PER_MICROBATCH_AXES else n, nbytes) for key, (n, nbytes) in comm.items()}

    return dataclasses.replace(
        base, candidate=cand, bubble=chunked.bubble(), memory=base.memory | {"activations": base.memory[
            "activations"] * held}, comm=counts(base.comm), simulated=counts(base.simulated),
        phases=counts(base.phases), ops={kind: n * k for kind, n in base.ops.items()},
        matmuls={d: n * k for d, n in base.matmuls.items()}, moves=base.moves * k)
