"""The train step under a layout with ``pp``: the pipeline across stages, the other presets inside each stage.

``"layers" → "pp"`` (preset ``pp``) puts a model's blocks on the mesh axis ``pp``. Each stage runs on
the mesh of the other axes as this rank sees it (``mesh.without("pp")``: the slice holding it), with
the rest of the layout (any of ``PIPELINE_PRESETS``: the data presets ``dp``/``zero1``/``zero2``/``zero3``/
``hsdp``, ``tp``, ``sp``, ``cp``/``cp_allgather``, ``ep``) applied there as usual: params, batch and
activations are DTensors on the stage mesh. The batch is split into ``microbatches`` (each
data-parallel rank splits its own rows), the schedule (``gpipe``, ``1f1b`` or a checked
:class:`~shardings.pipeline.Schedule`) runs them through the stages (:func:`shardings.pipeline.run`),
gradients accumulate over microbatches and are reduced once per step over the data axes (``no_sync``),
the loss is the global token mean, and clipping sees every stage's gradients.

On simulated ranks every stage runs in this process (the stage mesh's DTensors then hold the same
values on the ranks of every stage). On real processes each rank runs its own stage's actions and
carries travel as local blocks over the ``pp`` group (laid out on arrival by the model's
``Stages.carry_names``). A rank holds only its own stage's blocks: ``shardings.init`` makes the other
blocks placeholders (meta-device DTensors), and gradients, optimizer state and the update cover the
rank's own leaves (:mod:`shardings.step.stage_state`). The parameters outside the blocks (embedding,
final norm, head: used by the first and the last stage) are held by every rank and their gradients
summed over ``pp``. The global norm for clipping adds each stage's part once (a scalar all-reduce over
``pp``). :meth:`PipelineStep.gather_stages` fetches each block from the rank that owns it.

**ZeRO-3 (and HSDP) inside a stage: gathered once per step.** Before the schedule runs, a rank gathers
its stage's weights into their compute layout (one all-gather per bucket, never mixing two blocks:
:func:`~shardings.residency.gather_buckets.gather`), and every microbatch's forward and backward use
them; gradients accumulate unreduced over the microbatches and are reduce-scattered once at the end.
So a step has as many all-gathers (and reduce-scatters) whatever the microbatch count ``m``, each moving
``(N−1)/N`` of the stage's weights: ZeRO-2's volume. Gathering per microbatch instead (FSDP's per-block
gather, re-gathered in backward) would keep one block gathered at a time but cost ``2m`` all-gathers per
block per step, and under 1F1B a stage alternates forwards and backwards of different microbatches in its
steady state, so its blocks are needed almost all the step anyway (torchtitan turns FSDP's reshard after
forward off under pp for the same reason). The price is memory during the step: the stage's whole
weights in their compute layout (``4·P_s/t`` bytes in fp32 for ``P_s`` stage parameters under ``tp=t``,
instead of one block's) from the first forward to the last backward, next to the unreduced gradients
(``4·P_s/t``, as every data preset under pp holds them: ``no_sync``). Between steps a rank keeps ZeRO-3's
``16·P_s/N``; the in-step peak is ZeRO-2's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import core
from core import tree
from shardings.comm import accounting, buckets
from shardings.ops.module_tp import dtensor_errors
from shardings.pipeline import Schedule, Stages, build, run, split
from shardings.pipeline.stages import block_index
from shardings.residency import gather_buckets
from shardings.spec import layouts, lower
from shardings.spec.context import use
from shardings.spec.errors import sharding_error
from shardings.spec.mesh import Mesh
from shardings.spec.placeholder import resolve
from shardings.spec.rules import logical_to_spec
from shardings.step import stage_state
from shardings.step.initialize import placeholder
from shardings.step.train_step import TrainStep

__all__ = ["PIPELINE_PRESETS", "PipelineStep", "has_pp"]

PIPELINE_PRESETS = frozenset({"pp", "dp", "zero1", "zero2", "zero3", "hsdp", "tp", "sp", "cp", "cp_allgather", "ep"})


def has_pp(layout: Any) -> bool:
    """Whether the layout (a preset string or ``Layout``) includes the ``pp`` preset."""
    name = layouts.get(layout).name or ""
    return "pp" in name.split("+")


class PipelineStep(TrainStep):
    """A :class:`TrainStep` whose gradients come from a pipeline schedule (module docstring)."""

    def __init__(self, stages: Any, optimizer: Any, *, layout: Any, mesh: Mesh, microbatches: int,
                 schedule: str | Schedule = "1f1b", stage_sizes: list[int] | None = None,
                 virtual_stages: int | None = None, **kw: Any):
        layout = layouts.get(layout)
        if not isinstance(stages, Stages):
            raise sharding_error(
                f"layout {layout.name!r} pipelines the model's blocks, but the loss {stages!r} does not declare its "
                "stages", fix="pass the model's stages as the loss, e.g. train_step(models.gpt.stages(cfg), ...)",
                cls=TypeError, mesh=mesh)
        other = set(layout.name.split("+")) - PIPELINE_PRESETS
        if other:
            raise sharding_error(f"layout {layout.name!r}: pp does not compose with {sorted(other)} yet",
                                 fix=f"use pp with {sorted(PIPELINE_PRESETS - {'pp'})}", mesh=mesh)
        super().__init__(stages, optimizer, layout=layout, mesh=mesh, accum_steps=microbatches, local=False, **kw)
        self._max_norm = kw.get("clip_norm")
        self.full_mesh, self.mesh, self.stages = mesh, mesh.without("pp"), stages
        pp = mesh.axis_size("pp")
        self.schedule = schedule if isinstance(schedule, Schedule) else build(schedule, pp, microbatches,
                                                                              virtual_stages=virtual_stages)
        if self.schedule.pp != pp or self.schedule.microbatches != microbatches:
            raise sharding_error(f"schedule {self.schedule.name!r} is for {self.schedule.pp} ranks and "
                                 f"{self.schedule.microbatches} microbatches; the step has pp={pp}, m={microbatches}",
                                 fix="build the schedule for the mesh's pp and the step's microbatches", mesh=mesh)
        self.stage_sizes = stage_sizes
        self.last = None  # the last step's pipeline.Result (timeline, P2P, saved activation peaks)

    def split(self, params: Any):
        """Which blocks each stage runs (``print(step.split(params))``); checked by :meth:`init`."""
        return split(params, self.schedule.stages, blocks=self.stages.blocks, sizes=self.stage_sizes)

    def init(self, params: Any) -> Any:
        self.split(params)  # fewer blocks than stages, or bad stage_sizes: an error before any work
        leaves = tree.leaves(params)
        missing = [i for i in self._own(params) if stage_state.is_placeholder(leaves[i])]
        if missing:
            path = tree.keystr(tree.leaves_with_path(params)[missing[0]][0])
            raise sharding_error(f"this rank's stage runs {path}, but shardings.init left it a placeholder (another "
                                 "stage's block): init and train_step split the blocks differently",
                                 fix="pass the same stage_sizes to shardings.init and train_step", mesh=self.full_mesh)
        return super().init(params)

    def _own(self, params: Any) -> list[int]:
        """Indices of the leaves this rank holds and updates: all on simulated ranks; on real ones its blocks and
        the parameters outside the blocks."""
        if not self.real:
            return list(range(len(tree.leaves(params))))
        rank = self.full_mesh.device_mesh.get_local_rank("pp")
        return [i for i, owner in enumerate(self._owners(params)) if owner is None or owner == rank]

    def __call__(self, params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, dict[str, Any]]:
        """:meth:`TrainStep.__call__`'s metrics and ``pipeline``: the schedule, its planned bubble (unit-time
        F and B), each rank's most bytes of activations saved for backward at once, and on real processes
        ``bubble``: each rank's measured idle fraction."""
        params, opt_state, metrics = super().__call__(params, opt_state, batch)
        if self.real:  # what this rank holds: its own stage (placeholders are meta tensors: shapes, no memory)
            held = lambda t: accounting.memory([x for x in tree.leaves(t) if not stage_state.is_placeholder(x)])
            metrics["memory"].update(params=held(params), opt_state=held(opt_state))
        metrics["pipeline"] = {"schedule": self.schedule.name, "microbatches": self.schedule.microbatches,
                               "bubble_planned": self.schedule.bubble(), "saved_peak": list(self.last.saved_peak)}
        if self.real:  # measured from every rank's action timestamps: idle fraction per rank
            metrics["pipeline"]["bubble"] = self.last.bubble()
        return params, opt_state, metrics

    @property
    def real(self) -> bool:
        """Real processes (each runs its own stage), not simulated ranks (all stages in this process)."""
        return dist.get_backend() != "fake"

    def _owners(self, params: Any) -> list[int | None]:
        """Per leaf: the ``pp`` rank running the stage whose blocks hold it (``schedule.rank_of``: interleaved
        and V schedules place several stages on a rank), or ``None`` (outside the blocks: first and last stage).

        ``params`` may be any tree shaped like the params (their gradients)."""
        where = self.split(params)
        blocks = [block_index(path, self.stages.blocks) for path, _ in tree.leaves_with_path(params)]
        return [None if b is None else self.schedule.rank_of(where.stage_of(b)) for b in blocks]

    def _grads(self, params: Any, batch: Any, scale: torch.Tensor | None) -> tuple[Any, Any, Any]:
        """``(loss, grads, tokens)`` from the schedule; grads reduced and laid out like the optimizer state.

        Under a precision policy the stage weights are cast to compute dtype before they are gathered, the
        microbatches' gradients are summed in compute dtype by the executor (one per stage weight, in microbatch
        order) and cast to reduce dtype for their reduction; a loss scale multiplies every microbatch's weight.
        """
        plan = self.plan(params)
        batch = self._place_batch(batch)
        mbs = self._microbatches(batch)
        total = self.token_count(batch)
        weights = [self.token_count(mb) / total for mb in mbs]
        if scale is not None:
            weights = [w * scale for w in weights]
        compute = tree.unflatten(plan.treedef, self._gather_once(params))
        carry = (self.stages, self._carry_placements, self.mesh.device_mesh) if self.real else None
        result = run(self.schedule, self._in_stage(self.stages), self.split(params), compute, mbs, weights,
                     mesh=self.full_mesh if self.real else None, carry_layout=carry)
        self.last = result
        grads, opt_pl, own = tree.leaves(result.grads), plan.placements["opt_state"], self._own(params)
        grads = [self.cast.to_reduce(g) for g in grads]
        reduced = list(grads)
        for i, g in zip(own, buckets.reduce([grads[i] for i in own], [opt_pl[i] for i in own], self.bucket_mb)):
            reduced[i] = g
        for i in sorted(set(range(len(grads))) - set(own)):  # another stage's block: a placeholder, stored like its
            reduced[i] = placeholder(grads[i].shape, grads[i].dtype, self.mesh, opt_pl[i])  # optimizer state
        if self.real:  # the first and the last stage each hold part of the edge parameters' gradients (reduced
            group = self.full_mesh.device_mesh.get_group("pp")  # within each stage first: one layout on every rank)
            for g, owner in zip(reduced, self._owners(params)):
                if owner is None:
                    _all_reduce_in_place(g.to_local() if isinstance(g, DTensor) else g, group)
        loss = result.loss if scale is None else result.loss / scale
        return loss, tree.unflatten(plan.treedef, reduced), total

    def _gather_once(self, params: Any) -> list[Any]:
        """This rank's parameters in their compute layout for the whole step: ZeRO-3's gathers (one all-gather
        per bucket, :func:`~shardings.residency.gather_buckets.gather`) run once before the schedule, not per
        microbatch (module docstring); another stage's block stays a placeholder (real ranks)."""
        plan, leaves, own = self.plan(params), tree.leaves(params), self._own(params)
        pl = plan.placements["compute"]
        with torch.no_grad():
            gathered, gathers = gather_buckets.gather([leaves[i] for i in own], [pl[i] for i in own],
                                                      self.bucket_mb, [plan.units[i] for i in own], self.cast)
            gathered = [self.cast.to_compute(resolve(x)) for x in gathered]  # cast before a bucket's gather
            gathers.close()
        dtype = lambda x: self.cast.compute if self.cast.compute and x.is_floating_point() else x.dtype
        mine = dict(zip(own, gathered))  # another stage's block: a placeholder (none on simulated ranks)
        return [mine[i] if i in mine else placeholder(x.shape, dtype(x), self.mesh, pl[i])
                for i, x in enumerate(leaves)]

    def _update(self, params: Any, opt_state: Any, grads: Any) -> tuple[Any, Any]:
        """:meth:`TrainStep._update`; on real ranks the clip's global norm adds up every stage's part, and only
        this rank's own leaves are updated (:mod:`shardings.step.stage_state`)."""
        if not self.real:
            return super()._update(params, opt_state, grads)
        plan = self.plan(params)
        with torch.no_grad():
            if self._clip is not None:
                grads = self._clip_across_stages(params, grads)
            inner = opt_state[1] if self._clip is not None else opt_state
            new, inner = stage_state.update(self._inner, plan.treedef, tree.leaves(params), tree.leaves(grads), inner,
                                            self._own(params), plan.placements["opt_state"],
                                            plan.placements["params"], self.donate)
        state = (opt_state[0], inner) if self._clip is not None else inner
        return tree.unflatten(plan.treedef, new), state

    def _clip_across_stages(self, params: Any, grads: Any) -> Any:
        factor = (self._max_norm / (self._norm_across_stages(grads) + 1e-6)).clamp(max=1.0)
        return tree.map(lambda g: g if stage_state.is_placeholder(g) else g * factor.to(g.dtype), grads)

    def _grad_norm(self, grads: Any) -> torch.Tensor:
        return self._norm_across_stages(grads) if self.real else super()._grad_norm(grads)

    def _norm_across_stages(self, grads: Any) -> torch.Tensor:
        """The global gradient norm on real ranks: each rank's own blocks, the edge parameters once (rank 0)."""
        rank = self.full_mesh.device_mesh.get_local_rank("pp")
        mine = [g for g, owner in zip(tree.leaves(grads), self._owners(grads))
                if owner == rank or (owner is None and rank == 0)]
        sq = core.optim.global_norm(mine) ** 2 if mine else torch.zeros(())
        sq = (sq.full_tensor() if isinstance(sq, DTensor) else sq).detach().clone()
        dist.all_reduce(sq, group=self.full_mesh.device_mesh.get_group("pp"))
        return sq.sqrt()

    def gather_stages(self, params: Any) -> Any:
        """Every block as its owner holds it (a broadcast over ``pp`` per leaf; a placeholder becomes a real tensor
        first); the identity on simulated ranks."""
        if not self.real:
            return params
        dm = self.full_mesh.device_mesh
        group, leaves, device = dm.get_group("pp"), tree.leaves(params), self.mesh.device_mesh.device_type
        out = []
        for x, owner in zip(leaves, self._owners(params)):
            if owner is not None:
                x = stage_state.materialize(x, torch.device(device)) if stage_state.is_placeholder(x) else x
                local = x.to_local() if isinstance(x, DTensor) else x
                dist.broadcast(local, src=dist.get_global_rank(group, owner), group=group)
            out.append(x)
        return tree.unflatten(tree.structure(params), out)

    def _carry_placements(self, carry: Any) -> list[Any]:
        names = tree.leaves(self.stages.carry_names(carry), is_leaf=lambda n: isinstance(n, tuple))
        rules = self.layout.role("activations")
        return [lower.to_placements(logical_to_spec(n, rules, self.mesh), self.mesh, x.ndim)
                for n, x in zip(names, tree.leaves(carry))]

    def _in_stage(self, stages: Stages) -> Stages:
        """The stage functions run with this layout's rules on the stage mesh (``constrain`` resolves there)."""
        def scoped(f):
            def call(*args):
                with use(self.mesh, self.layout), dtensor_errors():
                    return f(*args)
            return call

        return Stages(scoped(stages.first), scoped(stages.block), scoped(stages.last), stages.blocks)


def _all_reduce_in_place(x: torch.Tensor, group: Any) -> None:
    """Sum ``x`` over ``group`` into ``x`` (a tied embedding's gradient from the head is a transposed view)."""
    buf = x if x.is_contiguous() else x.contiguous()
    dist.all_reduce(buf, group=group)
    if buf is not x:
        x.copy_(buf)
