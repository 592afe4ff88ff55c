"""A run's pipeline plan, made once where the run is set up: the schedule, the split, and who owns which block.

:func:`plan` answers every pipeline question a run asks — which schedule (checked, built once), how many
microbatches, which blocks each stage runs, which rank runs each stage — from the layout, the mesh and the
parameters' shapes. The result is data (:class:`Plan`): ``shardings.init`` reads which blocks a rank
materializes from it, ``shardings.train_step`` runs its schedule over its split, checkpoints and
``TrainStep.gather_stages`` find each block's owner in it.

>>> plan = pipeline.plan("dp+pp", Mesh(dp=2, pp=2), params, schedule="zb_v", microbatches=4)  # doctest: +SKIP
>>> print(plan)  # the split, then each rank's actions in time  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from core import tree
from shardings.pipeline.schedule import Schedule, ScheduleError, build
from shardings.pipeline.stages import Split, block_index, split
from shardings.spec import layouts
from shardings.spec.errors import sharding_error
from shardings.spec.layouts import Layout
from shardings.spec.mesh import Mesh

__all__ = ["Plan", "default_microbatches", "plan", "plan_for"]


@dataclasses.dataclass(frozen=True)
class Plan:
    """A pipelined run's schedule and split of the blocks (``params[blocks][i]``) into its stages.

    Attributes:
        schedule: the schedule, built for the mesh's ``pp`` size and the step's microbatches.
        split: which blocks each stage runs (``schedule.stages`` stages).
        blocks: the params key of the list of blocks (the model's ``Stages.blocks``).
    """

    schedule: Schedule
    split: Split
    blocks: str = "blocks"

    @property
    def pp(self) -> int:
        """Pipeline ranks."""
        return self.schedule.pp

    @property
    def microbatches(self) -> int:
        """Microbatches per step."""
        return self.schedule.microbatches

    def owner(self, block: int) -> int:
        """The ``pp`` rank that runs block ``block`` (the schedule places the stages: round robin, a V, ...)."""
        return self.schedule.rank_of(self.split.stage_of(block))

    def blocks_of(self, rank: int) -> frozenset[int]:
        """The blocks ``pp`` rank ``rank`` runs and holds.

        >>> sorted(plan.blocks_of(0))  # doctest: +SKIP
        [0, 1]
        """
        return frozenset(b for s, r in enumerate(self.split.ranges) if self.schedule.rank_of(s) == rank for b in r)

    def owners(self, params: Any) -> list[int | None]:
        """Per leaf of ``params`` (or of any tree shaped like them: gradients, specs), the ``pp`` rank holding it,
        or ``None`` outside the blocks (the embedding, final norm and head: used by the first and last stage)."""
        indices = [block_index(path, self.blocks) for path, _ in tree.leaves_with_path(params)]
        return [None if b is None else self.owner(b) for b in indices]

    def __str__(self) -> str:
        return f"{self.split}\n{self.schedule.table()}"


def default_microbatches(pp: int, accum_steps: int = 1, microbatches: int | None = None) -> int:
    """A pipelined run's microbatches per step: ``microbatches`` when given, else ``accum_steps`` when > 1, else one
    per pipeline rank (the fewest that keep every rank busy once). The one home of that default.

    >>> default_microbatches(4), default_microbatches(4, accum_steps=8), default_microbatches(4, 8, 2)
    (4, 8, 2)
    """
    return microbatches if microbatches is not None else accum_steps if accum_steps > 1 else pp


def _schedule(name_or_schedule: str | Schedule | None, pp: int, microbatches: int | None, accum_steps: int,
              virtual_stages: int | None) -> Schedule:
    """The schedule, built or checked against the mesh and the microbatches asked for.

    Microbatches asked for: ``microbatches``, else ``accum_steps`` when > 1; none asked: a given schedule's own,
    else one per pipeline rank (the fewest that keep every rank busy once).
    """
    asked = microbatches if microbatches is not None else accum_steps if accum_steps > 1 else None
    if not isinstance(name_or_schedule, Schedule):
        return build(name_or_schedule, pp, default_microbatches(pp, accum_steps, microbatches),
                     virtual_stages=virtual_stages)
    schedule = name_or_schedule
    if schedule.pp != pp or asked not in (None, schedule.microbatches):
        raise sharding_error(f"schedule {schedule.name!r} is for {schedule.pp} ranks and {schedule.microbatches} "
                             f"microbatches; the step has pp={pp}, m={asked or schedule.microbatches}",
                             fix="build the schedule for the mesh's pp and the step's microbatches", cls=ScheduleError)
    return schedule


def plan(layout: str | Layout, mesh: Mesh, params: Any, *, schedule: str | Schedule | None = None,
         microbatches: int | None = None, accum_steps: int = 1, virtual_stages: int | None = None,
         stage_sizes: Sequence[int] | None = None, blocks: str = "blocks") -> Plan:
    """The pipeline plan of a run whose layout pipelines the blocks (``pp``).

    Args:
        layout: a ``Layout`` or preset string with ``pp``.
        mesh: the whole mesh (with its ``pp`` axis).
        params: the params, or anything shaped like them: ``core.deferred`` recipes (``init`` under
            ``core.deferred.deferred()``), meta tensors. The split balances their element counts.
        schedule: a name from ``shardings.pipeline.SCHEDULES`` (default ``DEFAULT_SCHEDULE``) or a
            checked :class:`Schedule` built for the mesh's ``pp``.
        microbatches: microbatches per step (default ``accum_steps`` when > 1, else the ``pp`` size; a given
            schedule's own count).
        accum_steps: the train step's accumulation steps: the microbatches when none are given.
        virtual_stages: stages per rank, for a schedule that lets the caller choose (``interleaved_1f1b``).
        stage_sizes: blocks per stage (default: balanced by element count, :func:`~shardings.pipeline.split`).
        blocks: the params key of the list of blocks (the model's ``Stages.blocks``).

    Raises:
        ShardingError: the layout does not pipeline; a schedule built for another ``pp`` or microbatch count.
        ScheduleError: an unknown schedule, or sizes it cannot run.
        ValueError: fewer blocks than stages, or ``stage_sizes`` that do not add up.
    """
    layout = layouts.get(layout)
    if not layout.pipelined:
        raise sharding_error(f"layout {layout.name or layout!r} does not pipeline the blocks: it has no pipeline plan",
                             fix="add pp to the layout (e.g. 'dp+pp'), or pass no plan", mesh=mesh)
    built = _schedule(schedule, mesh.axis_size("pp"), microbatches, accum_steps, virtual_stages)
    return Plan(built, split(params, built.stages, blocks=blocks, sizes=stage_sizes), blocks)


def plan_for(layout: str | Layout, mesh: Mesh, params: Any, given: Plan | None = None, **settings: Any) -> Plan | None:
    """The pipeline plan of a run, for ``shardings.init`` and ``train_step``: ``given`` (checked against the layout
    and the mesh), or one :func:`plan` makes from ``settings`` (its keywords) when the layout pipelines the blocks,
    or ``None`` when it does not.

    Raises:
        ShardingError: a plan given for a layout without ``pp``, or for another ``pp`` size.
    """
    layout = layouts.get(layout)
    if given is None:
        return plan(layout, mesh, params, **settings) if layout.pipelined else None
    if not layout.pipelined or given.pp != mesh.axis_size("pp"):
        raise sharding_error(f"a pipeline plan for pp={given.pp} was given for layout {layout.name!r} on {mesh!r}",
                             fix="make the plan for this layout and mesh (shardings.pipeline.plan), or leave it out",
                             mesh=mesh)
    return given
