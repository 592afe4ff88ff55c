"""One train step on fake tensors, as rank 0 of any world size: what it sends, holds and computes.

A fake tensor has a shape, a dtype and a device but no data (``FakeTensorMode``), and the ``"fake"``
process group lets one process be rank 0 of a world of any size: its collectives return at once. Together
they run the real :func:`shardings.train_step` — the same code path as a simulated or real step — on
parameters that are never allocated, so a 405B-parameter model's step costs what a tiny one's does (each op
is a shape computation). What it measures:

- the collectives (``shardings.comms()``, the step's own ``metrics["comm"]``): kind × mesh axis, count and
  bytes sent per rank, the numbers a simulated step of the same layout reports; and each by the phase it ran in
  (:data:`PHASES`: in autograd's backward; else before the step's last backward op, forward; else after it, the
  update: gradient reductions left after backward, the optimizer, ZeRO-1/2's gather of the updated parameters);
- the peak bytes of live tensors during the step (:func:`shardings.peak_memory` from the params, the optimizer
  state and the batch), the per-role bytes of ``metrics["memory"]`` and the most bytes of activations saved for
  backward at once (:class:`shardings.pipeline.SavedActivations`: with ``pp`` the schedule's own count, else around
  the step, seen beneath its ZeRO-3 re-gather hooks);
- the FLOPs of every matmul and attention (``torch.utils.flop_counter``'s formulas; causal attention counts the
  half a causal kernel computes) and the ops dispatched on DTensors and on plain tensors (what eager dispatch
  costs on a CPU).

Recipe and pitfalls (found by the lead, ``docs/planner.md``): the device mesh is built before entering fake
mode (``init_device_mesh`` reads a tensor's values); the parameters are fake DTensors made from their specs
(``shardings.init`` would evaluate every rank's recipe); the step runs with ``scalar_metrics=False`` (no
``float()`` of a fake loss). Pipelined layouts run every stage in this process, as on simulated ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator
from fractions import Fraction
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.utils.flop_counter as flop_counter
from torch.distributed.tensor import DTensor

import core
from core import deferred, tree
from shardings.comm.accounting import comms
from shardings.comm.peak_memory import peak_memory
from shardings.pipeline import SavedActivations, plan
from shardings.pipeline.stages import rank_stages
from shardings.runtime.compat import (
    FakeStore,
    FakeTensorMode,
    StridedShard,
    TorchDispatchMode,
    compute_local_shape_and_global_offset,
    current_graph_task_id,
    disable_current_modes,
)
from shardings.spec import layouts, lower
from shardings.spec.errors import sharding_error
from shardings.spec.mesh import Mesh, _clear_device_meshes
from shardings.spec.rules import is_names
from shardings.step.initialize import param_specs
from shardings.step.train_step import train_step

__all__ = ["PHASES", "Measured", "OpCounter", "measure", "rank_zero_of"]

PHASES = ("forward", "backward", "update")  # where a step's collective runs (module docstring)


@dataclasses.dataclass(frozen=True)
class Measured:
    """What one step on fake tensors did, on rank 0.

    Attributes:
        comm: ``(kind, axis) -> (count, bytes sent per rank)``, bytes exact (a ``Fraction``).
        phases: ``(kind, axis, phase) -> (count, bytes sent per rank)``: ``comm`` by :data:`PHASES`.
        peak: the most bytes of live tensors at once during the step, the entry's included.
        at_entry: bytes live at entry (params, optimizer state, batch).
        roles: ``metrics["memory"]``: bytes per role held after the step.
        saved: the most bytes of activations saved for backward at once: with ``pp`` per pipeline rank, else
            one value (this rank's).
        flops: floating-point operations of matmuls and attention, forward and backward, by dtype name.
        matmuls: how many ops those FLOPs are in, by dtype name (their mean size sets their rate).
        bytes: bytes read and written by the other ops (elementwise, reductions, copies, the optimizer's).
        moves: how many ops those bytes are in (their mean size sets their rate: small ones stay in cache).
        ops: ``{"dtensor": n, "dtensor_data": n, "local": n}``: ops dispatched with a DTensor argument laid out
            over a model-parallel mesh axis (tp, sp, cp, ep: sharded or partial there), with DTensor arguments laid
            out over data axes only (a pipeline stage's data-parallel DTensors), and on plain tensors.
    """

    comm: dict[tuple[str, str], tuple[int, Fraction]]
    phases: dict[tuple[str, str, str], tuple[int, Fraction]]
    peak: int
    at_entry: int
    roles: dict[str, int]
    saved: list[int]
    flops: dict[str, int]
    matmuls: dict[str, int]
    bytes: int
    moves: int
    ops: dict[str, int]


@contextlib.contextmanager
def rank_zero_of(world_size: int) -> Iterator[None]:
    """This process as rank 0 of ``world_size`` ranks: the ``"fake"`` process group, every collective a no-op.

    Unlike :func:`shardings.simulate` there is no ``LocalTensorMode``: tensors are rank 0's alone.

    Raises:
        ShardingError: a process group is already running.
    """
    if dist.is_initialized():
        raise sharding_error(f"the planner's fake step needs its own process group, and one is running "
                             f"(backend {dist.get_backend()!r})",
                             fix="plan outside shardings.simulate/launch (plan first, then run the winner)",
                             cls=RuntimeError)
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        _clear_device_meshes()
        dist.destroy_process_group()


class OpCounter(TorchDispatchMode):
    """Counts dispatched ops (on DTensors, on plain tensors), the FLOPs of matmuls and attention by dtype, and
    the bytes the other ops read and write (views and collectives move none here)."""

    _CPU_SDPA: ClassVar[dict] = {
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: flop_counter.sdpa_flop_count,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: flop_counter.sdpa_backward_flop_count}
    _COMM: ClassVar[frozenset] = frozenset({"_c10d_functional", "_c10d_functional_autograd", "c10d", "_dtensor"})

    def __init__(self) -> None:
        super().__init__()
        self.flops: dict[str, int] = {}
        self.matmuls: dict[str, int] = {}
        self.bytes = 0
        self.moves = 0  # the ops those bytes are in
        self.ops = {"dtensor": 0, "dtensor_data": 0, "local": 0}
        self.clock = 0  # ops dispatched so far
        self.last_backward = 0  # the clock at the last op autograd's backward dispatched

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        self.clock += 1
        if current_graph_task_id() != -1:
            self.last_backward = self.clock
        out = func(*args, **kwargs)
        if any(issubclass(t, DTensor) for t in types):
            self.ops["dtensor" if _model_parallel((args, kwargs)) else "dtensor_data"] += 1
            return out
        self.ops["local"] += 1
        packet = func.overloadpacket
        if packet in flop_counter.flop_registry or packet in self._CPU_SDPA:
            flops = (flop_counter.flop_registry[packet](*args, **kwargs, out_val=out)
                     if packet in flop_counter.flop_registry else self._sdpa(packet, args, kwargs))
            dtype = str(next(a for a in args if isinstance(a, torch.Tensor)).dtype).removeprefix("torch.")
            self.flops[dtype] = self.flops.get(dtype, 0) + flops
            self.matmuls[dtype] = self.matmuls.get(dtype, 0) + 1
        elif not func.is_view and func.namespace not in self._COMM:
            self.moves += 1
            self.bytes += sum(t.numel() * t.element_size() for t in tree.leaves((args, out))
                              if isinstance(t, torch.Tensor))
        return out

    def _sdpa(self, packet: Any, args: tuple, kwargs: dict) -> int:
        backward = packet is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        shapes = [a.shape for a in args[: 4 if backward else 3]]
        causal = args[7] if backward else (args[4] if len(args) > 4 else kwargs.get("is_causal", False))
        flops = self._CPU_SDPA[packet](*shapes)
        return flops // 2 if causal else flops  # a causal kernel skips the masked half


def _model_parallel(args: Any) -> bool:
    """Whether a DTensor among ``args`` is sharded or partial over a mesh axis outside ``DATA_AXES``: its op's
    sharding propagation and layout work are the model-parallel kind (``OpCounter.ops``)."""
    for t in tree.leaves(args):
        if isinstance(t, DTensor):
            names = t.device_mesh.mesh_dim_names or ()
            if any(not p.is_replicate() and (i >= len(names) or names[i] not in layouts.DATA_AXES)
                   for i, p in enumerate(t.placements)):
                return True
    return False


def _fake_params(model: Any, cfg: Any, layout: layouts.Layout, mesh: Mesh, mode: FakeTensorMode) -> tuple[Any, Any]:
    """The model's parameters as fake DTensors in their storage layout, and their logical axes."""
    with deferred.deferred():
        recipes = model.init(core.random.key(0), cfg)
    axes = model.axes(cfg)
    specs = param_specs(axes, recipes, layout, mesh)
    dm = mesh.device_mesh

    def fake(recipe: Any, spec: Any) -> DTensor:
        shape = torch.Size(recipe.shape)
        placements = lower.to_placements(spec, mesh, len(shape))
        local = compute_local_shape_and_global_offset(shape, dm, placements)[0]
        with mode:
            block = torch.empty(local, dtype=recipe.dtype)
        return DTensor.from_local(block, dm, placements, run_check=False, shape=shape,
                                  stride=torch.empty(shape, device="meta").stride())

    params = tree.map(fake, recipes, specs)
    for p, names in zip(tree.leaves(params), tree.leaves(axes, is_leaf=is_names)):
        p._logical_names = tuple(names)
    return params, axes


@contextlib.contextmanager
def _by_phase(report: Any, counter: OpCounter) -> Iterator[dict[tuple[str, str, str], tuple[int, Fraction]]]:
    """``report``'s collectives (a ``comms()`` block's) by phase (:data:`PHASES`), filled when the block ends: each
    one's place is the ``counter``'s clock when it ran (``counter`` sees every op of the step)."""
    runs: list[tuple[str, str, Fraction, bool, int]] = []
    add = report.add

    def add_at(kind: str, axis: str, nbytes: Fraction | int) -> None:
        add(kind, axis, nbytes)
        runs.append((kind, axis, Fraction(nbytes), current_graph_task_id() != -1, counter.clock))

    report.add = add_at
    out: dict[tuple[str, str, str], tuple[int, Fraction]] = {}
    try:
        yield out
    finally:
        del report.add
    for kind, axis, nbytes, backward, clock in runs:
        phase = "backward" if backward else "forward" if clock < counter.last_backward else "update"
        count, total = out.get((kind, axis, phase), (0, Fraction(0)))
        out[(kind, axis, phase)] = (count + 1, total + nbytes)


@contextlib.contextmanager
def _strided_shard_sizes_on_ints() -> Iterator[None]:
    """torch's ``_StridedShard.local_shard_size_and_offset`` finds a rank's indices by ``torch.arange(...).tolist()``:
    on fake tensors that reads data (``aten._local_scalar_dense``) and fails wherever a step's DTensors meet a strided
    shard (an einsum over heads under tp, ``F.cross_entropy`` on vocab-sharded logits), though it runs on real ones.
    Those indices are integers about shapes, not the step's data: when that fails, computed outside the fake mode."""
    original = StridedShard.local_shard_size_and_offset

    def sizes(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, *args, **kwargs)
        except RuntimeError:  # DataDependentOutputException
            with disable_current_modes():
                return original(self, *args, **kwargs)

    StridedShard.local_shard_size_and_offset = sizes
    try:
        yield
    finally:
        StridedShard.local_shard_size_and_offset = original


def measure(model: Any, cfg: Any, *, layout: Any, mesh: dict[str, int], batch_rows: int,
            optimizer: Any = None, precision: Any = None, microbatches: int = 1, schedule: str | None = None,
            virtual_stages: int | None = None, stage_sizes: list[int] | None = None,
            ends: tuple[bool, bool] = (True, True)) -> Measured:
    """Run one train step of ``model`` on fake tensors as rank 0 of ``mesh`` and measure it (module docstring).

    Args:
        model: the model module (``init``, ``axes``, ``loss``, ``stages``, ``example_batch``).
        cfg: its config (``seq_len``: the batch's tokens per sequence).
        layout: a layout string or ``Layout``.
        mesh: mesh sizes by axis name.
        batch_rows: the global batch, in sequences.
        optimizer: a ``core.optim`` transformation (default AdamW).
        precision: a ``core.precision.Policy`` or ``None``.
        microbatches: accumulation steps, or with ``pp`` the pipeline's microbatches.
        schedule: with ``pp``, the schedule's name (default ``shardings.pipeline.DEFAULT_SCHEDULE``).
        virtual_stages: with ``pp`` and an interleaved schedule, stages per rank.
        stage_sizes: with ``pp``, blocks per stage.
        ends: with ``pp``, whether the rank this step stands for runs the model's first stage and its last
            (:func:`shardings.pipeline.stages.rank_stages`).

    Returns:
        A :class:`Measured`.
    """
    layout = layouts.get(layout)
    optimizer = optimizer if optimizer is not None else core.optim.adamw(1e-3)
    full = Mesh(dict(mesh))
    with rank_zero_of(full.size), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")
        full.device_mesh  # noqa: B018  (before fake mode: building it reads a tensor's values)
        stage_mesh = full.without("pp") if layout.pipelined else full
        stage_mesh.device_mesh  # noqa: B018
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        params, axes = _fake_params(model, cfg, layout, stage_mesh, mode)
        loss = rank_stages(model.stages(cfg), *ends) if layout.pipelined else _bound(model.loss, cfg)
        pipe = plan(layout, full, params, schedule=schedule, microbatches=microbatches, virtual_stages=virtual_stages,
                    stage_sizes=stage_sizes, blocks=loss.blocks) if layout.pipelined else None
        with mode, _strided_shard_sizes_on_ints():
            batch = model.example_batch(cfg, batch_rows)
            step = train_step(loss, optimizer, layout=layout, mesh=full, axes=axes, precision=precision, plan=pipe,
                              accum_steps=microbatches or 1, scalar_metrics=False, count_comms=False, donate=True)
            state = step.init(params)
            params = step.stored(params)  # as steps after the first see them (zero1/2 + policy: the compute copy)
            counter, saved = OpCounter(), SavedActivations(1, params)
            with (peak_memory(roots=(params, state, batch)) as peak, counter, comms() as sent,
                  _by_phase(sent, counter) as phases, saved.hooks(0)):
                _, _, metrics = step(params, state, batch)
        comm = sent.totals()  # the step's own collectives (no scalar metrics: nothing after them), unrounded
        pipe = metrics.get("pipeline")
        return Measured(comm, phases, peak.peak, peak.at_entry, dict(metrics["memory"]),
                        pipe["saved_peak"] if pipe else saved.peak, dict(counter.flops), dict(counter.matmuls),
                        counter.bytes, counter.moves, dict(counter.ops))


def _bound(loss: Any, cfg: Any) -> Any:
    def bound(params: Any, batch: Any) -> torch.Tensor:
        return loss(params, batch, cfg)

    return bound
