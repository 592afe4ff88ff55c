"""The planner's answer: candidates ranked by predicted step time, why each number, and what was dropped."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import NamedTuple

from shardings.planner.candidates import Candidate, layout_of
from shardings.planner.cluster import Cluster
from shardings.planner.cost import Timing, step_time
from shardings.planner.estimate import ESTIMATE_BOUNDS, ESTIMATE_TESTED
from shardings.planner.prediction import MEMORY_ROLES, Prediction

__all__ = ["Checked", "Fit", "Ranking", "Row", "describe_drop", "describe_state_drop", "gb"]


def gb(n: float) -> str:
    """Bytes as GB (decimal, as device memory is sold), or MB/KB below a GB."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}" if abs(n) < 100 * size else f"{n / size:.0f} {unit}"
    return f"{n:.0f} B"


def _seconds(t: float) -> str:
    return f"{t * 1e3:.3g} ms" if t < 1 else f"{t:.3g} s"


@dataclasses.dataclass(frozen=True)
class Row:
    """A ranked candidate: its prediction and step time."""

    prediction: Prediction
    timing: Timing

    @property
    def candidate(self) -> Candidate:
        return self.prediction.candidate


class Checked(NamedTuple):
    """One candidate's estimate beside its own exact run (fake steps): how far off that estimate was."""

    candidate: Candidate
    estimated_step: float
    exact_step: float
    estimated_peak: float
    exact_peak: float

    @property
    def ratios(self) -> dict[str, float]:
        """Exact over estimated, for the step time and the peak."""
        return {"step": self.exact_step / self.estimated_step, "peak": self.exact_peak / self.estimated_peak}


def error_bounds(checked: Sequence[Checked]) -> dict[str, tuple[float, float]]:
    """How far an estimate may be off, exact over estimated (low, high) per ``step`` and ``peak``: the bounds the
    estimate's tests hold it to (:data:`~shardings.planner.estimate.ESTIMATE_BOUNDS`), widened by every exact run
    of this search against its own estimate."""
    out = {}
    for what, (lo, hi) in ESTIMATE_BOUNDS.items():
        seen = [c.ratios[what] for c in checked]
        out[what] = (min([lo, *seen]), max([hi, *seen]))
    return out


def _bound_text(checked: Sequence[Checked], candidate: Candidate | None = None) -> str:
    """How far an estimate could be off (:func:`error_bounds`); for ``candidate``, none where its layout has a
    preset the estimate's tests do not cover (:data:`~shardings.planner.estimate.ESTIMATE_TESTED`)."""
    b = error_bounds(checked)
    text = (f"the exact step could be {b['step'][0]:.2g}-{b['step'][1]:.2g}× it, the peak "
            f"{b['peak'][0]:.2g}-{b['peak'][1]:.2g}× (estimate's tests, and {len(checked)} exact runs here)")
    untested = sorted(set(layout_of(candidate.layout).presets) - ESTIMATE_TESTED) if candidate else []
    return text if not untested else (f"no tested bound: {', '.join(untested)} is outside the estimate's tests "
                                      f"(elsewhere {text})")


@dataclasses.dataclass(frozen=True)
class Fit:
    """Does a candidate fit in device memory? ``bool(fit)`` says; ``str(fit)`` gives the breakdown."""

    candidate: Candidate
    peak: float
    memory: float
    breakdown: dict[str, float]
    exact: bool

    def __bool__(self) -> bool:
        return self.peak <= self.memory

    def __str__(self) -> str:
        verdict = "yes" if self else "no"
        how = "run on fake tensors" if self.exact else "estimated"
        lines = [f"fits: {verdict} — {self.candidate}: {gb(self.peak)} per rank at the peak "
                 f"{'<=' if self else '>'} {gb(self.memory)} ({how})"]
        lines += [f"  {role:<12}{gb(b):>10}" for role, b in self.breakdown.items()]
        return "\n".join(lines)


class Ranking:
    """Candidates ranked by predicted step time, fastest first (what :func:`shardings.plan` returns).

    Attributes:
        rows: the candidates that fit, fastest first.
        dropped: ``candidate -> why`` for those that do not fit, cannot run, or whose exact prediction failed
            (:func:`describe_failure`: listed under the table too).
        cluster: the cluster planned for.
        seconds: how long the search took.
        searched: how many candidates were considered.
        checked: each candidate run exactly, beside its own estimate (the estimates' error found by this search;
            stated beside the estimated rows, never applied to them).
    """

    def __init__(self, rows: list[Row], dropped: dict[Candidate, str], cluster: Cluster, seconds: float,
                 searched: int, predict: Callable[[Candidate], Prediction], checked: Sequence[Checked] = ()):
        self.rows = sorted(rows, key=lambda r: r.timing.total)  # each on its own best-known prediction
        self.dropped, self.cluster, self.seconds, self.searched = dropped, cluster, seconds, searched
        self.checked = tuple(checked)
        self._predict = predict

    @property
    def winner(self) -> Row:
        """The fastest candidate whose numbers come from fake steps (else the fastest estimate)."""
        exact = [r for r in self.rows if r.prediction.exact]
        if not (exact or self.rows):
            raise ValueError("no candidate fits: see Ranking.dropped for why. Fix: more ranks, a smaller batch, "
                             "remat or offload in the search space")
        return (exact or self.rows)[0]

    def rank_of(self, candidate: Candidate) -> int | None:
        """The 1-based rank of ``candidate`` among those that fit, or ``None``."""
        for i, r in enumerate(self.rows):
            if r.candidate == candidate:
                return i + 1
        return None

    def row(self, candidate: Candidate) -> Row:
        """``candidate``'s row (predicted on demand, exactly, when the search did not reach it)."""
        for r in self.rows:
            if r.candidate == candidate and r.prediction.exact:
                return r
        pred = self._predict(candidate)
        return Row(pred, step_time(pred, self.cluster))

    def fits(self, candidate: Candidate) -> Fit:
        """Whether ``candidate`` fits in a rank's memory, with its breakdown (run on fake tensors)."""
        pred = self.row(candidate).prediction
        return Fit(candidate, pred.peak, self.cluster.memory, dict(pred.memory), pred.exact)

    def table(self, k: int = 10, spell: Callable[[Candidate], Sequence[str]] | None = None) -> str:
        """The top ``k`` as a text table: step time, memory, comm, compute, bubble, exact or estimated; the winner
        line spells the winner with ``spell`` (an app's arguments that run it, e.g.
        ``experiments.auto.train_overrides``; default: the candidate as the rows print it). The planner knows no
        app's config keys: the app that runs a candidate spells it."""
        head = f"{'#':>3}  {'step':>9}  {'peak/rank':>10}  {'comm/rank':>10}  {'exposed':>9}  {'compute':>9}  " \
               f"{'bubble':>6}  candidate"
        lines = [f"{self.searched} candidates on {self.cluster.name} ({self.cluster.world} ranks, "
                 f"{gb(self.cluster.memory)} each) in {self.seconds:.1f} s; {len(self.dropped)} dropped; "
                 f"{sum(r.prediction.exact for r in self.rows)} run on fake tensors; ~: estimated (not run on fake "
                 f"tensors): {_bound_text(self.checked)}", head]
        for i, r in enumerate(self.rows[:k]):
            p, t = r.prediction, r.timing
            mark = " " if p.exact else "~"
            lines.append(f"{i + 1:>3}{mark} {_seconds(t.total):>9}  {gb(p.peak):>10}  {gb(float(p.comm_bytes())):>10}  "
                         f"{_seconds(t.exposed):>9}  {_seconds(t.busy):>9}  {p.bubble:>6.1%}  {r.candidate}")
        if self.rows:
            best = self.winner.candidate
            lines.append("winner: " + (" ".join(spell(best)) if spell else str(best)) + self._winner_note())
        lines += [f"failed: {c}: {why}" for c, why in self.dropped.items() if why.startswith(FAILED)]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def _winner_note(self) -> str:
        """After the winner line: whether fake steps confirmed it, else that it is an estimate and its bound."""
        best = self.winner
        if not best.prediction.exact:
            return f"  (~ an estimate, not run on fake tensors: {_bound_text(self.checked, best.candidate)})"
        above = self.rows.index(best)
        return (f"  (run on fake tensors; {above} estimated row{'s' * (above != 1)} above it not run within the "
                "budget)" if above else "  (run on fake tensors)")

    def explain(self, candidate: Candidate) -> str:
        """Where ``candidate``'s step time and memory go, and why it ranks where it does (or was dropped)."""
        if candidate in self.dropped and not self._ranked(candidate):
            if self.dropped[candidate].startswith(FAILED):  # predicting it again would raise again
                return f"{candidate}: dropped — {self.dropped[candidate]}"
            row = self.row(candidate)
            return "\n".join([f"{candidate}: dropped — {self.dropped[candidate]}", self._breakdown(row)])
        row = self.row(candidate)
        rank = self.rank_of(candidate)
        lines = [f"{candidate}: rank {rank} of {len(self.rows)}" if rank else f"{candidate}: not ranked",
                 self._breakdown(row)]
        if self.rows and candidate != self.winner.candidate:
            lines.append(self._versus(row, self.winner))
        return "\n".join(lines)

    def _ranked(self, candidate: Candidate) -> bool:
        return any(r.candidate == candidate for r in self.rows)

    def _breakdown(self, row: Row) -> str:
        p, t = row.prediction, row.timing
        how = "run on fake tensors (bytes exact)" if p.exact else f"estimated: {_bound_text(self.checked, p.candidate)}"
        lines = [f"  predicted step {_seconds(t.total)} ({how})",
                 f"  memory per rank: {gb(p.peak)} of {gb(self.cluster.memory)}"
                 + (f"; {gb(p.host)} in host memory" if p.host else "")]
        lines += [f"    {role:<12}{gb(p.memory.get(role, 0)):>10}" for role in MEMORY_ROLES]
        flops = sum(p.flops.values())
        on_dtensors = p.ops.get("dtensor", 0) + p.ops.get("dtensor_data", 0)
        lines.append(f"  compute: {flops / 1e12:.3g} TFLOP per rank ({', '.join(p.flops) or '-'}), "
                     f"{gb(p.bytes)} moved by other ops: {_seconds(t.compute)}; dispatch {p.ops.get('local', 0):.0f} "
                     f"ops + {on_dtensors:.0f} on DTensors: {_seconds(t.dispatch)}")
        lines.append(f"  communication per rank: {gb(float(p.comm_bytes()))} in {_seconds(sum(t.comm.values()))}, "
                     f"{_seconds(t.hidden)} hidden behind compute")
        for (kind, axis), (count, nbytes) in sorted(p.comm.items(), key=lambda kv: -kv[1][1]):
            over = " (overlapped)" if (kind, axis) in p.overlapped else ""
            lines.append(f"    {kind:<15}{axis:<6}{count:>7} × {gb(float(nbytes)):>10}  "
                         f"{_seconds(t.comm[(kind, axis)])}{over}")
        if p.candidate.pipelined:
            lines.append(f"  pipeline: {p.candidate.schedule}, {p.candidate.microbatches} microbatches, "
                         f"{p.blocks} blocks on the busiest rank, bubble {p.bubble:.1%}: {_seconds(t.bubble)}")
        return "\n".join(lines)

    def _versus(self, row: Row, best: Row) -> str:
        """One line: the component that costs ``row`` most against the winner, in numbers."""
        a, b = row.timing, best.timing
        parts = {"compute": (a.busy, b.busy), "exposed communication": (a.exposed, b.exposed),
                 "pipeline bubble": (a.bubble, b.bubble)}
        name, (x, y) = max(parts.items(), key=lambda kv: kv[1][0] - kv[1][1])
        ratio = a.total / b.total if b.total else float("inf")
        why = f"{name} {_seconds(x)} vs {_seconds(y)}"
        if name == "exposed communication":
            mine, theirs = float(row.prediction.comm_bytes()), float(best.prediction.comm_bytes())
            why += f" ({mine / theirs:.2g}× the comm bytes)" if theirs else f" ({gb(mine)} sent, the winner none)"
        return f"  vs the winner ({best.candidate}): {ratio:.2f}× its step; mostly {why}"


FAILED = "its exact prediction failed"


def describe_failure(error: BaseException) -> str:
    """Why a candidate's exact prediction raised, as its drop reason: ``"its exact prediction failed: TypeError: ..."``
    (a bug in the step or its probe, not the layout: the search goes on without it)."""
    return f"{FAILED}: {type(error).__name__}: {(str(error).splitlines() or [''])[0]}"


def describe_state_drop(state: dict[str, float], cluster: Cluster) -> str:
    """Why a model state alone does not fit: ``"does not fit: 89.4 GB > 80 GB of model state alone (params ...)"``."""
    parts = ", ".join(f"{r} {gb(b)}" for r, b in sorted(state.items(), key=lambda kv: -kv[1])[:3] if b)
    return f"does not fit: {gb(sum(state.values()))} > {gb(cluster.memory)} of model state alone ({parts})"


def describe_drop(pred: Prediction, cluster: Cluster) -> str:
    """Why a prediction does not fit: ``"does not fit: 94 GB > 80 GB (opt_state 60 GB, ...)"``."""
    parts = ", ".join(f"{r} {gb(b)}" for r, b in sorted(pred.memory.items(), key=lambda kv: -kv[1])[:3] if b)
    how = "" if pred.exact else " (estimated)"
    return f"does not fit: {gb(pred.peak)} > {gb(cluster.memory)}{how} ({parts})"

