"""Pipeline parallelism: a model's layers split into stages, microbatches scheduled across them.

A model declares its :class:`Stages` (before the blocks, each block, after); :func:`split` assigns
contiguous blocks to stages; a :class:`Schedule` (any of ``SCHEDULES``: ``gpipe``, ``one_f_one_b``,
``interleaved_1f1b``, the zero-bubble ``zb_h1`` and ``zb_v``, each registered where it is defined with
:func:`register_schedule`; or any list of actions per rank that :func:`check` accepts) says what each rank does
in which order; :func:`run` executes it, on simulated or real ranks. A run's :func:`plan` makes these choices once
(schedule, microbatches, split, who owns which block) for ``shardings.init`` and ``shardings.train_step``.
``docs/pipeline.md`` shows how to write your own schedule. ``plan(..., seq_chunks=k)`` also cuts each
microbatch's sequence into ``k`` chunks (TeraPipe: :mod:`shardings.pipeline.seq_chunks` sizes them, :func:`cut`
cuts a batch).

May import: ``spec``, ``runtime``, ``comm``, ``residency``, ``ops``.
"""

from shardings.pipeline.check import check
from shardings.pipeline.execute import Result, SavedActivations, Timed, run
from shardings.pipeline.interleaved import interleaved_1f1b
from shardings.pipeline.plan import Plan, default_microbatches, plan, plan_for
from shardings.pipeline.schedule import (
    DEFAULT_SCHEDULE,
    SCHEDULES,
    Action,
    Schedule,
    ScheduleError,
    build,
    gpipe,
    one_f_one_b,
    program,
    register_schedule,
    stages_per_rank,
    timeline,
)
from shardings.pipeline.seq_chunks import SeqChunks, cut, seq_length
from shardings.pipeline.stages import Split, Stages, split
from shardings.pipeline.wire import Message
from shardings.pipeline.zero_bubble import zb_h1, zb_v

__all__ = [
    "DEFAULT_SCHEDULE",
    "SCHEDULES",
    "Action",
    "Message",
    "Plan",
    "Result",
    "SavedActivations",
    "Schedule",
    "ScheduleError",
    "SeqChunks",
    "Split",
    "Stages",
    "Timed",
    "build",
    "check",
    "cut",
    "default_microbatches",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "plan",
    "plan_for",
    "program",
    "register_schedule",
    "run",
    "seq_length",
    "split",
    "stages_per_rank",
    "timeline",
    "zb_h1",
    "zb_v",
]
