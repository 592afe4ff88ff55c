"""Schedules as data: each rank's actions in program order (``Action``, ``Schedule``, ``program``) and the unit-time
run that gives their table and bubble (``timeline``). The registry and the builders are in
:mod:`shardings.pipeline.schedule`.

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
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from shardings.spec.errors import ShardingError, sharding_error

__all__ = ["COMMS", "COMPUTE", "SENDER", "Action", "Schedule", "ScheduleError", "backward_actions", "check_sizes",
           "forward_actions", "program", "timeline"]

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


def forward_actions(stage: int, mb: int, last: int) -> list[Action]:
    """Receive the activation (unless the first stage), run F, send it on (unless the last stage)."""
    return [
        *([Action("RECV_F", stage, mb)] if stage > 0 else []),
        Action("F", stage, mb),
        *([Action("SEND_F", stage, mb)] if stage < last else []),
    ]


def backward_actions(stage: int, mb: int, last: int) -> list[Action]:
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
    wrap = {"F": forward_actions, "B": backward_actions, "W": lambda s, mb, last: [Action("W", s, mb)]}
    return tuple(x for a in computes for x in wrap[a.kind](a.stage, a.mb, stages - 1))
