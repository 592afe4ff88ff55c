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
by two more probes (``L ∈ {2p, 3p}``, affine in ``L``) that run, at ``pp = 1``, a one-rank schedule holding what
the busiest rank holds at once (:func:`busiest_rank`: its microbatches in flight, with the accumulated gradients
where 1F1B's steady state has them). A step holds nothing of the step before but its parameters and optimizer
state (the schedule's result it keeps, ``TrainStep.last``, drops its gradients), so one step from ``init`` is
what every later step holds. Against 4 gloo processes (gpt 4×64, pp2_dp2) that peak is within 2.5% for zero1/2/3+pp
and bf16 zero2+pp (``tests/shardings/planner/test_peak_memory.py``).
"""

from __future__ import annotations

import dataclasses
import functools
from fractions import Fraction
from typing import Any

import torch

import core
from shardings.pipeline.schedule import Action, Schedule, build
from shardings.planner import estimate as estimates
from shardings.planner.candidates import Candidate, layout_of
from shardings.planner.estimate import pipeline_sends
from shardings.planner.fake_step import Measured, measure
from shardings.planner.prediction import Prediction, Work

__all__ = ["exact", "pipeline_sends"]

_POLICIES = {"fp32": None, "bf16": core.precision.Policy.bf16_mixed, "fp16": core.precision.Policy.fp16_mixed}


def _policy(name: str) -> Any:
    make = _POLICIES[name]
    return make() if make else None


@functools.lru_cache(maxsize=256)
def _measure(model: Any, cfg: Any, layout: str, mesh: tuple[tuple[str, int], ...], rows: int, precision: str,
             microbatches: int, optimizer: Any, peak_probe: Schedule | None = None) -> Measured:
    """One fake step; with ``peak_probe`` (a :func:`busiest_rank` schedule) run by it."""
    pipelined = layout_of(layout).pipelined
    return measure(model, cfg, layout=layout, mesh=dict(mesh), batch_rows=rows, optimizer=optimizer,
                   precision=_policy(precision), microbatches=microbatches,
                   schedule=(peak_probe or "gpipe") if pipelined else None)


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
    if m.saved is not None:
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
    (its quick estimate) splits the measured transient bytes into activations and buffers for the breakdown.
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
            rank |= {k: v for k, v in held.items() if k in ("peak", "at_entry") or k.startswith("role/")}
        blocks = cfg.layers
        sends = (0, 0)
    else:
        mesh = tuple((a, 1 if a == "pp" else n) for a, n in cand.mesh)
        rows_mb = rows // cand.microbatches
        busiest = busiest_rank(cand)
        points = {(L, k): _values(_measure(model, dataclasses.replace(cfg, layers=L, remat=cand.remat), cand.layout,
                                           mesh, rows_mb * k, cand.precision, k, optimizer))
                  for L in (la, la + period) for k in (1, 2)}
        held = {L: _values(_measure(model, dataclasses.replace(cfg, layers=L, remat=cand.remat), cand.layout, mesh,
                                    rows_mb * busiest.microbatches, cand.precision, busiest.microbatches, optimizer,
                                    busiest)) for L in (la, la + period) if peak_probes}
        blocks = estimated.blocks
        total = _affine(points, period, cfg.layers, cand.microbatches)
        rank = _affine(points, period, blocks, cand.microbatches)
        sends = pipeline_sends(cand.schedule, cand.size("pp"), cand.microbatches, cand.virtual_stages)
    carry = _carry_bytes(cfg, rows, cand)
    comm, simulated = _rows(rank, sends[1], carry), _rows(total, sends[0], carry)
    host = sum(float(rank.get(f"role/{r}", 0)) for r in ("host",))
    peak = float(rank["peak"]) - host
    if cand.pipelined and peak_probes:
        # the peak: the probe that runs the busiest rank's actions (module docstring)
        peak = float(_affine({(L, 1): v for L, v in held.items()}, period, blocks, 1)["peak"]) - host
    memory = {r: float(rank.get(f"role/{r}", 0)) for r in ("params", "compute", "grads", "opt_state")}
    for r in layout.host:
        memory[r] = 0.0
    rest = max(0.0, peak - sum(memory.values()))
    activations = min(rest, estimated.memory["activations"])
    memory |= {"activations": activations, "buffers": rest - activations}
    work = _work(rank)
    return dataclasses.replace(estimated, exact=True, comm=comm, simulated=simulated, memory=memory, host=host,
                               **dataclasses.asdict(work), overlapped=estimates._overlapped(comm, layout, cand),
                               replica=_work(total) if cand.pipelined else None)


def _work(values: dict[str, Any]) -> Work:
    """The compute and dispatch of a step from its measured values (``flops/<dtype>``, ``ops/<kind>``, ...)."""
    def by(prefix: str) -> dict[str, float]:
        return {k.removeprefix(prefix): float(v) for k, v in values.items() if k.startswith(prefix)}

    return Work(by("flops/"), by("matmuls/"), float(values["bytes"]), float(values["moves"]), by("ops/"))


def busiest_rank(cand: Candidate) -> Schedule:
    """A one-rank schedule that holds what the busiest pipeline rank of ``cand`` holds at its peak, for a probe
    at ``pp = 1``: that rank's most microbatches in flight (its in-flight chunks over its stages, rounded up:
    whole microbatches of its blocks), after one microbatch's backward when the rank reaches that peak after a
    backward (1F1B's steady state: the accumulated gradients are held then too), then their backwards.
    """
    s = build(cand.schedule, cand.size("pp"), cand.microbatches, virtual_stages=cand.virtual_stages)
    fly = -(-max(s.peak_in_flight()) // s.stages_per_rank)
    backward = ("B", "W") if s.split_backward else ("B",)
    start = 1 if _peaks_after_backward(s) else 0
    ops = [Action(k, 0, 0) for k in ("F", *backward)] if start else []
    mbs = range(start, start + fly)
    ops += [Action("F", 0, n) for n in mbs] + [Action(k, 0, n) for n in mbs for k in backward]
    return Schedule(f"{s.name}_peak", 1, mbs.stop, (tuple(ops),))


def _peaks_after_backward(s: Schedule) -> bool:
    """Whether the busiest rank of ``s`` reaches its most microbatches in flight after a backward has run."""
    release, peaks = "W" if s.split_backward else "B", s.peak_in_flight()
    held, backward = 0, False
    for a in s.ranks[peaks.index(max(peaks))]:
        held += {"F": 1, release: -1}.get(a.kind, 0)
        backward |= a.kind == "B"
        if backward and held == max(peaks):
            return True
    return False


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


def _rows(values: dict[str, Any], sends: int, carry: Fraction) -> dict[tuple[str, str], tuple[int, Fraction]]:
    out: dict[tuple[str, str], tuple[int, Fraction]] = {}
    for k, v in values.items():
        if k.startswith("comm/") and k.endswith("/bytes"):
            _, kind, axis, _ = k.split("/")
            count = values.get(f"comm/{kind}/{axis}/count", 0)
            if v or count:
                out[(kind, axis)] = (round(count), Fraction(v))
    if sends:
        out[("send", "pp")] = (sends, sends * carry)
    return out
