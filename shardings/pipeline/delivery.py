"""When a rank may free what it sent: a send is known delivered once a later message from its peer arrives.

A rank's sends are asynchronous (``isend``) and their buffers live until the send completes; gloo reports a send
complete only when it is waited on, and waiting blocks until the peer has posted the receive, so a rank cannot
wait on its sends as it goes (two neighbours that both send, then both receive, would wait on each other). But the
schedule says what each peer does in which order: when a message from peer ``q`` arrives, ``q`` had run every
action before that send, and had learnt what its own messages carried from the ranks before it (a vector clock), so
every message of ours that a rank received before the knowledge that arrives now was delivered, and waiting on it
returns at once. :func:`delivered_by` lists, per receive, the sends it proves delivered; the wire waits on them
and drops their buffers there, so a rank holds a few messages in flight and not every message of the step (``2 m``
of them on a middle rank), on any backend. :func:`sends_held` counts the most a rank holds: what the planner adds
to a rank's peak.
"""

from __future__ import annotations

import functools

from shardings.pipeline.schedule import SENDER, Action, Schedule

__all__ = ["delivered_by", "sends_held"]


def _receiver(send: Action) -> Action:
    """The receive that takes ``send`` (``SEND_F`` of stage ``s``: ``RECV_F`` of ``s + 1``; ``SEND_B``: ``s - 1``)."""
    kind = send.kind.removeprefix("SEND_")
    return Action(f"RECV_{kind}", send.stage + (1 if kind == "F" else -1), send.mb)


@functools.lru_cache(maxsize=64)
def _clocks(schedule: Schedule) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Per rank and action of its program, what the rank knows its peers had run by then (a vector clock: per
    rank, the count of its actions known run), from the program order and the messages received."""
    ranks = schedule.ranks
    position = [{a: i for i, a in enumerate(actions)} for actions in ranks]
    clocks: list[list[tuple[int, ...]]] = [[] for _ in ranks]
    progressed = True
    while progressed:
        progressed = False
        for r, actions in enumerate(ranks):
            while len(clocks[r]) < len(actions):
                i = len(clocks[r])
                a = actions[i]
                known = list(clocks[r][-1]) if i else [0] * len(ranks)
                if a.kind in SENDER:
                    send_kind, offset = SENDER[a.kind]
                    peer = schedule.rank_of(a.stage + offset)
                    j = position[peer][Action(send_kind, a.stage + offset, a.mb)]
                    if peer != r:
                        if len(clocks[peer]) <= j:
                            break  # not sent yet
                        known = [max(x, y) for x, y in zip(known, clocks[peer][j])]
                known[r] = i + 1
                clocks[r].append(tuple(known))
                progressed = True
    return tuple(tuple(c) for c in clocks)


@functools.lru_cache(maxsize=64)
def delivered_by(schedule: Schedule, rank: int) -> dict[Action, tuple[Action, ...]]:
    """Per receive of ``rank``'s program: its sends (to another rank) that the receive proves delivered, each
    listed at the first receive that does (module docstring). The schedule is checked (``check``): it runs."""
    position = [{a: i for i, a in enumerate(actions)} for actions in schedule.ranks]
    clock = _clocks(schedule)[rank]
    pending: list[Action] = []
    out: dict[Action, tuple[Action, ...]] = {}
    for i, a in enumerate(schedule.ranks[rank]):
        if a.kind.startswith("SEND_") and schedule.rank_of(_receiver(a).stage) != rank:
            pending.append(a)
        elif a.kind in SENDER and pending:
            done = tuple(s for s in pending
                         if clock[i][(q := schedule.rank_of(_receiver(s).stage))] > position[q][_receiver(s)])
            if done:
                out[a] = done
                pending = [s for s in pending if s not in done]
    return out


def sends_held(schedule: Schedule) -> tuple[int, ...]:
    """Per rank, the most messages it has sent and not yet known delivered at once (:func:`delivered_by`).

    >>> from shardings.pipeline.schedule import one_f_one_b
    >>> sends_held(one_f_one_b(2, 4))
    (2, 2)
    """
    out = []
    for rank, actions in enumerate(schedule.ranks):
        freed = delivered_by(schedule, rank)
        held = most = 0
        for a in actions:
            if a.kind.startswith("SEND_") and schedule.rank_of(_receiver(a).stage) != rank:
                held += 1
                most = max(most, held)
            held -= len(freed.get(a, ()))
        out.append(most)
    return tuple(out)
