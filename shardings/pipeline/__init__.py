"""Pipeline parallelism: a model's layers split into stages, microbatches scheduled across them.

A model declares its :class:`Stages` (before the blocks, each block, after); :func:`split` assigns
contiguous blocks to stages; a :class:`Schedule` (``gpipe``, ``one_f_one_b``, ``interleaved_1f1b``, the
zero-bubble ``zb_h1`` and ``zb_v``, or any list of actions per rank that :func:`check` accepts) says what each
rank does in which order; :func:`run` executes it. ``docs/pipeline.md`` shows how to write your own.
"""

from shardings.pipeline.check import check
from shardings.pipeline.execute import Result, SavedActivations, Timed, run
from shardings.pipeline.interleaved import interleaved_1f1b
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
)
from shardings.pipeline.stages import Split, Stages, split
from shardings.pipeline.wire import Message
from shardings.pipeline.zero_bubble import zb_h1, zb_v

__all__ = [
    "DEFAULT_SCHEDULE",
    "SCHEDULES",
    "Action",
    "Message",
    "Result",
    "SavedActivations",
    "Schedule",
    "ScheduleError",
    "Split",
    "Stages",
    "Timed",
    "build",
    "check",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "program",
    "register_schedule",
    "run",
    "split",
    "zb_h1",
    "zb_v",
]
