"""The train step under a layout with ``pp``: the pipeline across stages, the other presets inside each stage.

``"layers" → "pp"`` (preset ``pp``) puts a model's blocks on the mesh axis ``pp``. Each stage runs on
the mesh of the other axes as this rank sees it (``mesh.without("pp")``: the slice holding it), with
the rest of the layout (``dp``, ``zero1``, ``zero2``, ``tp``, ``sp``) applied there as usual: params,
batch and activations are DTensors on the stage mesh. The batch is split into ``microbatches`` (each
data-parallel rank splits its own rows), the schedule (``gpipe``, ``1f1b`` or a checked
:class:`~shardings.pipeline.Schedule`) runs them through the stages (:func:`shardings.pipeline.run`),
gradients accumulate over microbatches and are reduced once per step over the data axes (``no_sync``),
the loss is the global token mean, and clipping sees every stage's gradients.

On simulated ranks every stage runs in this process (the stage mesh's DTensors then hold the same
values on the ranks of every stage). Real processes are not supported by this step yet: run the
pipeline itself there with ``shardings.pipeline.run(..., mesh=)``.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from core import tree
from shardings.comm import buckets
from shardings.ops.module_tp import dtensor_errors
from shardings.pipeline import Schedule, Stages, build, run, split
from shardings.spec import layouts
from shardings.spec.context import use
from shardings.spec.errors import sharding_error
from shardings.spec.mesh import Mesh
from shardings.step.train_step import TrainStep

__all__ = ["PIPELINE_PRESETS", "PipelineStep", "has_pp"]

PIPELINE_PRESETS = frozenset({"pp", "dp", "zero1", "zero2", "tp", "sp"})  # what composes with pp today


def has_pp(layout: Any) -> bool:
    """Whether the layout (a preset string or ``Layout``) includes the ``pp`` preset."""
    name = layouts.get(layout).name or ""
    return "pp" in name.split("+")


class PipelineStep(TrainStep):
    """A :class:`TrainStep` whose gradients come from a pipeline schedule (module docstring)."""

    def __init__(self, stages: Any, optimizer: Any, *, layout: Any, mesh: Mesh, microbatches: int,
                 schedule: str | Schedule = "1f1b", stage_sizes: list[int] | None = None, **kw: Any):
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
        self.full_mesh, self.mesh, self.stages = mesh, mesh.without("pp"), stages
        pp = mesh.axis_size("pp")
        self.schedule = schedule if isinstance(schedule, Schedule) else build(schedule, pp, microbatches)
        if self.schedule.stages != pp or self.schedule.microbatches != microbatches:
            raise sharding_error(f"schedule {self.schedule.name!r} is for {self.schedule.stages} stages and "
                                 f"{self.schedule.microbatches} microbatches; the step has pp={pp}, m={microbatches}",
                                 fix="build the schedule for the mesh's pp and the step's microbatches", mesh=mesh)
        self.stage_sizes = stage_sizes
        self.last = None  # the last step's pipeline.Result (timeline, P2P, saved activation peaks)

    def split(self, params: Any):
        """Which blocks each stage runs (``print(step.split(params))``); checked by :meth:`init`."""
        return split(params, self.schedule.stages, blocks=self.stages.blocks, sizes=self.stage_sizes)

    def init(self, params: Any) -> Any:
        self.split(params)  # fewer blocks than stages, or bad stage_sizes: an error before any work
        return super().init(params)

    def __call__(self, params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, dict[str, Any]]:
        """:meth:`TrainStep.__call__`'s metrics and ``pipeline``: the schedule, its planned bubble (unit-time
        F and B) and each rank's most bytes of activations saved for backward at once."""
        params, opt_state, metrics = super().__call__(params, opt_state, batch)
        metrics["pipeline"] = {"schedule": self.schedule.name, "microbatches": self.schedule.microbatches,
                               "bubble_planned": self.schedule.bubble(), "saved_peak": list(self.last.saved_peak)}
        return params, opt_state, metrics

    def grads(self, params: Any, batch: Any) -> tuple[Any, Any, Any]:
        """``(loss, grads, tokens)`` from the schedule; grads reduced and laid out like the optimizer state."""
        if dist.get_backend() != "fake":
            raise sharding_error("a train step with pp runs on simulated ranks only so far",
                                 fix="use shardings.simulate(n), or shardings.pipeline.run(..., mesh=) on real ranks",
                                 cls=NotImplementedError, mesh=self.full_mesh)
        plan = self.plan(params)
        batch = self._place_batch(batch)
        mbs = self._microbatches(batch)
        total = self.token_count(batch)
        weights = [self.token_count(mb) / total for mb in mbs]
        compute = tree.unflatten(plan.treedef, self._to("compute", tree.leaves(params)))
        result = run(self.schedule, self._in_stage(self.stages), self.split(params), compute, mbs, weights)
        self.last = result
        reduced = buckets.reduce(tree.leaves(result.grads), plan.placements["opt_state"], self.bucket_mb)
        return result.loss, tree.unflatten(plan.treedef, reduced), total

    def _in_stage(self, stages: Stages) -> Stages:
        """The stage functions run with this layout's rules on the stage mesh (``constrain`` resolves there)."""
        def scoped(f):
            def call(*args):
                with use(self.mesh, self.layout), dtensor_errors():
                    return f(*args)
            return call

        return Stages(scoped(stages.first), scoped(stages.block), scoped(stages.last), stages.blocks)
