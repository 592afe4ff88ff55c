"""Step time from a prediction and a cluster: compute, communication, overlap and the pipeline bubble.

For the busiest rank::

    compute  = Σ_dtype flops / rate(dtype, mean FLOPs per matmul) + other ops' bytes / bandwidth(mean bytes per op)
    dispatch = ops · op_overhead + DTensor ops · dtensor_overhead (data-axis-only DTensors: data_dtensor_overhead)
    busy     = compute + dispatch          (CPU: the host runs both)
             = max(compute, dispatch)      (GPU: kernels run while the host dispatches the next)
    comm     = Σ_(kind, axis) count · α(link) + bytes / β(link)      (link: intra- or inter-node, cluster.link_of)
    hidden   = min(overlappable comm, overlap · busy)                (bucketed reductions, ZeRO-3 prefetch)
    step     = busy / (1 − bubble) + comm − hidden

On a machine whose ranks share few CPU cores (``cluster.cores``), a rank computes no faster than all ranks'
work shared over the cores: ``busy`` is at least ``world · busy_rank / cores``, and a pipeline's idle ranks lend
their core to the others (the bubble costs only what the cores cannot absorb). Under ``pp`` the ranks' work is
``world / pp`` replicas of all stages' work (``Prediction.replica``), less than ``world`` busiest ranks': only
the first and the last stage run the embedding and the head.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

from shardings.planner.cluster import Cluster, Link, link_of
from shardings.planner.prediction import Prediction, Work

__all__ = ["Timing", "step_time"]


@dataclasses.dataclass(frozen=True)
class Timing:
    """Seconds per step and where they go.

    Attributes:
        compute: matmuls at the achieved rate and other ops at the memory bandwidth (busiest rank).
        dispatch: host time issuing ops (eager dispatch).
        busy: what the rank's compute and dispatch take together (``cost`` module docstring).
        comm: per ``(kind, axis)``, seconds of the busiest rank's collectives.
        hidden: seconds of communication hidden behind compute.
        bubble: seconds the pipeline's schedule leaves the busiest rank idle.
        total: the step.
    """

    compute: float
    dispatch: float
    busy: float
    comm: dict[tuple[str, str], float]
    hidden: float
    bubble: float
    total: float

    @property
    def exposed(self) -> float:
        """Communication not hidden behind compute."""
        return sum(self.comm.values()) - self.hidden


def _link(axis: str, pred: Prediction, cluster: Cluster) -> Link:
    if axis == "host":
        return Link(0.0, cluster.host_bandwidth)
    sizes = pred.candidate.sizes
    if axis in sizes:
        return link_of(axis, sizes, cluster)
    return cluster.inter if cluster.nodes > 1 else cluster.intra  # the world, or a group of several axes


def step_time(pred: Prediction, cluster: Cluster) -> Timing:
    """The predicted step time of ``pred`` on ``cluster`` (module docstring)."""
    compute, dispatch, busy = _busy(pred.work, cluster)
    comm = {k: _link(k[1], pred, cluster).time(c, float(b)) for k, (c, b) in pred.comm.items()}
    world = pred.candidate.sizes and _world(pred)
    if cluster.cores is not None and world > cluster.cores:
        replicas = world // pred.candidate.size("pp")
        together = _busy(pred.replica, cluster)[2] * replicas if pred.replica else busy * world
        shared = together / cluster.cores  # every rank's work over the shared cores
        critical = busy / (1 - pred.bubble)
        stepping = max(critical, shared)
        bubble = stepping - shared if critical > shared else 0.0
        busy = shared
    else:
        bubble = busy * pred.bubble / (1 - pred.bubble)
    overlappable = sum(t for k, t in comm.items() if k in pred.overlapped)
    hidden = min(overlappable, cluster.overlap * busy)
    total = busy + bubble + sum(comm.values()) - hidden
    return Timing(compute, dispatch, busy, comm, hidden, bubble, total)


def _busy(work: Work, cluster: Cluster) -> tuple[float, float, float]:
    """``(compute, dispatch, busy)`` seconds of ``work`` on one rank (module docstring)."""
    compute = sum(f / cluster.matmul_rate(d, f / max(1.0, work.matmuls.get(d, 1.0))) for d, f in work.flops.items())
    compute += work.bytes / cluster.bandwidth(work.bytes / max(1.0, work.moves))
    data = cluster.dtensor_overhead if cluster.data_dtensor_overhead is None else cluster.data_dtensor_overhead
    dispatch = (work.ops.get("local", 0) * cluster.op_overhead + work.ops.get("dtensor", 0) * cluster.dtensor_overhead
                + work.ops.get("dtensor_data", 0) * data)
    return compute, dispatch, max(compute, dispatch) if cluster.async_dispatch else compute + dispatch


def _world(pred: Prediction) -> int:
    n = 1
    for size in pred.candidate.sizes.values():
        n *= size
    return n


def comm_seconds(rows: dict[tuple[str, str], tuple[int, Fraction]], pred: Prediction, cluster: Cluster) -> float:
    """Seconds of ``rows`` on ``pred``'s mesh (for comparisons in explanations)."""
    return sum(_link(k[1], pred, cluster).time(c, float(b)) for k, (c, b) in rows.items())
