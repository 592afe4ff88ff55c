"""A step's measured peak memory per rank, for the report's ``memory.png`` and the tracker.

On CUDA: ``torch.cuda.max_memory_allocated`` over the step. On CPU: :func:`shardings.peak_memory` (live tensor
storages, counted by a dispatch mode) over one step, the run's last: a dispatch mode slows the ops it sees, and under
``jit=true`` it would run the compiled blocks eagerly, so CPU runs under jit measure nothing (``None``). Under
``simulate`` one process holds every rank's tensors: the peak is their sum, reported as its mean per rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from shardings import peak_memory, simulated

__all__ = ["measured"]


@contextlib.contextmanager
def measured(enabled: bool, roots: Any, world: int) -> Iterator[list[int]]:
    """Measure the block's peak bytes per rank into the yielded list (every rank's, on every rank; empty when not
    ``enabled``). On real processes every rank must enter it together (the peaks are all-gathered)."""
    out: list[int] = []
    if not enabled:
        yield out
        return
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        yield out
        peak = torch.cuda.max_memory_allocated()
    else:
        with peak_memory(roots=roots) as m:
            yield out
        peak = m.peak
    if simulated():
        out.extend([peak // world] * world)
    elif dist.is_initialized():
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, peak)
        out.extend(gathered)
    else:
        out.append(peak)
