"""Faults a drill plants inside its ranks, armed from the model config (never from the library's step).

A drill's job runs a drill model module (:mod:`experiments.drill.mlp`, :mod:`experiments.drill.moe`): a
reference model plus the :class:`Faults` fields. Its ``init`` (run once per rank) calls :func:`arm`, which
leaves the rank's pid where the drill's watcher finds it (``<drill_dir>/pid_rank<r>``: faults from outside,
SIGKILL or SIGSTOP at a moment the watcher picks) and, for a fault inside ``checkpoint.save``, installs a
``shardings.checkpoint.add_save_hook`` hook on the chosen rank. Every run of a drill (the uninterrupted one, the
faulted one, the restart) passes all the fields, so the checkpoints' key paths match; only the values differ.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from shardings import checkpoint

__all__ = ["IN_SAVE", "Faults", "arm", "mark_struck"]

IN_SAVE = ("save_written", "save_manifest")  # SIGKILL at a checkpoint.save moment (add_save_hook's)
STRUCK = "struck"  # <drill_dir>/struck: when the fault struck (time.time()), written just before it strikes
_ARMED: set[str] = set()  # drill dirs this process armed (init may run more than once per rank)


@dataclasses.dataclass(frozen=True)
class Faults:
    """The fault fields a drill model's ``Config`` adds; the defaults plant nothing."""

    drill_dir: str = ""  # where ranks leave their pids and the fault its time; "" = not in a drill
    fault: str = "none"  # none | save_written | save_manifest (in-rank); external faults need only the pids
    fault_rank: int = 0  # the rank the in-rank fault strikes
    fault_step: int = 0  # the step whose checkpoint.save it strikes


def mark_struck(drill_dir: str, what: str) -> None:
    """Record when and what struck (the drill measures the seconds until every rank exited from it)."""
    Path(drill_dir, STRUCK).write_text(f"{time.time()} {what}\n")


def _write_pid(drill_dir: str, rank: int) -> None:
    tmp = Path(drill_dir, f".pid_rank{rank}")
    tmp.write_text(str(os.getpid()))
    tmp.replace(Path(drill_dir, f"pid_rank{rank}"))  # the watcher never reads half a pid


def _save_killer(cfg: Faults) -> Any:
    moment = cfg.fault.removeprefix("save_")

    def hook(at: str, folder: str) -> None:
        if at == moment and Path(folder).name == f"step_{cfg.fault_step}.tmp":
            mark_struck(cfg.drill_dir, f"SIGKILL rank {cfg.fault_rank} in checkpoint.save ({moment})")
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def arm(cfg: Faults) -> None:
    """On a real rank of a drill: leave this process's pid, and install the in-rank fault on its rank (once)."""
    if not cfg.drill_dir or not dist.is_initialized() or cfg.drill_dir in _ARMED:
        return
    _ARMED.add(cfg.drill_dir)
    rank = dist.get_rank()
    _write_pid(cfg.drill_dir, rank)
    if cfg.fault in IN_SAVE and rank == cfg.fault_rank:
        checkpoint.add_save_hook(_save_killer(cfg))
    elif cfg.fault not in ("none", *IN_SAVE):
        raise ValueError(f"drill: unknown fault {cfg.fault!r}. Fix: one of none, {', '.join(IN_SAVE)}.")
