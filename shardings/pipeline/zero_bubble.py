"""Zero-bubble schedules (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"): ZB-H1 and ZB-V.

The backward splits into ``B``, the gradient of the stage's input (the previous stage waits for it), and ``W``,
the gradient of its weights (nobody waits for it): a rank runs ``W`` where it would otherwise wait. ZB-H1 comes
from a list scheduler in unit time (F = B = W = 1 slot): at each slot a rank runs a ready ``B`` if it has one,
else a ready ``F`` unless that would hold more than ``limit`` forwards whose ``W`` has not run (the activation
memory), else its oldest pending ``W``, else it idles; each rank's order of F and B is 1F1B's (only the next
one is a candidate).

* ``zb_h1(pp, m)``: one stage per rank, F and B in 1F1B's order, ``limit = min(pp, m)``: 1F1B's peak
  activation memory (its rank 0's; later ranks now hold as much), about a third of its bubble: unit-time bubble
  ``(pp - 1) / (3 m + pp - 1)`` for ``m >= pp`` against 1F1B's ``(pp - 1) / (m + pp - 1)`` (the paper's
  ``(p - 1)(F + B - W)`` against ``(p - 1)(F + B + W)`` idle per rank).
* ``zb_v(pp, m)``: two stages per rank placed in a V, in ``torch.distributed.pipelining.ScheduleZBVZeroBubble``'s
  order: rank ``r`` runs stage ``r`` on the way down and stage ``2 pp - 1 - r`` on the way back, so the first and
  the last stage (embedding and loss) share rank 0 and the turn of the V stays on rank ``pp - 1``; at most
  ``2 pp`` half-size chunks held, again 1F1B's memory. The list scheduler above gives the same unit-time bubble
  and peak here, but an order that leaves many ``B`` waiting for their ``W``; on 4 real CPU ranks its measured
  bubble was 0.387 against torch's 0.291 (``docs/performance.md``), so we run torch's order.
"""

from __future__ import annotations

from shardings.pipeline.schedule import Action, Schedule, check_sizes, one_f_one_b, program, register_schedule

__all__ = ["zb_h1", "zb_v"]


def _list_schedule(name: str, pp: int, microbatches: int, placement: tuple[int, ...], limits: list[int],
                   orders: list[list[Action]] | None = None) -> Schedule:
    """Simulate the module docstring's rule slot by slot; each rank's computes in the order they ran.

    ``orders[r]``, when given, fixes rank ``r``'s order of F and B (ZB-H1: 1F1B's): only its head is a candidate.
    """
    stages, m = len(placement), microbatches
    mine = [[s for s in range(stages) if placement[s] == r] for r in range(pp)]
    done: dict[tuple[str, int, int], int] = {}  # (kind, stage, mb) -> the slot it finished by
    nxt = {(kind, s): 0 for kind in "FB" for s in range(stages)}  # each stage's next microbatch per kind
    pending: list[list[Action]] = [[] for _ in range(pp)]  # B that ran, W not yet
    held = [0] * pp  # forwards whose W has not run
    order: list[list[Action]] = [[] for _ in range(pp)]

    def ready(a: Action, t: int) -> bool:
        needs = [("F", a.stage - 1, a.mb)] if a.kind == "F" and a.stage > 0 else []
        if a.kind == "B":
            needs = [("F", a.stage, a.mb)] + ([("B", a.stage + 1, a.mb)] if a.stage < stages - 1 else [])
        return all(done.get(n, t + 1) <= t for n in needs)

    t = 0
    while any(len(o) < 3 * m * len(mine[r]) for r, o in enumerate(order)):
        ran = []
        for r in range(pp):
            if orders is not None:
                ran_fb = sum(a.kind != "W" for a in order[r])
                candidates = orders[r][ran_fb : ran_fb + 1]
            else:
                candidates = [Action(k, s, nxt[k, s]) for k in "FB" for s in mine[r] if nxt[k, s] < m]
            ok = [a for a in candidates if ready(a, t) and (a.kind == "B" or held[r] < limits[r])]
            if ok:
                action = min(ok, key=lambda a: (a.kind != "B", a.mb, -a.stage))
                held[r] += action.kind == "F"
                if action.kind == "B":
                    pending[r].append(action)
            elif pending[r] and done["B", pending[r][0].stage, pending[r][0].mb] <= t:
                action = Action("W", pending[r][0].stage, pending[r].pop(0).mb)
                held[r] -= 1
            else:
                continue
            ran.append(action)
            order[r].append(action)
        for a in ran:
            done[a.kind, a.stage, a.mb] = t + 1
            if a.kind != "W":
                nxt[a.kind, a.stage] += 1
        assert ran or any(v > t for v in done.values()), f"{name}: the list scheduler stalled at slot {t}"
        t += 1
    ranks = tuple(program(o, stages) for o in order)
    return Schedule(name, pp, m, ranks, stages_per_rank=stages // pp, placement=placement)


@register_schedule("zb_h1")
def zb_h1(pp: int, microbatches: int) -> Schedule:
    """ZB-H1: 1F1B's order and peak memory, weight gradients filling its bubble (module docstring).

    >>> s = zb_h1(4, 8)
    >>> s.bubble() == 3 / (3 * 8 + 3), s.peak_in_flight() == (4, 4, 4, 4)
    (True, True)
    """
    check_sizes("zb_h1", pp, microbatches)
    order = [[a for a in actions if a.kind in ("F", "B")] for actions in one_f_one_b(pp, microbatches).ranks]
    return _list_schedule("zb_h1", pp, microbatches, tuple(range(pp)), [min(pp, microbatches)] * pp, order)


@register_schedule("zb_v", stages_per_rank=2)
def zb_v(pp: int, microbatches: int) -> Schedule:
    """ZB-V: two stages per rank in a V (rank ``r``: stages ``r`` and ``2 pp - 1 - r``), module docstring.

    >>> zb_v(2, 2).placement
    (0, 1, 1, 0)
    """
    check_sizes("zb_v", pp, microbatches)
    placement = tuple(list(range(pp)) + list(range(pp - 1, -1, -1)))
    ranks = tuple(program(_v_order(pp, microbatches, r), 2 * pp) for r in range(pp))
    return Schedule("zb_v", pp, microbatches, ranks, stages_per_rank=2, placement=placement)


def _v_order(pp: int, m: int, r: int) -> list[Action]:
    """Rank ``r``'s computes in ``ScheduleZBVZeroBubble``'s order (laid out for ``max(2 pp - 1, m)`` microbatches,
    those past ``m`` dropped): forwards of the way down, then of both chunks, then each ``B`` followed by its ``W``
    while forwards remain, then the cool-down's ``B`` with the remaining ``W`` after them."""
    n, down, up = max(2 * pp - 1, m), r, 2 * pp - 1 - r
    nxt = {(kind, s): 0 for kind in "FBW" for s in (down, up)}  # each chunk's next microbatch per kind
    out: list[Action] = []

    def add(*actions: tuple[str, int]) -> None:
        for kind, s in actions:
            out.append(Action(kind, s, nxt[kind, s]))
            nxt[kind, s] += 1

    add(*[("F", down)] * (2 * (pp - r) - 1))  # warm-up: the way down
    for _ in range(r):
        add(("F", up), ("F", down))
    for _ in range(pp - r):
        add(("F", up), ("B", up), ("W", up))
    while nxt["F", up] < nxt["F", down] or nxt["F", down] < n:  # steady state
        if nxt["F", down] < n:
            add(("F", down))
        add(("B", down), ("W", down), ("F", up), ("B", up), ("W", up))
    for _ in range(r):  # cool-down
        add(("B", down), ("B", up))
    for _ in range(pp - r):
        add(("B", down), ("W", down))
    add(*[("W", up)] * (nxt["B", up] - nxt["W", up]), *[("W", down)] * (nxt["B", down] - nxt["W", down]))
    return [a for a in out if a.mb < m]
