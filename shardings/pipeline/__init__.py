"""Pipeline parallelism: a model's layers split into stages, microbatches scheduled across them.

A model declares its :class:`Stages` (before the blocks, each block, after); :func:`split` assigns
contiguous blocks to stages; a :class:`Schedule` (``gpipe``, ``one_f_one_b``, or any list of actions per
rank that :func:`check` accepts) says what each rank does in which order; :func:`run` executes it.
"""

from shardings.pipeline.check import check
from shardings.pipeline.execute import Result, Timed, run
from shardings.pipeline.schedule import SCHEDULES, Action, Schedule, ScheduleError, build, gpipe, one_f_one_b
from shardings.pipeline.stages import Split, Stages, split
from shardings.pipeline.wire import Message

__all__ = [
    "SCHEDULES",
    "Action",
    "Message",
    "Result",
    "Schedule",
    "ScheduleError",
    "Split",
    "Stages",
    "Timed",
    "build",
    "check",
    "gpipe",
    "one_f_one_b",
    "run",
    "split",
]
