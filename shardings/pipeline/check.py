"""``check(schedule)``: a pipeline schedule is complete, its sends and receives pair up, and it cannot deadlock.

The checks run from the local to the global, so the first error is the most specific one: each action on its
own (kind, ranges, owning rank), duplicates, one F and one B per stage and microbatch (and one W each where the
schedule splits the backward), every send matched by a receive and back, each rank's order (RECV_F, F, SEND_F
... RECV_B, B, SEND_B ... W), then a run of the whole program with blocking receives (``timeline``).
"""

from __future__ import annotations

from shardings.pipeline.schedule import COMMS, COMPUTE, SENDER, Action, Schedule, ScheduleError, timeline
from shardings.spec.errors import sharding_error

__all__ = ["check"]

# The counterpart of each communication: (kind, stage offset of the peer).
_PEER = {"SEND_F": ("RECV_F", +1), "SEND_B": ("RECV_B", -1), **SENDER}


def _error(schedule: Schedule, rank: int, action: Action, problem: str, fix: str) -> ScheduleError:
    where = f"{schedule.name}: rank {rank}, action {action} ({action.kind} of stage {action.stage}, mb {action.mb})"
    return sharding_error(f"{where}: {problem}", fix=fix, cls=ScheduleError)


def _check_shape(schedule: Schedule) -> None:
    for field in ("pp", "microbatches", "stages_per_rank", "seq_chunks"):
        if getattr(schedule, field) < 1:
            raise sharding_error(
                f"{schedule.name}: {field}={getattr(schedule, field)}", fix=f"set {field} >= 1", cls=ScheduleError
            )
    if len(schedule.ranks) != schedule.pp:
        raise sharding_error(
            f"{schedule.name}: {len(schedule.ranks)} rank programs for pp={schedule.pp}",
            fix="give exactly one tuple of actions per rank",
            cls=ScheduleError,
        )
    placement = schedule.placement
    if placement is not None and (
        len(placement) != schedule.stages
        or any(placement.count(r) != schedule.stages_per_rank for r in range(schedule.pp))
    ):
        raise sharding_error(
            f"{schedule.name}: placement {placement} for pp={schedule.pp} x stages_per_rank="
            f"{schedule.stages_per_rank}",
            fix=f"give one rank in 0..{schedule.pp - 1} per stage, each rank {schedule.stages_per_rank} times",
            cls=ScheduleError,
        )


def _check_actions(schedule: Schedule) -> dict[Action, tuple[int, int]]:
    """Each action valid and on its stage's rank, none twice; returns action -> (rank, position)."""
    where: dict[Action, tuple[int, int]] = {}
    for r, actions in enumerate(schedule.ranks):
        for i, a in enumerate(actions):
            if a.kind not in COMPUTE + COMMS:
                raise _error(schedule, r, a, "unknown kind", fix=f"use one of {COMPUTE + COMMS}")
            if not 0 <= a.stage < schedule.stages:
                raise _error(
                    schedule,
                    r,
                    a,
                    f"no stage {a.stage} among {schedule.stages}",
                    fix=f"use stages 0..{schedule.stages - 1}",
                )
            if not 0 <= a.mb < schedule.units:
                chunks = f" x {schedule.seq_chunks} chunks" if schedule.seq_chunks > 1 else ""
                raise _error(
                    schedule,
                    r,
                    a,
                    f"no microbatch {a.mb} among {schedule.microbatches}{chunks}",
                    fix=f"use {'units' if chunks else 'microbatches'} 0..{schedule.units - 1}",
                )
            if schedule.rank_of(a.stage) != r:
                raise _error(
                    schedule,
                    r,
                    a,
                    f"wrong rank: stage {a.stage} runs on rank {schedule.rank_of(a.stage)}",
                    fix=f"move it to rank {schedule.rank_of(a.stage)} ({_placed(schedule)})",
                )
            if a in where:
                raise _error(schedule, r, a, f"duplicated (positions {where[a][1]} and {i})", fix="keep one")
            where[a] = (r, i)
    return where


def _placed(schedule: Schedule) -> str:
    return "rank = stage % pp" if schedule.placement is None else f"the schedule's placement {schedule.placement}"


def _check_complete(schedule: Schedule, where: dict[Action, tuple[int, int]]) -> None:
    """One F and one B per stage and microbatch; one W each too, if any (a split backward is split throughout)."""
    split = schedule.split_backward
    for stage in range(schedule.stages):
        for mb in range(schedule.units):
            for kind in COMPUTE if split else ("F", "B"):
                if Action(kind, stage, mb) not in where:
                    fix = "run one F and one B per stage and microbatch"
                    if kind == "W":
                        fix = (f"this schedule splits the backward (it has W actions), so every B needs its W: add "
                               f"W{mb} of stage {stage} after B{mb}, or drop every W to run whole backwards")
                    raise _error(schedule, schedule.rank_of(stage), Action(kind, stage, mb), "missing", fix=fix)


def _check_pairs(schedule: Schedule, where: dict[Action, tuple[int, int]]) -> None:
    """Every send has its receive on the neighbouring stage's rank, and every receive its send."""
    for a, (r, _) in where.items():
        if a.kind not in _PEER:
            continue
        peer_kind, offset = _PEER[a.kind]
        peer = Action(peer_kind, a.stage + offset, a.mb)
        if not 0 <= peer.stage < schedule.stages:
            raise _error(
                schedule,
                r,
                a,
                f"stage {a.stage} has no neighbour stage {peer.stage}",
                fix="drop it: the first stage neither receives activations nor sends gradients, the last "
                "neither sends activations nor receives gradients",
            )
        if peer not in where:
            raise _error(
                schedule,
                r,
                a,
                f"no matching {peer} ({peer_kind} of stage {peer.stage}) on rank {schedule.rank_of(peer.stage)}",
                fix=f"add {peer_kind} of stage {peer.stage}, mb {a.mb} there, or remove this {a.kind}",
            )


def _check_order(schedule: Schedule, where: dict[Action, tuple[int, int]]) -> None:
    """On each rank: RECV_F < F < SEND_F and RECV_B < B < SEND_B where the stage communicates; F < B < W."""
    last = schedule.stages - 1
    for stage in range(schedule.stages):
        for mb in range(schedule.units):
            forward, backward = Action("F", stage, mb), Action("B", stage, mb)
            rank, f_at = where[forward]
            b_at = where[backward][1]
            if b_at < f_at:
                raise _error(
                    schedule,
                    rank,
                    backward,
                    f"runs before its forward {forward}",
                    fix=f"place {backward} after {forward}",
                )
            weight = Action("W", stage, mb)
            if weight in where and where[weight][1] < b_at:
                raise _error(
                    schedule,
                    rank,
                    weight,
                    f"runs before its input-gradient backward {backward}",
                    fix=f"place {weight} after {backward} (W uses the output gradient B received)",
                )
            required = [
                ("RECV_F", forward, -1, stage > 0),
                ("SEND_F", forward, +1, stage < last),
                ("RECV_B", backward, -1, stage < last),
                ("SEND_B", backward, +1, stage > 0),
            ]
            for kind, compute, side, needed in required:
                comm = Action(kind, stage, mb)
                at = where.get(comm, (rank, None))[1]
                if needed and at is None:
                    raise _error(
                        schedule,
                        rank,
                        compute,
                        f"has no {kind} ({comm})",
                        fix=f"add {comm} {'before' if side < 0 else 'after'} {compute}",
                    )
                if needed and (at - where[compute][1]) * side < 0:
                    raise _error(
                        schedule,
                        rank,
                        comm,
                        f"comes {'after' if side < 0 else 'before'} {compute}",
                        fix=f"move it {'before' if side < 0 else 'after'} {compute}",
                    )


def _check_chunks(schedule: Schedule, where: dict[Action, tuple[int, int]]) -> None:
    """TeraPipe (``seq_chunks > 1``): on each stage a chunk's F after its predecessor's (it attends over that
    chunk's keys and values) and its B before its predecessor's (the predecessor's B needs the gradient of its
    keys and values summed over every later chunk)."""
    k = schedule.seq_chunks
    for stage in range(schedule.stages):
        for unit in range(schedule.units):
            if unit % k == 0:
                continue
            for kind, first, then in (("F", unit - 1, unit), ("B", unit, unit - 1)):
                before, after = Action(kind, stage, first), Action(kind, stage, then)
                if where[after][1] < where[before][1]:
                    why = ("it attends over the keys and values the earlier chunk's F makes" if kind == "F" else
                           "the earlier chunk's B needs its keys' and values' gradients from every later chunk")
                    raise _error(schedule, where[after][0], after,
                                 f"{schedule.label(after)} runs before {schedule.label(before)}: {why}",
                                 fix=f"place {schedule.label(after)} after {schedule.label(before)}")


def check(schedule: Schedule) -> None:
    """Raise ``ScheduleError`` naming the rank, the action and the fix if ``schedule`` cannot run.

    Receives block until the matching send ran; sends are buffered (never block), like batched ``isend``.

    >>> from shardings.pipeline.schedule import Schedule, gpipe
    >>> check(gpipe(4, 8))
    >>> receive_first = (Action("RECV_B", 0, 0), Action("F", 0, 0), Action("SEND_F", 0, 0), Action("B", 0, 0))
    >>> try:
    ...     check(Schedule("bad", 2, 1, (receive_first, gpipe(2, 1).ranks[1])))
    ... except ScheduleError as e:
    ...     print(str(e).split(": ", 1)[1].split(". Fix")[0])
    deadlock, no rank can progress: rank 0 waits at rB0 (needs sB0 from stage 1 on rank 1); rank 1 waits at rF0 \
(needs sF0 from stage 0 on rank 0)
    """
    _check_shape(schedule)
    where = _check_actions(schedule)
    _check_complete(schedule, where)
    _check_pairs(schedule, where)
    _check_order(schedule, where)
    if schedule.seq_chunks > 1:
        _check_chunks(schedule, where)
    timeline(schedule)
