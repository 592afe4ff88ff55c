"""Accounting: which collectives ran (kind, mesh axis, count, bytes sent per rank), and bytes held per rank.

``comms()`` is a ``TorchDispatchMode``: every collective reaches the dispatcher as one op
(``_c10d_functional.*`` from DTensor and functional collectives, their ``_autograd`` variants,
DTensor's ``_dtensor.shard_dim_alltoall``, and the in-place ``c10d.*`` ops behind
``torch.distributed.all_reduce`` and ``distribute_tensor``), so forward and backward are both
seen. The op's process group maps to a mesh axis label via :func:`shardings.spec.mesh.axis_of_group`.

Bytes are *sent per rank* by a ring (bandwidth-optimal) algorithm over the n ranks of the group,
for a buffer of B bytes:

===============  ===========================================  ===============
kind             B is                                         bytes sent
===============  ===========================================  ===============
all_reduce       the buffer being reduced (same on each rank)  2(n−1)/n · B
all_gather       the gathered output (n × the local input)     (n−1)/n · B
reduce_scatter   the input, before scattering                  (n−1)/n · B
all_to_all       one rank's input buffer                       (n−1)/n · B
scatter          the root's full buffer (n × each output)      (n−1)/n · B
broadcast        the buffer                                    B
send, ppermute   the buffer sent                               B
===============  ===========================================  ===============

An uneven ``all_to_all`` counts B minus its smallest block (what a rank sends when it keeps that
block). A group of one rank moves nothing. What is counted is what ran: e.g. DTensor's
Shard→Shard is an all_to_all under :func:`~shardings.simulate` but an all_gather (then a local
chunk) on real CPU ranks, where DTensor avoids gloo's all-to-all. Collectives inside compiled
(``torch.compile``) graphs are seen too, as the graphs run (``_CommsMode.ignore_compile_internals``).
Building a ``DeviceMesh`` (first ``mesh.device_mesh``)
may itself broadcast: build it before entering ``comms()`` to count only your step.

Copies between the compute device and host memory (offloaded roles and activations, all made by
``core.offload``) are rows too: kind ``d2h`` or ``h2d``, axis ``host``, the bytes one rank copies.

A ``ppermute`` (:func:`shardings.ppermute`: one ``all_to_all_single`` of one row, each rank's row to one peer)
is recognised by its op and counted as one ``ppermute`` of that row, in eager steps and compiled graphs alike.
A library op built from other collectives reports itself once with :func:`recorded_as`, which also hides its
insides (eager only: inside a compiled graph only what the graph runs is counted).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from fractions import Fraction
from typing import Any

import torch
import torch.distributed as dist

from core import offload, tree
from shardings.runtime.compat import (
    LocalIntNode,
    LocalTensor,
    TorchDispatchMode,
    c10d_functional_op,
    is_traceable_wrapper_subclass,
    resolve_process_group,
)
from shardings.spec.errors import sharding_error
from shardings.spec.mesh import axis_of_group

__all__ = ["Comms", "comms", "memory", "recorded_as"]

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "ppermute", "broadcast", "scatter", "send",
         "d2h", "h2d")
_RING_FACTOR = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "all_to_all": 1, "scatter": 1}  # × (n−1)/n

Handler = Callable[..., tuple[str, Any, Fraction]]  # (*op args) -> (kind, group, bytes one rank sends)


def _nbytes(x: Any) -> int:
    """Bytes of a tensor's data (the max over simulated ranks), or of a list of them."""
    if isinstance(x, list | tuple):
        return sum(_nbytes(t) for t in x)
    if isinstance(x, LocalTensor):
        return max(_nbytes(t) for t in x._local_tensors.values())
    return x.numel() * x.element_size()


def _group(arg: Any) -> dist.ProcessGroup:
    if isinstance(arg, torch.ScriptObject):
        return dist.ProcessGroup.unbox(arg)
    return resolve_process_group(arg) if isinstance(arg, str) else arg


def _sent(kind: str, n: int, full: int) -> Fraction:
    """Bytes one rank sends for a collective of ``kind`` over ``n`` ranks on a ``full``-byte buffer B."""
    if n <= 1:
        return Fraction(0)
    return Fraction(_RING_FACTOR[kind] * (n - 1) * full, n) if kind in _RING_FACTOR else Fraction(full)


def _op(kind: str, group_at: int, buffer_at: int = 0, piece: bool = False) -> Handler:
    """Handler for an op with its group at ``args[group_at]`` and B at ``args[buffer_at]``.

    ``piece``: that argument is one rank's piece of B (an all-gather input, scatter output), so B = n × it.
    """

    def handle(*args: Any) -> tuple[str, Any, Fraction]:
        group = args[group_at]
        n = _group(group).size()
        full = _nbytes(args[buffer_at]) * (n if piece else 1)
        return kind, group, _sent(kind, n, full)

    return handle


def _ints(v: Any) -> list[int]:
    """An int, or a simulated per-rank int (a SymInt over a ``LocalIntNode``), as its list of values."""
    node = getattr(v, "node", None)
    return list(node._local_ints.values()) if isinstance(node, LocalIntNode) else [int(v)]


def _all_to_all(group_at: int, buffer_at: int, splits_at: int | None) -> Handler:
    """Handler for an all-to-all; uneven splits (dim 0) count B minus the smallest block of any rank.

    One row with split sizes (each rank sends its one row to one peer) is a point-to-point permutation: a
    ``ppermute`` of B bytes, however it was called (:func:`shardings.ppermute` is built that way), so an eager step
    and a compiled graph, which runs the same op with no ``recorded_as`` around it, count it alike."""

    def handle(*args: Any) -> tuple[str, Any, Fraction]:
        group, x = args[group_at], args[buffer_at]
        splits = () if splits_at is None else args[splits_at] or ()
        if splits and x.dim() and max(_ints(x.shape[0])) == 1:
            return "ppermute", group, _sent("ppermute", _group(group).size(), _nbytes(x))
        blocks = [b for s in splits for b in _ints(s)]
        if len(set(blocks)) <= 1:  # even blocks
            return "all_to_all", group, _sent("all_to_all", _group(group).size(), _nbytes(x))
        row = _nbytes(x) // max(1, *_ints(x.shape[0]))
        return "all_to_all", group, Fraction(_nbytes(x) - min(blocks) * row)

    return handle


def _p2p_sends(op_list: list[str], _peers: Any, _tags: Any, tensors: list[torch.Tensor], group: Any) -> tuple:
    return "send", group, Fraction(sum(_nbytes(t) for op, t in zip(op_list, tensors) if "send" in op))


_F, _FA, _C = torch.ops._c10d_functional, torch.ops._c10d_functional_autograd, torch.ops.c10d
_HANDLERS: dict[Any, Handler] = {
    # functional collectives (DTensor, funcol) and their autograd variants
    **dict.fromkeys(
        [_F.all_reduce, _F.all_reduce_, _F.all_reduce_coalesced, _F.all_reduce_coalesced_], _op("all_reduce", 2)
    ),
    **dict.fromkeys(
        [
            _F.all_gather_into_tensor,
            _F.all_gather_into_tensor_out,
            _F.all_gather_into_tensor_coalesced,
            _FA.all_gather_into_tensor,
        ],
        _op("all_gather", 2, piece=True),
    ),
    **dict.fromkeys(
        [
            _F.reduce_scatter_tensor,
            _F.reduce_scatter_tensor_out,
            _F.reduce_scatter_tensor_coalesced,
            _FA.reduce_scatter_tensor,
        ],
        _op("reduce_scatter", 3),
    ),
    **dict.fromkeys([_F.all_to_all_single, _FA.all_to_all_single], _all_to_all(3, 0, 2)),
    torch.ops._dtensor.shard_dim_alltoall: _all_to_all(3, 0, None),
    **dict.fromkeys([_F.broadcast, _F.broadcast_], _op("broadcast", 2)),
    # in-place c10d ops (torch.distributed.*, distribute_tensor); the group is a ProcessGroup script object
    **dict.fromkeys([_C.allreduce_, _C.allreduce_coalesced_], _op("all_reduce", 1)),
    **dict.fromkeys([_C._allgather_base_, _C.allgather_, _C.allgather_into_tensor_coalesced_], _op("all_gather", 2)),
    **dict.fromkeys(
        [_C._reduce_scatter_base_, _C.reduce_scatter_, _C.reduce_scatter_tensor_coalesced_],
        _op("reduce_scatter", 2, buffer_at=1),
    ),
    _C.alltoall_base_: _all_to_all(2, 1, 4),
    _C.alltoall_: _op("all_to_all", 2, buffer_at=1),
    _C.broadcast_: _op("broadcast", 1),
    _C.scatter_: _op("scatter", 2, piece=True),
    _C.send: _op("send", 1),
}
for _name, _handler in [("isend", _op("send", 3)), ("batch_p2p_ops", _p2p_sends)]:  # functional p2p: torch >= 2.13
    if (_p2p := c10d_functional_op(_name)) is not None:
        _HANDLERS[_p2p] = _handler

_ACTIVE: list[Comms] = []  # every comms() being recorded into, outermost first
_HIDDEN = [0]  # depth of recorded_as blocks: collectives inside them are already accounted for


def _axis_label(group: Any) -> str:
    pg = _group(group)
    return axis_of_group(pg.group_name) or ("world" if pg == dist.group.WORLD else f"group {pg.group_name}")


class Comms:
    """The collectives recorded by one :func:`comms` block."""

    def __init__(self) -> None:
        self._totals: dict[tuple[str, str], list[Any]] = {}  # (kind, axis) -> [count, Fraction bytes]

    def add(self, kind: str, axis: str, nbytes: Fraction | int) -> None:
        """Count one collective of ``kind`` on mesh ``axis`` that sent ``nbytes`` per rank."""
        entry = self._totals.setdefault((kind, axis), [0, Fraction(0)])
        entry[0] += 1
        entry[1] += Fraction(nbytes)

    def rows(self) -> list[dict[str, Any]]:
        """One dict per (kind, axis): ``kind``, ``axis``, ``count``, ``bytes`` (sent per rank, rounded).

        >>> with simulate(2):  # doctest: +SKIP
        ...     with comms() as c:
        ...         d.redistribute(mesh.device_mesh, [Replicate()])  # a Partial 64-byte buffer on dp
        >>> c.rows()  # doctest: +SKIP
        [{'kind': 'all_reduce', 'axis': 'dp', 'count': 1, 'bytes': 64}]
        """
        order = {k: i for i, k in enumerate(KINDS)}
        keys = sorted(self._totals, key=lambda ka: (order.get(ka[0], len(order)), ka))
        return [
            {"kind": k, "axis": a, "count": self._totals[k, a][0], "bytes": round(self._totals[k, a][1])}
            for k, a in keys
        ]

    def totals(self) -> dict[tuple[str, str], tuple[int, Fraction]]:
        """``(kind, axis) -> (count, bytes sent per rank)``, bytes exact (unrounded): :meth:`rows` before rounding."""
        return {key: (count, nbytes) for key, (count, nbytes) in self._totals.items()}

    def total_bytes(self) -> int:
        """Bytes sent per rank by every recorded collective together."""
        return round(sum((b for _, b in self._totals.values()), Fraction(0)))

    def table(self) -> str:
        """The rows as a readable text table, with a total line."""
        rows = self.rows()
        lines = [f"{'kind':<15} {'axis':<10} {'count':>6} {'bytes/rank':>14}"]
        lines += [f"{r['kind']:<15} {r['axis']:<10} {r['count']:>6} {_human(r['bytes']):>14}" for r in rows]
        lines.append(f"{'total':<15} {'':<10} {sum(r['count'] for r in rows):>6} {_human(self.total_bytes()):>14}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"Comms({self.rows()})"


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class _CommsMode(TorchDispatchMode):
    """Sees every op dispatched while active (on any thread autograd uses) and records the collectives."""

    def __init__(self, report: Comms):
        super().__init__()
        self.report = report

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """torch.compile traces and compiles with this mode off, then runs the compiled graphs with it on: each
        collective a graph runs reaches the dispatcher as one op and is counted, as in the eager step."""
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        handler = _HANDLERS.get(func.overloadpacket)
        if handler is not None and not _HIDDEN[0]:
            kind, group, sent = handler(*args)
            self.report.add(kind, _axis_label(group), sent)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def comms() -> Iterator[Comms]:
    """Record every collective run inside the block, forward and backward.

    Enter it where the process group already runs: inside ``simulate(n)``, or inside a launched
    function (each real rank records its own collectives).

    Raises:
        RuntimeError: no process group is running (a ``simulate`` entered *inside* ``comms``
            would hide its collectives from it).

    >>> with simulate(4):  # doctest: +SKIP
    ...     with comms() as c:
    ...         step(params, opt_state, batch)
    ...     print(c.table())
    """
    if not dist.is_initialized():
        raise sharding_error(
            "comms() entered with no process group running: collectives of a simulate() started inside it "
            "are invisible to it",
            fix="enter comms() inside `with shardings.simulate(n):` or inside a function run by shardings.launch",
            cls=RuntimeError,
        )
    report = Comms()
    _ACTIVE.append(report)
    try:
        with _CommsMode(report), offload.listening(lambda kind, nbytes: report.add(kind, "host", nbytes)):
            yield report
    finally:
        _ACTIVE.remove(report)


@contextlib.contextmanager
def recorded_as(kind: str, axis: str, nbytes: int | torch.Tensor) -> Iterator[None]:
    """Count the block as one collective of ``kind`` on ``axis``; collectives inside are not counted.

    For library ops built out of other collectives, e.g. a ``ppermute`` implemented with
    all-to-all or send/recv. ``nbytes`` is what one rank sends (a tensor means its size).
    A backward that runs collectives should wrap them the same way.

    >>> with recorded_as("ppermute", "cp", x):  # doctest: +SKIP
    ...     y = _ppermute_via_all_to_all(x, perm)
    """
    if torch.compiler.is_compiling():  # inside a compiled block, which the counting dispatch mode does not see
        yield
        return
    sent = _nbytes(nbytes) if isinstance(nbytes, torch.Tensor) else nbytes
    for c in _ACTIVE:
        c.add(kind, axis, sent)
    _HIDDEN[0] += 1
    try:
        yield
    finally:
        _HIDDEN[0] -= 1


def _local_parts(x: torch.Tensor) -> list[tuple[int | None, torch.Tensor]]:
    """(rank, plain tensor) pieces that hold ``x``'s data; rank ``None`` means "on every rank"."""
    if isinstance(x, LocalTensor):
        return [(r, t) for r, t in x._local_tensors.items()]
    if is_traceable_wrapper_subclass(x):  # DTensor and friends: their inner (local) tensors
        names, _ = x.__tensor_flatten__()
        inner = [getattr(x, name) for name in names]
        return [p for t in inner if isinstance(t, torch.Tensor) for p in _local_parts(t)]
    return [(None, x)]


def _storage(t: torch.Tensor) -> tuple[Any, int]:
    own = ("tensor", id(t)), t.numel() * t.element_size()
    try:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
    except (RuntimeError, NotImplementedError):  # wrapper subclasses (e.g. async collective results)
        return own
    if ptr == 0:  # meta/fake tensors have no data to share: count the tensor itself
        return own
    return (t.device, ptr), storage.nbytes()


def memory(params: Any) -> int:
    """Bytes held per rank by the tensors in a pytree: the max over ranks, each storage counted once.

    DTensors count their local shard; under ``simulate`` each rank's shard is counted for that
    rank (uneven shards differ). A view keeps its whole storage alive, so it counts all of it.

    >>> memory({"w": torch.zeros(4, 4), "v": torch.zeros(2)})
    72
    """
    everywhere: dict[Any, int] = {}
    by_rank: dict[int, dict[Any, int]] = {}
    for leaf in tree.leaves(params):
        if not isinstance(leaf, torch.Tensor):
            continue
        for rank, t in _local_parts(leaf):
            key, nbytes = _storage(t)
            (everywhere if rank is None else by_rank.setdefault(rank, {}))[key] = nbytes
    if not by_rank:
        return sum(everywhere.values())
    return max(sum({**everywhere, **held}.values()) for held in by_rank.values())
