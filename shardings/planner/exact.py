"""The exact prediction of a candidate: its real train step run on fake tensors, extrapolated in blocks.

A step's collectives and bytes are exactly affine in the number of blocks ``L`` when the blocks repeat (each
adds the same gathers, reductions and activation collectives), so two fake steps at ``L = 2p`` and ``3p``
(``p`` the blocks' period; not ``p``: with one block the gathered block and the last one coincide, and the
peak is affine only from two on) give every count at the model's real ``L``. Measured, not modelled: the
bytes per collective kind × mesh axis equal what ``shardings.comms()`` counts for a simulated step.

A pipelined candidate's step runs every stage in one process on simulated ranks, and its collectives are
those of its stage mesh for all blocks plus the carries sent between ranks; the microbatches ``m`` add
per-microbatch collectives. So its fake steps run on the mesh with ``pp = 1`` (one stage holding the blocks, the
same collectives), at ``L ∈ {2p, 3p}`` × ``m ∈ {1, 2}`` microbatches of the candidate's microbatch size, and
the counts are bilinear in ``(L, m)``; the carries (``2·m`` per stage boundary that crosses ranks, each one
microbatch's residual stream) are added from the schedule. A real pipeline rank holds the parameters
outside the blocks and its own blocks: its numbers are the same bilinear form at its blocks. Its peak is measured
by probes that run, at ``pp = 1``, each rank's own program (:func:`rank_programs`): its forwards, backwards and
weight gradients in its order, over its ``v`` chunks of ``2p`` and ``3p`` blocks each (affine in the chunk's
blocks), with the embedding and the head only where the rank runs them
(:func:`~shardings.pipeline.stages.rank_stages`), plus the messages it holds sent and not yet known delivered
(:func:`~shardings.pipeline.delivery.sends_held`, a residual stream each). The fullest rank's is the candidate's
peak. A TeraPipe candidate (``seq_chunks = k``) runs its chunked schedule in every fake step (at ``pp = 1`` and in
each rank's probe, whole microbatches of ``k`` chunks each), so its measured ops, collectives and activations held
are the chunks'; its carries are ``k`` messages per microbatch, the same bytes in all (a message held at the peak
counted at ``1/k`` of a microbatch's carry: the chunks' mean). A step holds nothing of the step before but its
parameters and optimizer state (the schedule's result it keeps, ``TrainStep.last``, drops its gradients), so one
step from ``init`` is what every later step holds. Against
4 gloo processes (gpt 4×64, pp2_dp2) that peak is within 1% for GPipe, 1F1B, interleaved 1F1B, ZB-H1 and ZB-V
with ZeRO-1/2/3 and a bf16 policy (``tests/shardings/planner/test_peak_memory.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from fractions import Fraction
from typing import Any, NamedTuple

import torch

import core
from shardings.pipeline import DEFAULT_SCHEDULE
from shardings.pipeline.delivery import sends_held
from shardings.pipeline.schedule import Action, Schedule, build, program, stages_per_rank
from shardings.planner import estimate as estimates
from shardings.planner.candidates import Candidate, layout_of
from shardings.planner.comm_terms import overlapped
from shardings.planner.estimate import pipeline_sends
from shardings.planner.fake_step import Measured, measure
from shardings.planner.memory import ROLES, StepMemory, corrected
from shardings.planner.prediction import Prediction, Work

__all__ = ["exact", "first_step_seconds", "pipeline_sends", "work_units"]

_POLICIES = core.precision.NAMED  # the named policies' one table
# The program a fake step without a peak probe runs (its comm counts, and a pipelined candidate's comm-only
# steps): ``(schedule, runs the first stage, runs the last stage)`` as :func:`rank_programs` gives them. Those steps
# run at ``pp = 1``, one stage holding every block with the embedding and the head (both ends), where a schedule's
# order changes no collective and no byte counted; so any registered schedule counts the same, and the one a
# pipelined run gets when it names none (``DEFAULT_SCHEDULE``, its one home) is the one named here.
WHOLE_STEP_PROGRAM: tuple[str, bool, bool] = (DEFAULT_SCHEDULE, True, True)


def _policy(name: str) -> Any:
    make = _POLICIES[name]
    return make() if make else None


@functools.lru_cache(maxsize=256)
def _measure(model: Any, cfg: Any, layout: str, mesh: tuple[tuple[str, int], ...], rows: int, precision: str,
             microbatches: int, optimizer: Any, peak_probe: tuple[Schedule, bool, bool] | None = None) -> Measured:
    """One fake step; with ``peak_probe`` (one of :func:`rank_programs`) run by it."""
    pipelined = layout_of(layout).pipelined
    probe, *ends = peak_probe or WHOLE_STEP_PROGRAM
    return measure(model, cfg, layout=layout, mesh=dict(mesh), batch_rows=rows, optimizer=optimizer,
                   precision=_policy(precision), microbatches=microbatches, schedule=probe if pipelined else None,
                   ends=tuple(ends))


def _whole_step(cand: Candidate, microbatches: int) -> tuple[Schedule, bool, bool] | None:
    """The program of a pipelined candidate's comm steps at ``pp = 1`` over ``microbatches``: ``None``
    (:data:`WHOLE_STEP_PROGRAM`) on whole sequences; with ``seq_chunks = k`` its schedule cutting each microbatch into
    ``k`` chunks (TeraPipe), so the step runs the chunks' smaller ops and collectives, ``k`` times as many, and holds
    what a chunked step holds."""
    if cand.seq_chunks == 1:
        return None
    return build(cand.schedule, 1, microbatches, seq_chunks=cand.seq_chunks), True, True


def _values(m: Measured) -> dict[str, Any]:
    """A measurement as named numbers (comm rows as ``comm/kind/axis/count|bytes``) for extrapolation."""
    out: dict[str, Any] = {"peak": m.peak, "at_entry": m.at_entry, "bytes": m.bytes, "moves": m.moves,
                           **{f"role/{k}": v for k, v in m.roles.items()},
                           **{f"flops/{k}": v for k, v in m.flops.items()},
                           **{f"matmuls/{k}": v for k, v in m.matmuls.items()},
                           **{f"ops/{k}": v for k, v in m.ops.items()}}
    for (kind, axis), (count, nbytes) in m.comm.items():
        out[f"comm/{kind}/{axis}/count"] = count
        out[f"comm/{kind}/{axis}/bytes"] = nbytes
    for (kind, axis, phase), (count, nbytes) in m.phases.items():
        out[f"phase/{kind}/{axis}/{phase}/count"] = count
        out[f"phase/{kind}/{axis}/{phase}/bytes"] = nbytes
    out["saved"] = max(m.saved)
    return out


def _affine(points: dict[tuple[int, int], dict[str, Any]], period: int, blocks: float, m: int) -> dict[str, Any]:
    """Each value at ``blocks`` blocks and ``m`` microbatches, from runs at ``L ∈ {2p, 3p}`` (× ``m ∈ {1, 2}``
    when given): affine in ``L``, bilinear in ``(L, m)``."""
    la = 2 * period
    x = Fraction(blocks - la) / period if isinstance(blocks, int) else (blocks - la) / period
    keys = set().union(*points.values())
    get = lambda p, k: points[p].get(k, 0)
    out = {}
    for k in keys:
        v00, v10 = get((la, 1), k), get((la + period, 1), k)
        value = v00 + (v10 - v00) * x
        if (la, 2) in points:
            v01, v11 = get((la, 2), k), get((la + period, 2), k)
            value += (v01 - v00) * (m - 1) + (v11 - v10 - v01 + v00) * x * (m - 1)
        out[k] = value
    return out


def exact(model: Any, cfg: Any, rows: int, cand: Candidate, optimizer: Any, period: int,
          estimated: Prediction, *, peak_probes: bool = True) -> Prediction:
    """The exact :class:`~shardings.planner.prediction.Prediction` of ``cand`` (module docstring); ``estimated``
    (its quick estimate) gives the terms no fake step measures (:func:`~shardings.planner.memory.corrected`).
    ``peak_probes=False`` skips a pipelined candidate's two peak probes (for its comm bytes alone: its peak is then
    the one-stage probes' and not a pipeline rank's).

    Raises:
        ValueError, ShardingError: the step refuses the candidate (what ``shardings.train_step`` raises).
    """
    layout = layout_of(cand.layout)
    la = 2 * period
    if not cand.pipelined:
        mesh, m = tuple(cand.mesh), cand.microbatches
        # accumulation repeats the microbatch: past 2 the counts are affine in m (runs at 1 and 2 microbatches of
        # the candidate's size), and what is live at once (peak, roles) is the 2-microbatch run's
        ks = (1, 2) if m > 2 else (m,)
        points = {(L, k if m > 2 else 1): _values(_measure(
                      model, dataclasses.replace(cfg, layers=L, remat=cand.remat), cand.layout, mesh,
                      rows // m * k, cand.precision, k, optimizer))
                  for L in (la, la + period) for k in ks}
        rank = total = _affine(points, period, cfg.layers, m)
        if m > 2:
            held = _affine({(L, 1): v for (L, k), v in points.items() if k == 2}, period, cfg.layers, 1)
            rank |= {k: v for k, v in held.items() if k in ("peak", "at_entry", "saved") or k.startswith("role/")}
        blocks = cfg.layers
        sends = (0, 0)
    else:
        mesh = tuple((a, 1 if a == "pp" else n) for a, n in cand.mesh)
        rows_mb = rows // cand.microbatches
        points = {(L, k): _values(_measure(model, dataclasses.replace(cfg, layers=L, remat=cand.remat), cand.layout,
                                           mesh, rows_mb * k, cand.precision, k, optimizer, _whole_step(cand, k)))
                  for L in (la, la + period) for k in (1, 2)}
        # the peak probes: each rank's program, its chunks of 2p and 3p blocks each
        chunks = stages_per_rank(cand.schedule, cand.virtual_stages)
        held = [({L * chunks: _values(_measure(model, dataclasses.replace(cfg, layers=L * chunks, remat=cand.remat),
                                               cand.layout, mesh, rows_mb * probe[0].microbatches, cand.precision,
                                               probe[0].microbatches, optimizer, probe)) for L in (la, la + period)},
                 sends) for probe, sends in (rank_programs(cand) if peak_probes else ())]
        blocks = estimated.blocks
        total = _affine(points, period, cfg.layers, cand.microbatches)
        rank = _affine(points, period, blocks, cand.microbatches)
        sends = pipeline_sends(cand.schedule, cand.size("pp"), cand.microbatches, cand.virtual_stages)
    carry = _carry_bytes(cfg, rows, cand)
    k = cand.seq_chunks
    comm, simulated = _rows(rank, sends[1], carry, k), _rows(total, sends[0], carry, k)
    host = float(rank.get("role/host", 0))
    peak, saved = float(rank["peak"]) - host, None if cand.pipelined else rank.get("saved")
    if cand.pipelined and peak_probes:
        # the peak: the fullest rank's, from the probes that run each rank's program (module docstring), and the
        # activations that rank's step saved at once (the schedule's own count)
        at_depth = [(_affine({(L, 1): v for L, v in probe.items()}, period * chunks, blocks, 1), sends)
                    for probe, sends in held]
        # a message held is one unit's carry: a microbatch's, or with seq_chunks a chunk's (1/k of it on average)
        values, sends = max(at_depth, key=lambda vs: float(vs[0]["peak"]) + vs[1] * carry / k)
        peak, saved = float(values["peak"]) + sends * carry / k - host, values.get("saved")
    memory = corrected(StepMemory(*(estimated.memory[r] for r in ROLES)),
                       {r.removeprefix("role/"): v for r, v in rank.items() if r.startswith("role/")}, peak, saved,
                       layout.host)._asdict()
    work = _work(rank)
    return dataclasses.replace(estimated, exact=True, comm=comm, simulated=simulated, memory=memory, host=host,
                               **dataclasses.asdict(work), overlapped=overlapped(comm, layout, cand),
                               replica=_work(total) if cand.pipelined else None,
                               phases=_phase_rows(rank, cand, carry))


def work_units(cand: Candidate, period: int) -> int:
    """What :func:`exact` costs, in blocks × microbatches run on fake tensors over all its fake steps: a fake step's
    time grows with them (each op is a shape computation), so the search prices the next exact run by them."""
    la = 2 * period
    if not cand.pipelined:
        ks = (1, 2) if cand.microbatches > 2 else (cand.microbatches,)
        return sum(L * k for L in (la, la + period) for k in ks)
    chunks = stages_per_rank(cand.schedule, cand.virtual_stages)
    probes = sum(probe[0].microbatches for probe, _ in rank_programs(cand))
    # TeraPipe: k chunks per microbatch, each block's ops k times (each a shape computation, whatever its size)
    return (3 * (la + la + period) + probes * chunks * (la + la + period)) * cand.seq_chunks


def first_step_seconds(model: Any, cfg: Any, rows: int, cand: Candidate, optimizer: Any, period: int) -> float:
    """Seconds of :func:`exact`'s cheapest fake step of ``cand`` (``2p`` blocks, the fewest microbatches) per work
    unit: the price of the first exact run before any has run (that step is cached: ``exact`` does not run it
    again)."""
    k = 1 if cand.pipelined or cand.microbatches > 2 else cand.microbatches
    mesh = tuple((a, 1 if a == "pp" else n) for a, n in cand.mesh)
    start = time.perf_counter()
    _measure(model, dataclasses.replace(cfg, layers=2 * period, remat=cand.remat), cand.layout, mesh,
             rows // cand.microbatches * k, cand.precision, k, optimizer,
             _whole_step(cand, k) if cand.pipelined else None)
    return (time.perf_counter() - start) / (2 * period * k * cand.seq_chunks)


def _work(values: dict[str, Any]) -> Work:
    """The compute and dispatch of a step from its measured values (``flops/<dtype>``, ``ops/<kind>``, ...)."""
    def by(prefix: str) -> dict[str, float]:
        return {k.removeprefix(prefix): float(v) for k, v in values.items() if k.startswith(prefix)}

    return Work(by("flops/"), by("matmuls/"), float(values["bytes"]), float(values["moves"]), by("ops/"))


def rank_programs(cand: Candidate) -> list[tuple[tuple[Schedule, bool, bool], int]]:
    """One-rank schedules, for probes at ``pp = 1``, that each hold at every moment what one pipeline rank of
    ``cand`` holds: that rank's forwards, backwards and weight gradients in its order, its stages renumbered as
    the probe's chunks (so a rank of interleaved 1F1B or ZB-V runs its ``v`` chunks), with whether the rank runs
    the model's first stage and its last (:func:`~shardings.pipeline.stages.rank_stages`), and the most messages
    the rank holds sent and not yet known delivered (:func:`~shardings.pipeline.delivery.sends_held`: a probe at
    ``pp = 1`` sends none); one per rank with the model's first or last stage, and one for the others: of those no
    other rank covers (:func:`_covers`: a middle rank of 1F1B holds less of everything than the rank after the first),
    the one with the most microbatches held at once (forwards, and input gradients awaiting W), then the most
    messages in flight.

    A rank's program is cut after the last moment it holds something new: what it holds is counted per chunk and
    state (forwards done; input gradients done, weight gradients pending; gradients summed), and after the cut
    every moment holds no more of each than some moment before it. The microbatches started by then run to their
    end and the rest are dropped, so a 1F1B rank of many microbatches is probed with its warm-up and one steady
    step, not all of them; since what a moment holds adds up over its pieces, the cut keeps the rank's peak.
    """
    s = build(cand.schedule, cand.size("pp"), cand.microbatches, virtual_stages=cand.virtual_stages,
              seq_chunks=cand.seq_chunks)
    per_mb = s.seq_chunks  # TeraPipe: actions number units mb·k + c; a probe keeps whole microbatches (every chunk)
    release = "W" if s.split_backward else "B"
    sends = sends_held(s)
    ranks = []
    for rank, actions in enumerate(s.ranks):
        chunks = {st: k for k, st in enumerate(st for st in range(s.stages) if s.rank_of(st) == rank)}
        computes = [Action(a.kind, chunks[a.stage], a.mb) for a in actions if a.kind in ("F", "B", "W")]
        cut, states = _new_states(computes, release, len(chunks))
        started = {a.mb // per_mb for a in computes[:cut + 1]}
        kept = tuple(a for i, a in enumerate(computes) if i <= cut or a.mb // per_mb in started)
        ranks.append(RankProgram(kept, s.rank_of(0) == rank, s.rank_of(s.stages - 1) == rank, sends[rank],
                                 tuple(states)))
    uncovered = [r for r in ranks if not any(_covers(other, r) for other in ranks if other.key != r.key)]
    # the ranks with the model's ends, and of the rest the one holding the most at once (a zero-bubble schedule's
    # middle ranks trade forwards held for weight gradients deferred: one probe stands for them)
    middle = [r for r in uncovered if not (r.first or r.last)]
    fullest = max(middle, key=lambda r: (r.most_held, r.sends), default=None)
    programs: dict[tuple[Any, ...], RankProgram] = {}
    for r in uncovered:
        if r.first or r.last or r is fullest:
            programs.setdefault(r.key, r)
    return [((Schedule(f"{s.name}_rank", 1, 1 + max(a.mb for a in r.actions) // per_mb,
                       (program(list(r.actions), s.stages_per_rank),), stages_per_rank=s.stages_per_rank,
                       seq_chunks=per_mb), r.first, r.last), r.sends) for r in programs.values()]


class RankProgram(NamedTuple):
    """One pipeline rank's program as :func:`rank_programs` probes it.

    Attributes:
        actions: its forwards, backwards and weight gradients in order (chunks renumbered), cut (``_new_states``).
        first: it runs the model's first stage (the embedding).
        last: it runs the model's last stage (the head and loss).
        sends: the most messages it holds sent and not yet known delivered.
        states: what it holds at each new moment: per chunk, forwards held, backwards awaiting W, gradients summed.
    """

    actions: tuple[Action, ...]
    first: bool
    last: bool
    sends: int
    states: tuple[tuple[int, ...], ...]

    @property
    def key(self) -> tuple[Any, ...]:
        """What makes two programs the same probe."""
        return self.actions, self.first, self.last, self.sends

    @property
    def most_held(self) -> int:
        """The most microbatches held at once over its chunks (forwards and backwards awaiting W)."""
        return max(sum(x[:2 * len(x) // 3]) for x in self.states)


def _covers(a: RankProgram, b: RankProgram) -> bool:
    """Whether rank ``a`` holds at some moment at least what rank ``b`` holds at each of its moments (so only ``a``
    needs a probe): the same ends of the model, as many messages in flight, every state of ``b`` under one of
    ``a``'s. An ``a`` with the same numbers as ``b`` covers it only if it comes first (one of them is probed)."""
    if (a.first, a.last) != (b.first, b.last) or a.sends < b.sends:
        return False
    under = all(any(all(x <= y for x, y in zip(sb, sa)) for sa in a.states) for sb in b.states)
    same = a.sends == b.sends and all(any(all(x <= y for x, y in zip(sa, sb)) for sb in b.states) for sa in a.states)
    return under and (not same or a.states < b.states or (a.states == b.states and a.actions < b.actions))


def _new_states(computes: list[Action], release: str, chunks: int) -> tuple[int, list[tuple[int, ...]]]:
    """The index after which the program holds nothing that some moment before did not hold at least as much of
    (:func:`rank_programs`), and the states it held up to there."""
    held = [0] * (3 * chunks)  # per chunk: forwards held, backwards held (awaiting W), its gradients summed
    seen: list[tuple[int, ...]] = []
    last = 0
    for i, a in enumerate(computes):
        if a.kind == "F":
            held[a.stage] += 1
        elif a.kind == "B":
            held[a.stage] -= 1
            held[chunks + a.stage] += release == "W"
        else:
            held[chunks + a.stage] -= 1
        held[2 * chunks + a.stage] |= a.kind == release  # a chunk's gradients are summed from its first release on
        now = tuple(held)
        if not any(all(x <= y for x, y in zip(now, old)) for old in seen):
            seen.append(now)
            last = i
    return last, seen


def _carry_bytes(cfg: Any, rows: int, cand: Candidate) -> Fraction:
    """Bytes of one microbatch's residual stream on one rank: the carry a stage sends (laid out by the activation
    rules: rows over the data axes, the sequence over cp, and over tp too under sp)."""
    if not cand.pipelined:
        return Fraction(0)
    layout = layout_of(cand.layout)
    width = (estimates.DTYPES[cand.precision][0] or torch.float32).itemsize
    data = cand.size("dp") * cand.size("fsdp") * cand.size("ep")
    seq = cfg.seq_len // (cand.size("cp") * (cand.size("tp") if "sp" in layout.presets else 1))
    return Fraction(rows // cand.microbatches // data * seq * cfg.dim * width)


def _phase_rows(values: dict[str, Any], cand: Candidate,
                carry: Fraction) -> dict[tuple[str, str, str], tuple[int, Fraction]]:
    """The collectives by phase (``phase/kind/axis/phase/count|bytes``), with the busiest rank's carries under ``pp``
    (:func:`~shardings.planner.estimate.pipeline_send_phases`)."""
    out: dict[tuple[str, str, str], tuple[int, Fraction]] = {}
    for k, v in values.items():
        if k.startswith("phase/") and k.endswith("/bytes"):
            _, kind, axis, phase, _ = k.split("/")
            count = values.get(f"phase/{kind}/{axis}/{phase}/count", 0)
            if v or count:
                out[(kind, axis, phase)] = (round(count), Fraction(v))
    if cand.pipelined:
        sends = estimates.pipeline_send_phases(cand.schedule, cand.size("pp"), cand.microbatches, cand.virtual_stages)
        out |= {("send", "pp", phase): _carries(n, carry, cand.seq_chunks)
                for phase, n in zip(("forward", "backward"), sends) if n}
    return out


def _rows(values: dict[str, Any], sends: int, carry: Fraction,
          seq_chunks: int = 1) -> dict[tuple[str, str], tuple[int, Fraction]]:
    """The comm rows of extrapolated ``values``, with the pipeline's ``sends`` (:func:`_carries`)."""
    out: dict[tuple[str, str], tuple[int, Fraction]] = {}
    for k, v in values.items():
        if k.startswith("comm/") and k.endswith("/bytes"):
            _, kind, axis, _ = k.split("/")
            count = values.get(f"comm/{kind}/{axis}/count", 0)
            if v or count:
                out[(kind, axis)] = (round(count), Fraction(v))
    if sends:
        out[("send", "pp")] = _carries(sends, carry, seq_chunks)
    return out


def _carries(sends: int, carry: Fraction, seq_chunks: int) -> tuple[int, Fraction]:
    """``(messages, bytes)`` of ``sends`` whole microbatches' carries of ``carry`` bytes each: with ``seq_chunks = k``
    (TeraPipe) each carry goes as ``k`` messages, one per chunk, the same bytes in all."""
    return sends * seq_chunks, sends * carry
