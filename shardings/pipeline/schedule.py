"""Pipeline-parallel schedules as data: each rank's actions in program order, a unit-time table, the registry.

A ``Schedule`` says *what* each rank does and in which order (forward, backward, send, receive); an executor
runs it and ``shardings.pipeline.check`` proves it sound. Timing is derived, never stored: ``timeline`` runs
the program with every F, B and W taking one unit, communication free and receives blocking until their send
ran, which gives the table and the bubble of the GPipe/PipeDream figures.

The backward is either whole (``B`` alone) or split, as in zero-bubble pipelines, into ``B`` (the gradient of
the stage's input, which the previous stage waits for) and ``W`` (the gradient of its weights, which nothing
waits for): a schedule with any ``W`` splits every backward. Unit time is the zero-bubble paper's with F = B = W
= 1, except that a whole backward also takes one slot: the bubble *fractions* of GPipe, 1F1B and interleaved
1F1B are the same whether it takes one slot or two (all their idle time scales with F + B), so fractions compare
across schedules.

Schedules are known by name through one registry: a builder declares itself where it is defined
(:func:`register_schedule`, as ``gpipe`` and ``one_f_one_b`` below), with the number of stages it runs per
rank, as ``torch.distributed.pipelining``'s schedule classes carry theirs; :func:`build` makes one by name, and
``SCHEDULES``/``VIRTUAL_STAGES`` are read-only views of the registry. Adding a schedule is one module (and
its import in ``shardings.pipeline``) plus its tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from types import MappingProxyType
from typing import TypeVar

from shardings.spec.errors import ShardingError, sharding_error

__all__ = [
    "DEFAULT_SCHEDULE",
    "DEFAULT_VIRTUAL_STAGES",
    "SCHEDULES",
    "VIRTUAL_STAGES",
    "Action",
    "Schedule",
    "ScheduleError",
    "build",
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

COMPUTE = ("F", "B", "W")
COMMS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
_SHORT = {"F": "F", "B": "B", "W": "W", "SEND_F": "sF", "RECV_F": "rF", "SEND_B": "sB", "RECV_B": "rB"}
# A receive waits for the send of the neighbouring stage: (send kind, stage offset of the sender).
SENDER = {"RECV_F": ("SEND_F", -1), "RECV_B": ("SEND_B", +1)}


class ScheduleError(ShardingError):
    """A pipeline schedule that is incomplete, inconsistent or deadlocks. Subclass of ``ValueError``."""


@dataclass(frozen=True)
class Action:
    """One step of a rank's program.

    ``kind`` is ``"F"``/``"B"`` (forward/backward of ``stage`` on microbatch ``mb``), ``"W"`` (the weight
    gradient, in a schedule that splits the backward; its ``B`` then computes only the input gradient),
    ``"SEND_F"`` (activation to stage+1), ``"RECV_F"`` (activation from stage-1), ``"SEND_B"`` (input-gradient
    to stage-1) or ``"RECV_B"`` (output-gradient from stage+1). ``str`` is compact and omits the stage: ``F3``,
    ``B0``, ``W0``, ``sF1``, ``rF1``, ``sB2``, ``rB2``.

    In a schedule with ``seq_chunks = k`` (TeraPipe: each microbatch's sequence cut into ``k`` chunks), ``mb``
    numbers the *units* (microbatch, chunk): unit ``mb·k + c`` is chunk ``c`` of microbatch ``mb``, so messages,
    tags and the checker treat a chunk like a microbatch; :meth:`Schedule.label` writes it ``F1.0``.

    >>> str(Action("RECV_F", stage=1, mb=2)), str(Action("B", 0, 0))
    ('rF2', 'B0')
    """

    kind: str
    stage: int
    mb: int

    def __str__(self) -> str:
        return f"{_SHORT.get(self.kind, self.kind)}{self.mb}"


@dataclass(frozen=True)
class Schedule:
    """Every rank's actions in program order.

    Args:
        name: the schedule's name (``"gpipe"``, ``"1f1b"``, ...).
        pp: number of pipeline ranks.
        microbatches: microbatches per step.
        ranks: ``ranks[r]`` is rank ``r``'s actions in the order it runs them.
        stages_per_rank: model chunks per rank (1 for GPipe and 1F1B; interleaved schedules use more).
        placement: ``placement[s]`` is the rank that runs stage ``s``; ``None`` (default) places stage ``s`` on
            rank ``s % pp`` (round robin, as Megatron's virtual stages). ZB-V places a V: rank ``r`` runs
            stages ``r`` and ``2 pp - 1 - r``.
        seq_chunks: chunks each microbatch's sequence is cut into (TeraPipe; default 1): the actions' ``mb`` then
            numbers units ``microbatch·seq_chunks + chunk`` (:class:`Action`). A chunk's ``F`` on a stage runs after
            the previous chunk's (it attends over that chunk's keys and values) and its ``B`` before it (it sends
            those keys and values their gradients): ``check`` enforces both.

    >>> print(gpipe(2, 2))
    gpipe: pp=2, microbatches=2, bubble 33.3%
    rank 0 | F0 F1 .  .  B0 B1
    rank 1 | .  F0 F1 B0 B1 .
    """

    name: str
    pp: int
    microbatches: int
    ranks: tuple[tuple[Action, ...], ...]
    stages_per_rank: int = 1  # model chunks per rank
    placement: tuple[int, ...] | None = None  # rank of each stage; None: stage s on rank s % pp
    seq_chunks: int = 1  # TeraPipe: chunks per microbatch's sequence; actions' mb then numbers the units

    @property
    def units(self) -> int:
        """The (microbatch, chunk) units each stage runs: ``microbatches * seq_chunks``."""
        return self.microbatches * self.seq_chunks

    def label(self, action: Action) -> str:
        """``str(action)``, its unit written ``microbatch.chunk`` where the schedule cuts sequences (``F1.0``)."""
        if self.seq_chunks == 1:
            return str(action)
        mb, chunk = divmod(action.mb, self.seq_chunks)
        return f"{_SHORT.get(action.kind, action.kind)}{mb}.{chunk}"

    @property
    def stages(self) -> int:
        """Number of pipeline stages (``pp * stages_per_rank``)."""
        return self.pp * self.stages_per_rank

    @property
    def split_backward(self) -> bool:
        """Whether the backward is split into ``B`` (input gradient) and ``W`` (weight gradient)."""
        return any(a.kind == "W" for actions in self.ranks for a in actions)

    def rank_of(self, stage: int) -> int:
        """The rank that owns ``stage``."""
        return stage % self.pp if self.placement is None else self.placement[stage]

    def table(self) -> str:
        """Rows = ranks, columns = unit time slots; each F/B at the slot it runs in ``timeline``, idle as ``.``.

        Sends and receives take no time and are not shown; with several stages per rank the cells do not say
        which (``timeline`` does). Raises ``ScheduleError`` if the program deadlocks.
        """
        slots = timeline(self)
        makespan = max((t + 1 for row in slots for t, _ in row), default=0)
        cells = [["."] * makespan for _ in slots]
        for r, row in enumerate(slots):
            for t, action in row:
                cells[r][t] = self.label(action)
        width = max((len(c) for row in cells for c in row), default=1)
        label = len(f"rank {self.pp - 1}")
        chunks = f", seq_chunks={self.seq_chunks}" if self.seq_chunks > 1 else ""
        lines = [f"{self.name}: pp={self.pp}, microbatches={self.microbatches}{chunks}, bubble {self.bubble():.1%}"]
        for r, row in enumerate(cells):
            lines.append(f"{f'rank {r}':<{label}} | {' '.join(c.ljust(width) for c in row)}".rstrip())
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def bubble(self) -> float:
        """Idle fraction of the unit-time ``timeline``: idle slots / (pp × makespan).

        GPipe and 1F1B both give ``(pp - 1) / (microbatches + pp - 1)``.

        >>> gpipe(4, 4).bubble() == 3 / 7
        True
        """
        slots = timeline(self)
        busy = sum(len(row) for row in slots)
        makespan = max((t + 1 for row in slots for t, _ in row), default=0)
        return float(Fraction(self.pp * makespan - busy, self.pp * makespan)) if makespan else 0.0

    def peak_in_flight(self) -> tuple[int, ...]:
        """Per rank, the most (stage, microbatch) forwards whose backward has not finished (activations held):
        until ``B``, or until ``W`` where the backward is split (``W`` needs the inputs of the weights' ops).

        >>> one_f_one_b(4, 8).peak_in_flight(), gpipe(4, 8).peak_in_flight()
        ((4, 3, 2, 1), (8, 8, 8, 8))
        """
        release = "W" if self.split_backward else "B"
        peaks = []
        for actions in self.ranks:
            held = peak = 0
            for a in actions:
                held += {"F": 1, release: -1}.get(a.kind, 0)
                peak = max(peak, held)
            peaks.append(peak)
        return tuple(peaks)


def timeline(schedule: Schedule) -> tuple[tuple[tuple[int, Action], ...], ...]:
    """Run the program in unit time: per rank, ``(start slot, action)`` of each F and B.

    Each rank runs its actions in order; F, B and W take one unit, a send records the time it ran (sends are
    buffered and never block), a receive waits for the matching send of the neighbouring stage.

    Raises:
        ScheduleError: no rank can progress while some have actions left (a deadlock); names each stuck rank.

    >>> [[f"{t}:{a}" for t, a in row] for row in timeline(gpipe(2, 1))]
    [['0:F0', '3:B0'], ['1:F0', '2:B0']]
    """
    sent: dict[tuple[str, int, int], int] = {}
    next_action = [0] * len(schedule.ranks)
    clock = [0] * len(schedule.ranks)
    slots: list[list[tuple[int, Action]]] = [[] for _ in schedule.ranks]
    progressed = True
    while progressed:
        progressed = False
        for r, actions in enumerate(schedule.ranks):
            while next_action[r] < len(actions):
                a = actions[next_action[r]]
                if a.kind in SENDER:
                    send_kind, offset = SENDER[a.kind]
                    if (send_kind, a.stage + offset, a.mb) not in sent:
                        break
                    clock[r] = max(clock[r], sent[send_kind, a.stage + offset, a.mb])
                elif a.kind in COMPUTE:
                    slots[r].append((clock[r], a))
                    clock[r] += 1
                else:
                    sent[a.kind, a.stage, a.mb] = clock[r]
                next_action[r] += 1
                progressed = True
    stuck = [(r, actions[next_action[r]]) for r, actions in enumerate(schedule.ranks) if next_action[r] < len(actions)]
    if stuck:
        waits = "; ".join(f"rank {r} waits at {a} ({_needs(schedule, a)})" for r, a in stuck)
        raise sharding_error(
            f"{schedule.name}: deadlock, no rank can progress: {waits}",
            fix="make every rank send what its neighbour receives before it blocks on its own receive",
            cls=ScheduleError,
        )
    return tuple(tuple(row) for row in slots)


def _needs(schedule: Schedule, recv: Action) -> str:
    """What a receive waits for, e.g. ``"needs sB0 from stage 1 on rank 1"``."""
    send_kind, offset = SENDER[recv.kind]
    peer = recv.stage + offset
    return f"needs {Action(send_kind, peer, recv.mb)} from stage {peer} on rank {schedule.rank_of(peer)}"


def check_sizes(name: str, pp: int, microbatches: int, arg: str | None = None) -> None:
    """Raise ``ScheduleError`` unless the sizes are integers >= 1 (``arg`` names ``pp`` when it is another one)."""
    for label, value in ((arg or "pp", pp), ("microbatches", microbatches)):
        if not isinstance(value, int) or value < 1:
            raise sharding_error(f"{name}: {label}={value!r}", fix=f"pass an integer {label} >= 1", cls=ScheduleError)


def _forward(stage: int, mb: int, last: int) -> list[Action]:
    """Receive the activation (unless the first stage), run F, send it on (unless the last stage)."""
    return [
        *([Action("RECV_F", stage, mb)] if stage > 0 else []),
        Action("F", stage, mb),
        *([Action("SEND_F", stage, mb)] if stage < last else []),
    ]


def _backward(stage: int, mb: int, last: int) -> list[Action]:
    """Receive the output-gradient (unless the last stage), run B, send the input-gradient back (unless first)."""
    return [
        *([Action("RECV_B", stage, mb)] if stage < last else []),
        Action("B", stage, mb),
        *([Action("SEND_B", stage, mb)] if stage > 0 else []),
    ]


def program(computes: list[Action], stages: int) -> tuple[Action, ...]:
    """A rank's program from its computes in order: each receive right before its F/B, each send right after.

    >>> [str(a) for a in program([Action("F", 1, 0), Action("B", 1, 0), Action("W", 1, 0)], stages=3)]
    ['rF0', 'F0', 'sF0', 'rB0', 'B0', 'sB0', 'W0']
    """
    wrap = {"F": _forward, "B": _backward, "W": lambda s, mb, last: [Action("W", s, mb)]}
    return tuple(x for a in computes for x in wrap[a.kind](a.stage, a.mb, stages - 1))


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
        tuple([a for u in forward for a in _forward(r, u, last)] + [a for u in backward for a in _backward(r, u, last)])
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
        actions = [a for u in forward[:warmup] for a in _forward(r, u, last)]
        for i, u in enumerate(backward):  # steady state: the next F, then a B; cool-down: B only
            if i + warmup < units:
                actions += _forward(r, forward[i + warmup], last)
            actions += _backward(r, u, last)
        ranks.append(tuple(actions))
    return Schedule("1f1b", pp, microbatches, tuple(ranks), seq_chunks=seq_chunks)
