"""Simulated ranks: N ranks in one process (``LocalTensorMode`` over the ``"fake"`` process group).

Every tensor created inside holds one value per rank; collectives run for real across those
values. Fast and deterministic: the runtime for property tests and laptops. Needs torch >= 2.13
(:mod:`shardings.runtime.compat`); on an older torch ``simulate`` raises ``SimulationUnavailable``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from shardings.runtime import fastlocal
from shardings.runtime.compat import FakeStore, LocalTensor, LocalTensorMode, require_simulation
from shardings.spec.errors import sharding_error
from shardings.spec.mesh import _clear_device_meshes

__all__ = ["per_rank", "rank_threads", "simulate", "simulated", "simulated_calls", "simulated_world_size", "unwrap"]

_ACTIVE: list[int] = []


def rank_threads(world_size: int) -> int:
    """The intra-op threads one of ``world_size`` ranks gets: this machine's cores split between them, at least one.

    Real gloo ranks (:func:`shardings.launch`) run with it, and so do simulated ranks: their ops are small per-rank
    slices run one after another, where torch's thread pool costs more than it gives (measured under load: a
    ``(4, 8, 16) x (16, 32)`` einsum 0.55 ms wall / 0.18 ms CPU on 2 threads, 0.05 / 0.01 ms on one).
    """
    return max(1, (os.cpu_count() or 1) // world_size)


def simulated_world_size() -> int | None:
    """The world size of the innermost active :func:`simulate`, or ``None`` outside one."""
    return _ACTIVE[-1] if _ACTIVE else None


def simulated() -> bool:
    """Whether the ranks are simulated (inside :func:`simulate`: every rank in this process), not real processes.

    The one place that question is answered: a pipeline runs every stage here when it is true, and each rank
    holds every parameter; checkpoints gather whole tensors.
    """
    return simulated_world_size() is not None


@contextlib.contextmanager
def simulate(world_size: int) -> Iterator[None]:
    """Run the body as ``world_size`` simulated ranks in this process.

    Re-entrant: a nested ``simulate`` with the same size reuses the outer one. Inside, torch's intra-op threads are
    at most :func:`rank_threads` (what a real rank gets). On exit the process group and every cached device mesh
    are torn down and the thread count restored, leaving no global state.

    Raises:
        SimulationUnavailable: the installed torch is older than 2.13 (a ``RuntimeError``).

    >>> with simulate(4):
    ...     x = shard(torch.arange(8.0), P("dp"), Mesh(dp=4))
    """
    require_simulation("shardings.simulate")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise sharding_error(f"world_size must be a positive int, got {world_size!r}", fix="pass e.g. simulate(4)")
    if _ACTIVE:
        if _ACTIVE[-1] != world_size:
            raise sharding_error(
                f"simulate({world_size}) nested inside simulate({_ACTIVE[-1]})",
                fix="leave the outer simulate first, or use the same world size",
            )
        yield
        return
    if dist.is_initialized():
        raise sharding_error(
            f"simulate({world_size}) inside a running process group (backend {dist.get_backend()!r})",
            fix="simulate from a plain process, or use the real ranks you already have",
            cls=RuntimeError,
        )
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    _ACTIVE.append(world_size)
    threads = torch.get_num_threads()
    torch.set_num_threads(min(threads, rank_threads(world_size)))  # never more than the caller chose
    try:
        with LocalTensorMode(world_size), fastlocal.installed():
            yield
    finally:
        torch.set_num_threads(threads)
        _ACTIVE.pop()
        _clear_device_meshes()
        dist.destroy_process_group()


def simulated_calls(reset: bool = False) -> dict[str, int]:
    """How much per-rank work simulated ranks did since the last reset: ``rank_ops``, the ops x ranks that went
    through :mod:`shardings.runtime.fastlocal`'s per-rank loop. A measure of the work that no machine load changes;
    ``reset=True`` zeroes it after reading."""
    counts = {"rank_ops": fastlocal.CALLS["rank_ops"]}
    if reset:
        fastlocal.CALLS.clear()
    return counts


def per_rank(x: Any) -> list[Any]:
    """The per-rank values of ``x``: a list of plain tensors under :func:`simulate`, ``[x]`` otherwise.

    Works for plain/Local tensors; a DTensor yields each rank's local shard.
    """
    from torch.distributed.tensor import DTensor

    if isinstance(x, DTensor):
        x = x.to_local()
    if isinstance(x, LocalTensor):
        return [x._local_tensors[r] for r in sorted(x._local_tensors)]
    return [x]


def unwrap(x: Any) -> Any:
    """A plain tensor from a ``LocalTensor`` whose ranks all hold the same value; other values pass through.

    Raises:
        ValueError: the ranks hold different values (or shapes).

    >>> with simulate(2):
    ...     unwrap(torch.ones(2))
    tensor([1., 1.])
    """
    if not isinstance(x, LocalTensor):
        return x
    values = per_rank(x)
    for rank, v in enumerate(values[1:], start=1):
        same = v.shape == values[0].shape and (
            torch.equal(v, values[0]) or (v.is_floating_point() and torch.allclose(v, values[0], 0, 0, equal_nan=True))
        )
        if not same:
            raise sharding_error(
                f"rank {rank} holds a different value than rank 0 (shapes {tuple(v.shape)} and "
                f"{tuple(values[0].shape)})",
                fix="use per_rank(x) to look at rank-dependent values",
            )
    return values[0]
