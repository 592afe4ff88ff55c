"""Pipeline-parallel schedules by name: the registry, ``build``, and the GPipe and 1F1B builders.

What a schedule is (each rank's actions in program order, the unit-time table and bubble) is in
:mod:`shardings.pipeline.actions`; its names are importable from here too.

Schedules are known by name through one registry: a builder declares itself where it is defined
(:func:`register_schedule`, as ``gpipe`` and ``one_f_one_b`` below), with the number of stages it runs per
rank, as ``torch.distributed.pipelining``'s schedule classes carry theirs; :func:`build` makes one by name, and
``SCHEDULES``/``VIRTUAL_STAGES`` are read-only views of the registry. Adding a schedule is one module (and
its import in ``shardings.pipeline``) plus its tests.
"""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType
from typing import TypeVar

from shardings.pipeline.actions import (  # re-exported: a schedule's parts are imported from here
    COMMS,
    COMPUTE,
    SENDER,
    Action,
    Schedule,
    ScheduleError,
    backward_actions,
    check_sizes,
    forward_actions,
    program,
    timeline,
)
from shardings.spec.errors import sharding_error

__all__ = [
    "COMMS",
    "COMPUTE",
    "DEFAULT_SCHEDULE",
    "DEFAULT_VIRTUAL_STAGES",
    "SCHEDULES",
    "SENDER",
    "VIRTUAL_STAGES",
    "Action",
    "Schedule",
    "ScheduleError",
    "build",
    "check_sizes",
    "cuts_sequences",
    "gpipe",
    "one_f_one_b",
    "program",
    "register_schedule",
    "stages_per_rank",
    "timeline",
]

DEFAULT_SCHEDULE = "1f1b"  # what a pipelined run gets when it names none
DEFAULT_VIRTUAL_STAGES = 2  # stages per rank where the caller chooses (interleaved_1f1b) and does not say


# -- the registry ------------------------------------------------------------------------------------------------
_BUILDERS: dict[str, Callable[..., Schedule]] = {}
_STAGES_PER_RANK: dict[str, int | None] = {}
_CUTS_SEQUENCES: set[str] = set()  # builders that take seq_chunks (TeraPipe)
SCHEDULES = MappingProxyType(_BUILDERS)  # name -> builder(pp, microbatches[, virtual_stages])
VIRTUAL_STAGES = MappingProxyType(_STAGES_PER_RANK)  # name -> stages per rank, None: the caller's virtual_stages
Builder = TypeVar("Builder", bound=Callable[..., Schedule])


def register_schedule(name: str, builder: Builder | None = None, *, stages_per_rank: int | None = 1,
                      seq_chunks: bool = False) -> Builder | Callable[[Builder], Builder]:
    """Make ``builder(pp, microbatches)`` known as ``name`` to :func:`build` (and so to ``train_step``, the
    pipeline plan and the ``pipeline.schedule`` setting of the experiment apps). Usable as a decorator.

    Args:
        name: the schedule's name.
        builder: ``(pp, microbatches) -> Schedule``; with ``stages_per_rank=None``,
            ``(pp, microbatches, virtual_stages=v) -> Schedule``.
        stages_per_rank: model chunks each rank runs (1 for GPipe and 1F1B, 2 for ZB-V), or ``None`` where the
            caller chooses them with ``virtual_stages`` (default :data:`DEFAULT_VIRTUAL_STAGES`).
        seq_chunks: the builder also takes ``seq_chunks=k`` (TeraPipe: each microbatch's sequence in ``k``
            chunks; ``Schedule.seq_chunks``).

    >>> @register_schedule("gpipe_again")
    ... def gpipe_again(pp, microbatches):
    ...     return gpipe(pp, microbatches)  # doctest: +SKIP
    """
    def add(fn: Builder) -> Builder:
        _BUILDERS[name], _STAGES_PER_RANK[name] = fn, stages_per_rank
        if seq_chunks:
            _CUTS_SEQUENCES.add(name)
        return fn

    return add if builder is None else add(builder)


def cuts_sequences(name: str | None) -> bool:
    """Whether schedule ``name`` (``None``: :data:`DEFAULT_SCHEDULE`) takes ``seq_chunks`` (TeraPipe)."""
    return (DEFAULT_SCHEDULE if name is None else name) in _CUTS_SEQUENCES


def stages_per_rank(name: str | None, virtual_stages: int | None = None) -> int:
    """The stages per rank of schedule ``name`` (``None``: :data:`DEFAULT_SCHEDULE`) run with ``virtual_stages``
    (checked; no schedule is built).

    Raises:
        ScheduleError: an unknown name, or ``virtual_stages`` for a schedule whose count is fixed.
    """
    name = DEFAULT_SCHEDULE if name is None else name
    if name not in _BUILDERS:
        raise sharding_error(f"unknown pipeline schedule {name!r}", fix=f"use one of {sorted(_BUILDERS)}",
                             cls=ScheduleError)
    fixed = _STAGES_PER_RANK[name]
    if fixed is None:
        return DEFAULT_VIRTUAL_STAGES if virtual_stages is None else virtual_stages
    if virtual_stages not in (None, fixed):
        choose = sorted(n for n, v in _STAGES_PER_RANK.items() if v is None)
        raise sharding_error(
            f"pipeline schedule {name!r} runs {fixed} stage(s) per rank, got virtual_stages={virtual_stages}",
            fix=f"leave virtual_stages out, or use {' or '.join(choose)} for any number of virtual stages",
            cls=ScheduleError,
        )
    return fixed


def build(name: str | None, pp: int, microbatches: int, *, virtual_stages: int | None = None,
          seq_chunks: int = 1) -> Schedule:
    """The schedule ``name`` (a key of ``SCHEDULES``; ``None``: :data:`DEFAULT_SCHEDULE`) for ``pp`` ranks and
    ``microbatches`` microbatches.

    Args:
        virtual_stages: chunks of the model per rank, for a schedule registered with ``stages_per_rank=None``
            (``interleaved_1f1b``; default :data:`DEFAULT_VIRTUAL_STAGES`); the others have a fixed count
            (``VIRTUAL_STAGES``) and accept only that. The split has ``pp * virtual_stages`` stages.
        seq_chunks: chunks per microbatch's sequence (TeraPipe), for the schedules registered with
            ``seq_chunks=True`` (``gpipe``, ``1f1b``).

    >>> build("1f1b", 2, 3).bubble() == 1 / 4
    True
    >>> build("gpipe", 2, 2, seq_chunks=2).bubble() == 1 / 5
    True
    >>> build("interleaved_1f1b", 2, 4, virtual_stages=3).stages
    6
    """
    v = stages_per_rank(name, virtual_stages)
    name = DEFAULT_SCHEDULE if name is None else name
    if seq_chunks != 1:
        if name not in _CUTS_SEQUENCES:
            raise sharding_error(
                f"pipeline schedule {name!r} does not cut sequences into chunks (seq_chunks={seq_chunks})",
                fix=f"use one of {sorted(_CUTS_SEQUENCES)} with seq_chunks, or leave seq_chunks out", cls=ScheduleError)
        return _BUILDERS[name](pp, microbatches, seq_chunks=seq_chunks)
    if _STAGES_PER_RANK[name] is None:
        return _BUILDERS[name](pp, microbatches, virtual_stages=v)
    return _BUILDERS[name](pp, microbatches)


def _chunk_orders(microbatches: int, seq_chunks: int) -> tuple[list[int], list[int]]:
    """The units' forward order (microbatch by microbatch, chunks in order) and backward order (microbatch by
    microbatch, chunks last to first: a chunk's keys and values get their gradients from the later chunks)."""
    forward = list(range(microbatches * seq_chunks))
    return forward, [mb * seq_chunks + c for mb in range(microbatches) for c in reversed(range(seq_chunks))]


@register_schedule("gpipe", seq_chunks=True)
def gpipe(pp: int, microbatches: int, seq_chunks: int = 1) -> Schedule:
    """GPipe: every rank runs all forwards, then all backwards, both in microbatch order 0..m-1.

    Backwards go 0..m-1 as in ``torch.distributed.pipelining.ScheduleGPipe`` (the paper's figure draws them
    m-1..0; the makespan is the same). Each rank holds all ``m`` microbatches' activations at its peak.

    With ``seq_chunks = k`` (TeraPipe) the forwards run every unit (microbatch, chunk) in order and the backwards
    each microbatch's chunks last to first.

    >>> [str(a) for a in gpipe(2, 2).ranks[1]]
    ['rF0', 'F0', 'rF1', 'F1', 'B0', 'sB0', 'B1', 'sB1']
    """
    check_sizes("gpipe", pp, microbatches)
    check_sizes("gpipe", seq_chunks, 1, arg="seq_chunks")
    last = pp - 1
    forward, backward = _chunk_orders(microbatches, seq_chunks)
    ranks = tuple(
        tuple([a for u in forward for a in forward_actions(r, u, last)]
              + [a for u in backward for a in backward_actions(r, u, last)])
        for r in range(pp)
    )
    return Schedule("gpipe", pp, microbatches, ranks, seq_chunks=seq_chunks)


@register_schedule("1f1b", seq_chunks=True)
def one_f_one_b(pp: int, microbatches: int, seq_chunks: int = 1) -> Schedule:
    """1F1B (PipeDream-Flush): warm-up forwards, then one forward one backward, then cool-down backwards.

    Rank ``r`` runs ``min(pp - r - 1, m)`` warm-up forwards, so at most ``min(pp - r, m)`` microbatches are in
    flight on it. Backwards in microbatch order. Sends and receives sit where
    ``torch.distributed.pipelining.Schedule1F1B`` places them (it batches a send with the next receive):
    each receive right before its F/B, each send right after.

    With ``seq_chunks = k`` (TeraPipe) it runs the units (microbatch, chunk) the same way, each microbatch's
    backwards chunks last to first (:func:`gpipe`), and ``k - 1`` more warm-up forwards: the last chunk's
    backward, which comes first, needs every chunk of its microbatch forward.

    >>> [str(a) for a in one_f_one_b(4, 4).ranks[1] if a.kind in ("F", "B")]
    ['F0', 'F1', 'F2', 'B0', 'F3', 'B1', 'B2', 'B3']
    """
    check_sizes("1f1b", pp, microbatches)
    check_sizes("1f1b", seq_chunks, 1, arg="seq_chunks")
    last, units = pp - 1, microbatches * seq_chunks
    forward, backward = _chunk_orders(microbatches, seq_chunks)
    ranks = []
    for r in range(pp):
        warmup = min(pp - r - 1 + seq_chunks - 1, units)
        actions = [a for u in forward[:warmup] for a in forward_actions(r, u, last)]
        for i, u in enumerate(backward):  # steady state: the next F, then a B; cool-down: B only
            if i + warmup < units:
                actions += forward_actions(r, forward[i + warmup], last)
            actions += backward_actions(r, u, last)
        ranks.append(tuple(actions))
    return Schedule("1f1b", pp, microbatches, tuple(ranks), seq_chunks=seq_chunks)
