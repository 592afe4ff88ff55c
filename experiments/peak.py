"""A step's measured peak memory per rank, and its parts by role, for the report's ``memory.png`` and the tracker.

On CUDA: ``torch.cuda.max_memory_allocated`` over the step. On CPU: :func:`shardings.peak_memory` (live tensor
storages, counted by a dispatch mode) over one step, the run's last. CPU runs under ``jit=true`` measure nothing:
the compiled graphs run outside that dispatch mode, and inductor's CPU code allocates its buffers without the
dispatcher, so a count would miss the graphs' temporaries (:data:`NOT_MEASURED_JIT_CPU`, said on the console and
kept as ``peak_memory_note`` in ``summary.json``). Under ``simulate`` one process holds every rank's tensors: the peak
is their sum, reported as its mean per rank.

The parts (:func:`parts`) are the planner's one memory model, :class:`shardings.planner.memory.StepMemory`, corrected
as the planner's exact runs correct it (:func:`shardings.planner.memory.corrected`): the held roles as the step counted
them (``metrics["memory"]``), the activations saved for backward as the step measured them where it does (a pipelined
rank's ``saved_peak``) else the planner's estimate of the run's own layout, and the buffers the rest of the peak.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

import core
from shardings import peak_memory, simulated
from shardings.planner import Candidate, peak_by_role

__all__ = ["NOT_MEASURED_JIT_CPU", "measured", "measures", "parts"]

NOT_MEASURED_JIT_CPU = ("peak memory not measured: jit=true on CPU (the compiled graphs run outside the counting "
                        "dispatch mode and inductor's CPU code allocates its buffers without the dispatcher; CUDA "
                        "measures it with torch.cuda.max_memory_allocated)")


def measures(jit: bool) -> tuple[bool, str | None]:
    """Whether a run measures its last step's peak, and else why not (:data:`NOT_MEASURED_JIT_CPU`)."""
    if jit and not torch.cuda.is_available():
        return False, NOT_MEASURED_JIT_CPU
    return True, None


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


def parts(setup: Any, optimizer: Any, rows: int, held: dict[str, float], peak: float,
          saved: float | None) -> tuple[dict[str, float] | None, str]:
    """The measured ``peak`` by role (the planner's roles, summing to it, :func:`shardings.planner.peak_by_role`),
    and where its activations come from; ``None`` and why where the planner cannot estimate the run.

    Args:
        setup: the run's :class:`experiments.build.Setup`.
        optimizer: the run's optimizer.
        rows: the global batch in rows.
        held: the step's ``metrics["memory"]``.
        peak: the measured peak per rank.
        saved: the activations the step measured at once (a pipelined rank's ``saved_peak``), or ``None``.
    """
    precision = core.precision.name_of((setup.precision or core.precision.Policy()).compute_dtype)
    cand = Candidate(setup.layout.name, tuple(setup.mesh.shape.items()), setup.microbatches,
                     remat=getattr(setup.model_cfg, "remat", False), precision=precision)
    try:
        memory = peak_by_role(setup.model, setup.model_cfg, rows, cand, optimizer, held, peak, saved)
    except (ValueError, TypeError, KeyError, AttributeError) as e:  # a model or layout the planner does not model
        return None, f"activations and buffers not told apart: the planner cannot estimate this run ({e})"
    source = ("measured (saved for backward at once, the pipeline's count)" if saved is not None else
              "the planner's estimate for this layout, at most the measured peak less the held roles")
    return dict(memory._asdict()), f"activations: {source}; buffers: the rest of the measured peak"
