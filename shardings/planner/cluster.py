"""A cluster as the planner sees it: devices per node, memory, compute rates and two classes of link.

The numbers are data (Hydra configs under ``experiments/conf/cluster``: the H100 figures from the vendors'
specifications, this machine's measured by ``python -m experiments.plan calibrate``). Nothing here runs a
collective: :func:`link_of` only says which link a mesh axis's collectives cross, from where the axis's ranks
sit (mesh axes are laid out major to minor over consecutive ranks, ``init_device_mesh``'s order).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["Cluster", "Link", "link_of"]


@dataclasses.dataclass(frozen=True)
class Link:
    """One class of link: ``time = alpha + bytes / bandwidth`` per collective, ``bytes`` sent per rank.

    Attributes:
        alpha: seconds per collective (latency and launch), whatever its size.
        bandwidth: bytes per second one rank sends over it (the accounting's "bytes sent per rank").
    """

    alpha: float
    bandwidth: float

    def time(self, count: float, nbytes: float) -> float:
        """Seconds for ``count`` collectives sending ``nbytes`` per rank in all."""
        return count * self.alpha + nbytes / self.bandwidth


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Devices, their rates and links.

    Attributes:
        name: for display (``h100x64``).
        nodes: number of nodes.
        per_node: devices (ranks) per node; tensor parallelism stays within one.
        memory: bytes of device memory per rank that a step may use.
        flops: peak matmul FLOP/s per rank by compute dtype name (``"float32"``, ``"bfloat16"``).
        efficiency: the fraction of ``flops`` matmuls and attention reach.
        matmul_curve: by dtype name, ``[FLOPs of one matmul, FLOP/s it reaches]`` points measured at several sizes
            (small matmuls run far below peak): the rate of a matmul is interpolated on them (log-log) and capped at
            ``flops · efficiency``; ``None``: every matmul at ``flops · efficiency``.
        mem_bandwidth: bytes/s of device memory one rank reads and writes (elementwise ops, the optimizer).
        bandwidth_curve: ``[bytes one op moves, bytes/s]`` points measured at several sizes (a small op's tensors stay
            in cache), interpolated (log-log) and at least ``mem_bandwidth``; ``None``: every op at ``mem_bandwidth``.
        op_overhead: seconds to dispatch one op on plain tensors (eager PyTorch).
        dtensor_overhead: seconds to dispatch one op on DTensors laid out over a model-parallel axis (tp, sp, cp,
            ep: sharding propagation, layout changes), on top.
        async_dispatch: ops are queued to a device that runs them while the host dispatches the next (GPUs): an
            op costs the larger of its dispatch and its kernel; else (CPU) their sum.
        intra: the link between ranks of one node.
        inter: the link between nodes.
        host_bandwidth: bytes/s between device and host memory (offload).
        cores: CPU cores all ranks share (this machine: ranks are processes on few cores); ``None``: each rank
            computes on its own device.
        data_dtensor_overhead: seconds to dispatch one op on DTensors laid out over data axes only (a pipeline
            stage's data-parallel DTensors), on top of ``op_overhead``; ``None``: ``dtensor_overhead``.
        overlap: the fraction of overlappable communication (data-parallel reductions bucketed in backward,
            ZeRO-3 prefetched gathers) that hides behind compute, at most the compute's length.
    """

    name: str
    nodes: int
    per_node: int
    memory: float
    flops: Mapping[str, float]
    efficiency: float
    mem_bandwidth: float
    op_overhead: float
    dtensor_overhead: float
    async_dispatch: bool
    intra: Link
    inter: Link
    host_bandwidth: float
    cores: float | None = None
    overlap: float = 1.0
    matmul_curve: Mapping[str, Sequence[Sequence[float]]] | None = None
    bandwidth_curve: Sequence[Sequence[float]] | None = None
    data_dtensor_overhead: float | None = None

    @property
    def world(self) -> int:
        """Ranks in all."""
        return self.nodes * self.per_node

    def matmul_rate(self, dtype: str, per_op: float | None = None) -> float:
        """Achieved FLOP/s of matmuls in ``dtype`` (a name like ``"bfloat16"``; unknown: float32's) of ``per_op``
        FLOPs each (``matmul_curve``; ``None``: large ones)."""
        peak = self.flops.get(dtype, self.flops["float32"]) * self.efficiency
        curve = (self.matmul_curve or {}).get(dtype, ())
        return peak if per_op is None or not curve else min(peak, _interpolate(curve, per_op))

    def bandwidth(self, per_op: float | None = None) -> float:
        """Bytes/s of ops that move ``per_op`` bytes each (``bandwidth_curve``; ``None``: ``mem_bandwidth``)."""
        if per_op is None or not self.bandwidth_curve:
            return self.mem_bandwidth
        return max(self.mem_bandwidth, _interpolate(self.bandwidth_curve, per_op))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> Cluster:
        """A cluster from plain values (a Hydra node): ``intra``/``inter`` as ``{alpha, bandwidth}``.

        Raises:
            ValueError: a missing or unknown field, named.
        """
        values = dict(values)
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown, missing = set(values) - fields, {f.name for f in dataclasses.fields(cls)
                                                   if f.default is dataclasses.MISSING} - set(values)
        if unknown or missing:
            raise ValueError(f"cluster {values.get('name', '?')!r}: unknown fields {sorted(unknown)}, missing "
                             f"{sorted(missing)}. Fix: give exactly the fields of shardings.planner.Cluster.")
        for link in ("intra", "inter"):
            values[link] = Link(**dict(values[link]))
        values["flops"] = dict(values["flops"])
        if values.get("matmul_curve"):
            values["matmul_curve"] = {k: [tuple(p) for p in v] for k, v in dict(values["matmul_curve"]).items()}
        if values.get("bandwidth_curve"):
            values["bandwidth_curve"] = [tuple(p) for p in values["bandwidth_curve"]]
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """Plain values, :meth:`from_dict`'s inverse."""
        return dataclasses.asdict(self)


def _interpolate(points: Sequence[Sequence[float]], x: float) -> float:
    """``y`` at ``x`` on measured ``(x, y)`` points, log-log between them, flat beyond them."""
    points = sorted(points)
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if x <= x1:
            t = math.log(x / x0) / math.log(x1 / x0)
            return math.exp(math.log(y0) + t * math.log(y1 / y0))
    return points[-1][1]


def link_of(axis: str, sizes: Mapping[str, int], cluster: Cluster) -> Link:
    """The link a collective over mesh ``axis`` crosses: ``intra`` when each of its groups fits in one node.

    Mesh axes are laid out major to minor over consecutive ranks, so an axis's group strides by the product of
    the sizes after it; its ranks span ``stride × size`` consecutive ranks, within one node iff that is at most
    ``per_node`` (nodes hold consecutive ranks).

    >>> c = Cluster("x", 2, 8, 80e9, {"float32": 1e12}, 0.5, 1e12, 0.0, 0.0, True, Link(1e-5, 4e11),
    ...             Link(2e-5, 5e10), 5e10)
    >>> link_of("tp", {"dp": 2, "tp": 8}, c) is c.intra, link_of("dp", {"dp": 2, "tp": 8}, c) is c.inter
    (True, True)
    """
    names = list(sizes)
    stride = 1
    for name in names[names.index(axis) + 1:]:
        stride *= sizes[name]
    return cluster.intra if stride * sizes[axis] <= cluster.per_node else cluster.inter
