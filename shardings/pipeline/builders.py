"""The schedules by name: ``build("zb_v", pp=4, microbatches=8)``, and what each one's ``virtual_stages`` may be."""

from __future__ import annotations

from collections.abc import Callable

from shardings.pipeline.interleaved import interleaved_1f1b
from shardings.pipeline.schedule import Schedule, ScheduleError, gpipe, one_f_one_b
from shardings.pipeline.zero_bubble import zb_h1, zb_v
from shardings.spec.errors import sharding_error

__all__ = ["SCHEDULES", "VIRTUAL_STAGES", "build"]

SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_1f1b,
    "zb_h1": zb_h1,
    "zb_v": zb_v,
}
# Chunks per rank: a fixed count, or None where ``virtual_stages`` chooses it (default 2).
VIRTUAL_STAGES: dict[str, int | None] = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": None, "zb_h1": 1, "zb_v": 2}


def build(name: str, pp: int, microbatches: int, *, virtual_stages: int | None = None) -> Schedule:
    """The schedule ``name`` (a key of ``SCHEDULES``) for ``pp`` ranks and ``microbatches`` microbatches.

    Args:
        virtual_stages: chunks of the model per rank, for ``interleaved_1f1b`` (default 2); the others have a
            fixed count (``VIRTUAL_STAGES``) and accept only that. The split has ``pp * virtual_stages`` stages.

    >>> build("1f1b", 2, 3).bubble() == 1 / 4
    True
    >>> build("interleaved_1f1b", 2, 4, virtual_stages=3).stages
    6
    """
    if name not in SCHEDULES:
        raise sharding_error(
            f"unknown pipeline schedule {name!r}", fix=f"use one of {sorted(SCHEDULES)}", cls=ScheduleError
        )
    fixed = VIRTUAL_STAGES[name]
    if fixed is None:
        return SCHEDULES[name](pp, microbatches, virtual_stages=2 if virtual_stages is None else virtual_stages)
    if virtual_stages not in (None, fixed):
        raise sharding_error(
            f"pipeline schedule {name!r} runs {fixed} stage(s) per rank, got virtual_stages={virtual_stages}",
            fix="leave virtual_stages out, or use interleaved_1f1b for any number of virtual stages",
            cls=ScheduleError,
        )
    return SCHEDULES[name](pp, microbatches)
