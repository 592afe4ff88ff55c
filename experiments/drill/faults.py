"""Faults a drill plants inside its ranks, armed from the model config (never from the library's step).

A drill's job runs a drill model module (:mod:`experiments.drill.mlp`, :mod:`experiments.drill.moe`): a
reference model plus the :class:`Faults` fields. Its ``loss`` and pipeline stages go through :func:`planted`, the
faults that strike at a point inside one step on one rank: ``nan_batch`` (the loss, or the first stage's output,
times NaN), ``kill_forward`` (SIGKILL once that value is computed, in forward) and ``kill_backward`` (SIGKILL when
backward reaches it: the start of a local step's backward; on a pipeline's first stage, its backward right after
the input gradient was received from the next stage). ``kill_optimizer`` strikes in the optimizer's update
(:mod:`experiments.drill.optim`, the job's ``optim.name``), which finds the rank's fault with :func:`armed`. Its
``init`` (run once per rank) calls :func:`arm`, which
leaves the rank's pid where the drill's watcher finds it (``<drill_dir>/pid_rank<r>``: faults from outside,
SIGKILL or SIGSTOP at a moment the watcher picks) and, for a fault inside ``checkpoint.save``, installs a
``shardings.checkpoint.add_save_hook`` hook on the chosen rank. Every run of a drill (the uninterrupted one, the
faulted one, the restart) passes all the fields, so the checkpoints' key paths match; only the values differ.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from shardings import checkpoint, pipeline

__all__ = ["DISK_ERRORS", "IN_MODEL", "IN_OPTIMIZER", "IN_SAVE", "Faults", "arm", "armed", "kill", "mark_struck",
           "planted", "planted_stages", "wrap"]

# At a checkpoint.save moment (add_save_hook's): SIGKILL once the rank's files are written or once the manifest is;
# or the disk fills up / turns read-only as the rank's files are written (an OSError from the hook: no tmpfs or
# root needed, and the save path is the library's own, up to the error).
DISK_ERRORS = {"disk_full": errno.ENOSPC, "read_only": errno.EROFS}
IN_SAVE = ("save_written", "save_manifest", *DISK_ERRORS)
# At a point inside one step on one rank: a batch whose loss is NaN; SIGKILL in forward or in backward
IN_MODEL = ("nan_batch", "kill_forward", "kill_backward")
IN_OPTIMIZER = ("kill_optimizer",)  # SIGKILL inside one step's optimizer update, on one rank
STRUCK = "struck"  # <drill_dir>/struck: when the fault struck (time.time()), written just before it strikes
_ARMED: dict[str, Faults] = {}  # drill dirs this process armed (init may run more than once per rank): the fault
_CALLS = [0]  # calls of the poisoned function with real (not meta) tensors in this process


@dataclasses.dataclass(frozen=True)
class Faults:
    """The fault fields a drill model's ``Config`` adds; the defaults plant nothing."""

    drill_dir: str = ""  # where ranks leave their pids and the fault its time; "" = not in a drill
    fault: str = "none"  # none, or one of IN_SAVE or IN_MODEL (in-rank); external faults need only the pids
    fault_rank: int = 0  # the rank the in-rank fault strikes
    fault_step: int = 0  # the step whose checkpoint.save it strikes, or inside which it strikes (IN_MODEL)
    fault_calls: int = 1  # calls of loss (or of the first stage: one per microbatch) per step on a rank


def mark_struck(drill_dir: str, what: str) -> None:
    """Record when and what struck (the drill measures the seconds until every rank exited from it)."""
    Path(drill_dir, STRUCK).write_text(f"{time.time()} {what}\n")


def _write_pid(drill_dir: str, rank: int) -> None:
    tmp = Path(drill_dir, f".pid_rank{rank}")
    tmp.write_text(str(os.getpid()))
    tmp.replace(Path(drill_dir, f"pid_rank{rank}"))  # the watcher never reads half a pid


def _save_fault(cfg: Faults) -> Callable[[str, str], None]:
    moment = "written" if cfg.fault in DISK_ERRORS else cfg.fault.removeprefix("save_")

    def hook(at: str, folder: str) -> None:
        if at != moment or Path(folder).name != f"step_{cfg.fault_step}.tmp":
            return
        mark_struck(cfg.drill_dir, f"{cfg.fault} on rank {cfg.fault_rank} in checkpoint.save ({moment})")
        if cfg.fault in DISK_ERRORS:
            code = DISK_ERRORS[cfg.fault]
            raise OSError(code, os.strerror(code), folder)
        os.kill(os.getpid(), signal.SIGKILL)

    return hook


def _strikes_now(cfg: Faults, x: Any) -> bool:
    """Whether this call (the loss, or the first stage) is one of step ``fault_step``'s on the fault's rank."""
    if cfg.fault not in IN_MODEL or getattr(x, "device", None) is None or x.device.type == "meta":
        return False  # meta: a pipeline tracing its stages' shapes, not a step
    _CALLS[0] += 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    first = (cfg.fault_step - 1) * cfg.fault_calls
    # nan_batch: every call of the step (each microbatch's); a kill: the first
    last = first + (cfg.fault_calls if cfg.fault == "nan_batch" else 1)
    return rank == cfg.fault_rank and first < _CALLS[0] <= last


def kill(cfg: Faults, where: str) -> None:
    """SIGKILL this process, recording that it struck in step ``cfg.fault_step``'s ``where``."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if cfg.drill_dir:
        mark_struck(cfg.drill_dir, f"SIGKILL of rank {rank} in step {cfg.fault_step}'s {where}")
    os.kill(os.getpid(), signal.SIGKILL)


def planted(fn: Callable[..., Any], cfg: Faults) -> Callable[..., Any]:
    """``fn`` (a loss, or a first stage) with the in-step fault of ``cfg`` (:data:`IN_MODEL`) in step
    ``cfg.fault_step``: its result times NaN, or SIGKILL once it is computed (forward) or when its gradient is
    (backward)."""

    def call(*args: Any) -> Any:
        out = fn(*args)
        if not _strikes_now(cfg, out):
            return out
        if cfg.fault == "kill_forward":
            kill(cfg, "forward")
        if cfg.fault == "kill_backward":
            out.register_hook(lambda grad: kill(cfg, "backward"))
            return out
        if cfg.drill_dir:
            mark_struck(cfg.drill_dir, f"NaN batch on rank {cfg.fault_rank} at step {cfg.fault_step}")
        return out * float("nan")

    return call


def planted_stages(stages: pipeline.Stages, cfg: Faults) -> pipeline.Stages:
    """A model's pipeline stages whose first stage is :func:`planted`."""
    return dataclasses.replace(stages, first=planted(stages.first, cfg))


def arm(cfg: Faults) -> None:
    """On a real rank of a drill: leave this process's pid, and install the in-rank fault on its rank (once)."""
    if not cfg.drill_dir or not dist.is_initialized() or cfg.drill_dir in _ARMED:
        return
    _ARMED[cfg.drill_dir] = cfg
    _CALLS[0] = 0
    rank = dist.get_rank()
    _write_pid(cfg.drill_dir, rank)
    if cfg.fault in IN_SAVE and rank == cfg.fault_rank:
        checkpoint.add_save_hook(_save_fault(cfg))
    elif cfg.fault not in ("none", *IN_SAVE, *IN_MODEL, *IN_OPTIMIZER):
        raise ValueError(f"drill: unknown fault {cfg.fault!r}. "
                         f"Fix: one of none, {', '.join(IN_SAVE + IN_MODEL + IN_OPTIMIZER)}.")


def armed() -> Faults | None:
    """The fault this rank was armed with (:func:`arm`), or ``None`` outside a drill."""
    return next(reversed(_ARMED.values()), None)


def wrap(model: Any) -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
    """``(init, loss, stages)`` of a drill model module over the reference ``model``: init arms the rank, loss and
    the first stage are :func:`planted`."""

    def init(key: Any, cfg: Any) -> Any:
        arm(cfg)
        return model.init(key, cfg)

    def loss(params: Any, batch: Any, cfg: Any) -> Any:
        return planted(model.loss, cfg)(params, batch, cfg)

    def stages(cfg: Any) -> pipeline.Stages:
        return planted_stages(model.stages(cfg), cfg)

    return init, loss, stages
