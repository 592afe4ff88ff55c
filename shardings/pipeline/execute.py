"""Run a pipeline schedule: each rank's actions, point-to-point messages between the stages.

:func:`run` executes a checked :class:`~shardings.pipeline.schedule.Schedule` for a model's
:class:`~shardings.pipeline.stages.Stages` on microbatches, in one of two ways:

* **Real processes** (a mesh given, outside ``shardings.simulate``): each process runs its own rank's
  actions (its ``pp`` coordinate) and messages go over the ``pp`` process group
  (:mod:`shardings.pipeline.wire`); every rank's timeline is gathered, so ``Result.bubble()`` measures idle time.
* **Simulated ranks, or no mesh**: all ranks' programs run in this process. Ranks take turns, each running its
  actions until it waits on a receive whose message has not been sent; a send puts the message in an
  in-process mailbox (buffered, as a batched ``isend``). So any valid schedule runs, and its results do not
  depend on the interleaving.

What each action does (F, B, W, the sends and receives; TeraPipe's chunks; the timing and the saved bytes) is
:mod:`shardings.pipeline.runner`'s; the saved activations are counted by :mod:`shardings.pipeline.saved_activations`.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from shardings.comm.accounting import recorded_as
from shardings.pipeline.check import check
from shardings.pipeline.runner import Result, Runner, Timed
from shardings.pipeline.saved_activations import SavedActivations, tensor_leaves
from shardings.pipeline.schedule import Schedule
from shardings.pipeline.stages import Split, Stages
from shardings.pipeline.wire import Message, Wire, cached_templates
from shardings.runtime.compat import pytree
from shardings.runtime.simulate import simulated

__all__ = ["Message", "Result", "SavedActivations", "Timed", "in_process", "run"]


def _nbytes(tree: Any) -> int:
    """Bytes one rank holds: a DTensor's local block, one simulated rank's piece."""
    local = [x.to_local() if isinstance(x, DTensor) else x for x in tensor_leaves(tree)]
    return sum(x.numel() * x.element_size() for x in local)


class _Mailbox:
    """Messages between simulated ranks: a dict; a send to another rank is counted as one ``send`` on ``pp``
    (between two stages on one rank nothing travels, as on real ranks)."""

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self.box: dict[tuple[str, int, int], Any] = {}  # (kind, receiving stage, mb) -> payload
        self.p2p: list[Message] = []

    def send(self, kind: str, stage: int, mb: int, payload: Any) -> None:
        to = stage + 1 if kind == "F" else stage - 1
        detached = pytree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, payload)
        if self.schedule.rank_of(to) == self.schedule.rank_of(stage):
            self.box[(kind, to, mb)] = detached
            return
        nbytes = _nbytes(payload)
        self.p2p.append(Message(kind, stage, mb, nbytes))
        with recorded_as("send", "pp", nbytes):
            self.box[(kind, to, mb)] = detached

    def ready(self, kind: str, stage: int, mb: int) -> bool:
        return (kind, stage, mb) in self.box

    def recv(self, kind: str, stage: int, mb: int) -> Any:
        return self.box.pop((kind, stage, mb))


# id -> a schedule that passed check(): a Schedule is frozen, so once is enough (hashing one costs as much)
_CHECKED: weakref.WeakValueDictionary[int, Schedule] = weakref.WeakValueDictionary()


def _check_once(schedule: Schedule) -> None:
    if _CHECKED.get(id(schedule)) is not schedule:
        check(schedule)
        _CHECKED[id(schedule)] = schedule


def in_process(pp: int) -> bool:
    """Whether every pipeline rank's actions run in this process: on simulated ranks, or with one ``pp`` rank (then
    the mesh has no pipeline peers to message). Otherwise each real process runs its own rank's actions."""
    return pp == 1 or simulated()


def run(schedule: Schedule, stages: Stages, split: Split, params: Any, microbatches: Sequence[Any],
        weights: Sequence[float], *, mesh: Any = None, carry_layout: Any = None) -> Result:
    """Run ``schedule``; ``weights[i]``: microbatch ``i``'s token share (:mod:`shardings.pipeline.runner`). With
    ``schedule.seq_chunks = k``, ``microbatches`` and ``weights`` hold each microbatch's ``k`` chunks in order
    (:func:`~shardings.pipeline.seq_chunks.cut`).

    With a :class:`~shardings.Mesh` that has a ``pp`` axis, on real processes: this process runs its own rank's
    actions (its ``pp`` coordinate) and messages go over the ``pp`` process group
    (:mod:`shardings.pipeline.wire`). The loss is then the last stage's (every rank gets it), the timeline holds
    every rank's actions, and ``grads`` are this rank's: its stages' parameters, zeros elsewhere. Without a mesh,
    or on simulated ranks (``shardings.simulate``), every rank runs in this process.
    ``carry_layout = (plain_stages, placements, stage_mesh)`` says how a
    carry of DTensors travels: the stage functions without their layout context (for the meta-device run that
    sizes the messages), ``placements(carry) -> [placements per leaf]`` and the stage mesh's ``DeviceMesh``.

    Raises:
        ScheduleError: the schedule does not check (before any work).
        ValueError: the schedule, the split and the microbatches disagree on their counts.
    """
    _check_once(schedule)
    if schedule.stages != split.stages or schedule.units != len(microbatches) or len(weights) != len(microbatches):
        chunks = f" x {schedule.seq_chunks} chunks (one batch per chunk)" if schedule.seq_chunks > 1 else ""
        raise ValueError(f"pipeline run: schedule for {schedule.stages} stages, m={schedule.microbatches}{chunks}, "
                         "but a split "
                         f"into {split.stages} stages, {len(microbatches)} microbatches and {len(weights)} weights. "
                         "Fix: build the schedule and the split for the same pp and pass one weight per microbatch.")
    if mesh is not None and not in_process(schedule.pp):
        return _run_rank(schedule, stages, split, params, microbatches, weights, mesh, carry_layout)
    runner = Runner(schedule, stages, split, params, microbatches, weights, _Mailbox(schedule))
    pending = [list(actions) for actions in schedule.ranks]
    while any(pending):
        progressed = False
        for rank, actions in enumerate(pending):
            while actions and runner.ready(actions[0]):
                runner.do(rank, actions.pop(0))
                progressed = True
        if not progressed:  # check() rules this out; never spin
            raise RuntimeError(f"pipeline run: no rank can progress; next actions {[a[:1] for a in pending]}")
    return runner.result()


def _run_rank(schedule: Schedule, stages: Stages, split: Split, params: Any, microbatches: Sequence[Any],
              weights: Sequence[float], mesh: Any, carry_layout: Any) -> Result:
    dm = mesh.device_mesh
    rank, group = dm.get_local_rank("pp"), dm.get_group("pp")
    plain, placements, stage_dm = carry_layout or (stages, None, None)
    # a TeraPipe schedule's chunks differ in length: each chunk of the first microbatch gives its messages' layouts
    chunks = [cached_templates(plain, split, params, microbatches[c], placements, stage_dm)
              for c in range(schedule.seq_chunks)]
    wire = Wire(schedule, rank, group, chunks if schedule.seq_chunks > 1 else chunks[0])
    runner = Runner(schedule, stages, split, params, microbatches, weights, wire)
    for action in schedule.ranks[rank]:
        runner.do(rank, action)
    wire.finish()
    result = runner.result()
    loss = result.loss.full_tensor() if isinstance(result.loss, DTensor) else result.loss
    # One gather for what every rank reports (two collectives; a separate loss all-reduce was a third round)
    every: list[Any] = [None] * schedule.pp
    dist.all_gather_object(every, (result.timeline, result.saved_peak[rank], loss.detach().cpu()), group=group)
    loss = every[schedule.rank_of(schedule.stages - 1)][2].to(loss.device)  # the last stage's rank holds it
    return dataclasses.replace(result, loss=loss, timeline=[t for tl, _, _ in every for t in tl],
                               saved_peak=[peak for _, peak, _ in every], measured=True)
