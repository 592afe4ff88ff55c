"""What the planner predicts for one candidate, per rank and per step: the numbers its step time comes from."""

from __future__ import annotations

import dataclasses
from fractions import Fraction

from shardings.planner.candidates import Candidate
from shardings.planner.memory import ROLES

__all__ = ["MEMORY_ROLES", "Prediction", "Work"]

MEMORY_ROLES = ROLES  # bytes per rank by role: the one memory model's (shardings.planner.memory)


@dataclasses.dataclass(frozen=True)
class Work:
    """Compute and dispatch of some ranks' step: the :class:`Prediction` fields of the same names."""

    flops: dict[str, float]
    matmuls: dict[str, float]
    bytes: float
    moves: float
    ops: dict[str, float]


@dataclasses.dataclass(frozen=True)
class Prediction:
    """One candidate's step on its busiest rank.

    Attributes:
        candidate: what is predicted.
        exact: from steps run on fake tensors (:mod:`shardings.planner.exact`): comm bytes equal a simulated
            step's; else estimated (:mod:`shardings.planner.estimate`).
        comm: ``(kind, axis) -> (count, bytes sent)`` by the busiest rank per step.
        simulated: ``(kind, axis) -> (count, bytes)`` as ``shardings.comms()`` counts a simulated step of the
            candidate (every pipeline stage in one process: all stages' collectives); ``comm`` without ``pp``.
        memory: bytes per rank by role (:data:`MEMORY_ROLES`), a :class:`~shardings.planner.memory.StepMemory`'s
            terms: ``activations`` saved for backward at the peak, ``buffers`` the rest of the peak (gathered
            parameters, transient gradients, logits, pipeline carries).
        host: bytes of roles kept in host memory (offload), not counted in ``peak``.
        flops: FLOPs per rank per step by compute dtype name.
        matmuls: how many matmul and attention ops those FLOPs are in, by dtype name.
        bytes: bytes read and written by the ops that are not matmuls (elementwise, the optimizer's update).
        moves: how many ops those bytes are in.
        ops: ops dispatched per step: ``{"local": n, "dtensor": n}``.
        bubble: the pipeline schedule's idle fraction (0 without ``pp``).
        overlapped: the ``comm`` keys whose time can hide behind compute (bucketed data-parallel reductions in
            backward, ZeRO-3's prefetched gathers).
        blocks: the most blocks one rank runs.
        replica: under ``pp``, the work of all stages of one pipeline replica together (each of its ``pp`` ranks runs
            a part; the first and the last stage the embedding and the head, not every rank as the busiest
            rank's numbers count them): what ranks sharing few CPU cores compute between them. ``None``: every
            rank does this rank's work.
        phases: ``(kind, axis, phase) -> (count, bytes sent)``: ``comm`` by the phase each collective runs in
            (:data:`~shardings.planner.fake_step.PHASES`: forward, backward, update).
    """

    candidate: Candidate
    exact: bool
    comm: dict[tuple[str, str], tuple[int, Fraction]]
    simulated: dict[tuple[str, str], tuple[int, Fraction]]
    memory: dict[str, float]
    host: float
    flops: dict[str, float]
    matmuls: dict[str, float]
    bytes: float
    moves: float
    ops: dict[str, float]
    bubble: float
    overlapped: frozenset[tuple[str, str]]
    blocks: int
    replica: Work | None = None
    phases: dict[tuple[str, str, str], tuple[int, Fraction]] = dataclasses.field(default_factory=dict)

    @property
    def peak(self) -> float:
        """Device bytes per rank at the step's peak: the sum of :attr:`memory`."""
        return sum(self.memory.values())

    @property
    def work(self) -> Work:
        """This (the busiest) rank's compute and dispatch."""
        return Work(self.flops, self.matmuls, self.bytes, self.moves, self.ops)

    def comm_bytes(self) -> Fraction:
        """Bytes the busiest rank sends per step, over every collective."""
        return sum((b for _, b in self.comm.values()), Fraction(0))
