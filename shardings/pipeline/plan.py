"""A run's pipeline plan, made once where the run is set up: the schedule, the split, and who owns which block.

:func:`plan` answers every pipeline question a run asks — which schedule (checked, built once), how many
microbatches, which blocks each stage runs, which rank runs each stage — from the layout, the mesh and the
parameters' shapes. The result is data (:class:`Plan`): ``shardings.init`` reads which blocks a rank
materializes from it, ``shardings.train_step`` runs its schedule over its split, checkpoints and
``TrainStep.gather_stages`` find each block's owner in it.

>>> plan = pipeline.plan("dp+pp", Mesh(dp=2, pp=2), params, schedule="zb_v", microbatches=4)  # doctest: +SKIP
>>> print(plan)  # the split, then each rank's actions in time  # doctest: +SKIP

With ``seq_chunks=k`` (TeraPipe) each microbatch's sequence is also cut into ``k`` chunks that flow through the
stages in order (``gpipe`` and ``1f1b``); the plan's :class:`~shardings.pipeline.seq_chunks.SeqChunks` chooses
their sizes (TeraPipe's dynamic program, or equal) and says why (``print(plan)`` with ``seq_len`` given).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from core import tree
from shardings.pipeline.schedule import Schedule, ScheduleError, build
from shardings.pipeline.seq_chunks import SeqChunks
from shardings.pipeline.stages import Split, _numel, block_index, split
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
        chunks: how each microbatch's sequence is cut (TeraPipe: ``schedule.seq_chunks`` chunks), or ``None``.
        seq_len: the sequence length the plan was made for (shown by ``str``), or ``None``.
    """

    schedule: Schedule
    split: Split
    blocks: str = "blocks"
    chunks: SeqChunks | None = None
    seq_len: int | None = None

    @property
    def seq_chunks(self) -> int:
        """Chunks per microbatch's sequence (1: whole sequences)."""
        return self.schedule.seq_chunks

    def chunk_sizes(self, seq_len: int) -> tuple[int, ...]:
        """The chunk sizes of a sequence of ``seq_len`` tokens (``(seq_len,)`` without seq_chunks)."""
        return (seq_len,) if self.chunks is None else self.chunks.sizes(seq_len)

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
        chunks = "" if self.chunks is None or self.seq_len is None else f"\n{self.chunks.explain(self.seq_len)}"
        return f"{self.split}{chunks}\n{self.schedule.table()}"


def default_microbatches(pp: int, accum_steps: int = 1, microbatches: int | None = None) -> int:
    """A pipelined run's microbatches per step: ``microbatches`` when given, else ``accum_steps`` when > 1, else one
    per pipeline rank (the fewest that keep every rank busy once). The one home of that default.

    >>> default_microbatches(4), default_microbatches(4, accum_steps=8), default_microbatches(4, 8, 2)
    (4, 8, 2)
    """
    return microbatches if microbatches is not None else accum_steps if accum_steps > 1 else pp


def _schedule(name_or_schedule: str | Schedule | None, pp: int, microbatches: int | None, accum_steps: int,
              virtual_stages: int | None, seq_chunks: int) -> Schedule:
    """The schedule, built or checked against the mesh and the microbatches asked for.

    Microbatches asked for: ``microbatches``, else ``accum_steps`` when > 1; none asked: a given schedule's own,
    else one per pipeline rank (the fewest that keep every rank busy once).
    """
    asked = microbatches if microbatches is not None else accum_steps if accum_steps > 1 else None
    if not isinstance(name_or_schedule, Schedule):
        return build(name_or_schedule, pp, default_microbatches(pp, accum_steps, microbatches),
                     virtual_stages=virtual_stages, seq_chunks=seq_chunks)
    schedule = name_or_schedule
    if schedule.pp != pp or asked not in (None, schedule.microbatches) or seq_chunks not in (1, schedule.seq_chunks):
        raise sharding_error(f"schedule {schedule.name!r} is for {schedule.pp} ranks and {schedule.microbatches} "
                             f"microbatches{_chunked(schedule.seq_chunks)}; the step has pp={pp}, "
                             f"m={asked or schedule.microbatches}{_chunked(seq_chunks)}",
                             fix="build the schedule for the mesh's pp and the step's microbatches", cls=ScheduleError)
    return schedule


def _chunked(seq_chunks: int) -> str:
    return f" of {seq_chunks} sequence chunks" if seq_chunks > 1 else ""


def plan(layout: str | Layout, mesh: Mesh, params: Any, *, schedule: str | Schedule | None = None,
         microbatches: int | None = None, accum_steps: int = 1, virtual_stages: int | None = None,
         stage_sizes: Sequence[int] | None = None, blocks: str = "blocks", seq_chunks: int = 1,
         chunk_sizes: str | Sequence[int] = "terapipe", seq_len: int | None = None,
         attention_width: int | None = None) -> Plan:
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
        seq_chunks: TeraPipe: cut each microbatch's sequence into this many chunks, which flow through the stages
            in order (``gpipe`` and ``1f1b``; the model's ``Stages.prefix_block`` runs a chunk after the earlier
            ones' keys and values).
        chunk_sizes: ``"terapipe"`` (the dynamic program of :mod:`shardings.pipeline.seq_chunks`: earlier chunks
            longer, as later ones attend over more), ``"equal"``, or the sizes themselves.
        seq_len: the sequence length, to show the chunk sizes and why in ``str(plan)`` (steps cut whatever
            length their batch has).
        attention_width: ``heads · head_dim`` for the chunks' cost model (default: read from a block's ``wq``, else
            the width of its first vector).

    Raises:
        ShardingError: the layout does not pipeline; a schedule built for another ``pp`` or microbatch count;
            seq_chunks under a layout that shards attention's sequence (cp).
        ScheduleError: an unknown schedule, or sizes it cannot run.
        ValueError: fewer blocks than stages, or ``stage_sizes`` that do not add up.
    """
    layout = layouts.get(layout)
    if not layout.pipelined:
        raise sharding_error(f"layout {layout.name or layout!r} does not pipeline the blocks: it has no pipeline plan",
                             fix="add pp to the layout (e.g. 'dp+pp'), or pass no plan", mesh=mesh)
    built = _schedule(schedule, mesh.axis_size("pp"), microbatches, accum_steps, virtual_stages, seq_chunks)
    cut = split(params, built.stages, blocks=blocks, sizes=stage_sizes)
    chunks = None
    if built.seq_chunks > 1:
        chunks = _chunks(layout, mesh, params[blocks], built, chunk_sizes, attention_width)
        if seq_len is not None:
            chunks.sizes(seq_len)  # checked now
    return Plan(built, cut, blocks, chunks, seq_len)


def _chunks(layout: Layout, mesh: Mesh, blocks: Any, schedule: Schedule, rule: str | Sequence[int],
            width: int | None) -> SeqChunks:
    """The chunking of a TeraPipe plan: the cost model from the blocks' shapes, the quantum from the layout."""
    from shardings.ops.ring_attention import Q_NAMES  # the attention's layout names (ops imports the pipeline)
    from shardings.spec.rules import logical_to_spec

    stage_mesh, rules = mesh.without("pp"), layout.role("activations")
    if logical_to_spec(Q_NAMES, rules, stage_mesh).dim_axes()[1]:
        raise sharding_error(f"seq_chunks={schedule.seq_chunks} under layout {layout.name!r}, whose attention splits "
                             "the sequence (context parallelism): a chunk's attention over its prefix is not ring "
                             "attention", fix="leave seq_chunks out, or use a layout without cp", mesh=mesh,
                             cls=ScheduleError)
    seq_axes = logical_to_spec(("batch", "seq", "embed"), rules, stage_mesh).dim_axes()[1]
    if width is None:
        first = blocks[0]
        wq = first.get("wq") if isinstance(first, dict) else None
        vectors = [x.shape[0] for x in tree.leaves(first) if len(getattr(x, "shape", ())) == 1]
        width = int(wq.shape.numel() // wq.shape[0]) if wq is not None else (vectors[0] if vectors else 1)
    per_block = _numel(blocks) / len(blocks)
    return SeqChunks(schedule.seq_chunks, rule if isinstance(rule, str) else tuple(rule), token_cost=2 * per_block,
                     pair_cost=4 * width, quantum=stage_mesh.axis_size(seq_axes) if seq_axes else 1,
                     stages=schedule.stages, microbatches=schedule.microbatches)


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
