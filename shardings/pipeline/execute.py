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

* **F** of stage ``s`` runs its blocks on the received carry (stage 0: ``first`` on the microbatch)
  and keeps the autograd graph until **B**; the last stage's output is the microbatch's loss times its
  token share, so the losses add up to the global batch's token mean.
* **B** backpropagates the received output gradient (last stage: 1) into the stage's parameters,
  accumulated over microbatches in one buffer per stage and parameter (``no_sync``: reduced once per step by
  the caller), and into the carry it received, which **SEND_B** passes to the previous stage. Where the
  schedule splits the backward, **B** computes only the carry's gradient and **W** the parameters'
  (:mod:`shardings.pipeline.backward`: bitwise the whole backward's). Each stage adds its microbatches'
  gradients in microbatch order whatever order they come in (one that comes early waits), and the stages'
  sums are added in stage order (a tied embedding on the first and the last), so every schedule for a
  split gives the same bits.
* **TeraPipe** (``schedule.seq_chunks = k``): ``microbatches`` holds each microbatch's ``k`` chunks (unit
  ``mb·k + c``: :class:`~shardings.pipeline.schedule.Action`), and ``weights`` their token shares. A stage runs a
  chunk's blocks by the model's ``Stages.prefix_block`` after the earlier chunks' keys and values, and a chunk's
  **B** also backpropagates the gradients the later chunks sent them (:mod:`shardings.pipeline.prefix`).
* Every action is timed (``timeline``), every message counted (``p2p``, and as ``send`` on axis ``pp`` in
  :func:`shardings.comms`), and each rank's activations saved for backward are tracked
  (``saved_peak``: the most bytes held at once, parameters excluded).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from shardings.comm.accounting import recorded_as
from shardings.comm.peak_memory import storages
from shardings.pipeline.backward import backward_input, backward_weight
from shardings.pipeline.check import check
from shardings.pipeline.prefix import Prefixes
from shardings.pipeline.schedule import Action, Schedule
from shardings.pipeline.seq_chunks import seq_length
from shardings.pipeline.stages import Split, Stages
from shardings.pipeline.wire import Message, Wire, cached_templates
from shardings.residency.gather_params import saved_tensors_hooks
from shardings.runtime.compat import pytree
from shardings.runtime.simulate import simulated

__all__ = ["Message", "Result", "SavedActivations", "Timed", "in_process", "run"]


@dataclasses.dataclass(frozen=True)
class Timed:
    rank: int
    action: Action
    start: float
    end: float


@dataclasses.dataclass
class Result:
    loss: torch.Tensor  # the global batch's token mean (detached)
    grads: Any  # like params: gradients summed over microbatches and stages
    timeline: list[Timed]
    saved_peak: list[int]  # per rank: most bytes of activations saved for backward at once
    p2p: list[Message]
    measured: bool = False  # the ranks ran concurrently (real processes): the timeline measures their idle time

    def bubble(self) -> list[float]:
        """Each rank's idle fraction: 1 − (its F, B and W time) / (first start to last end over all ranks).

        Meaningful where ``measured`` (real ranks: ``run`` gathers every rank's timeline); simulated ranks take
        turns.
        """
        t0, t1 = min(t.start for t in self.timeline), max(t.end for t in self.timeline)
        busy = [0.0] * len(self.saved_peak)
        for t in self.timeline:
            if t.action.kind in ("F", "B", "W"):
                busy[t.rank] += t.end - t.start
        return [1 - b / (t1 - t0) for b in busy]


class SavedActivations:
    """Bytes of tensors saved for backward per rank (``live`` now, ``peak`` the most at once), each storage once.

    The storage of ``params`` (a pytree of tensors) is not counted: only activations. Count a rank's backward
    graph by building it under ``hooks(rank)``; what :attr:`Result.saved_peak` reports, usable around any
    autograd code (``experiments.bench.pipeline_torch`` counts torch's pipeline schedules with it).

    >>> w = torch.ones(4, 4, requires_grad=True)
    >>> saved = SavedActivations(1, [w])
    >>> with saved.hooks(0):
    ...     loss = (torch.ones(2, 4) @ w).sin().sum()  # saves the (2, 4) input of @ and of sin, not w
    >>> saved.peak[0]
    64
    """

    def __init__(self, ranks: int, params: Any = ()):
        self.live, self.peak = [0] * ranks, [0] * ranks
        self.refs: list[dict[int, int]] = [{} for _ in range(ranks)]
        self.param_ptrs = {_key(st) for x in _tensors(params) for st in storages(x)}

    def hooks(self, rank: int) -> contextlib.AbstractContextManager[None]:
        def pack(t: torch.Tensor) -> Any:
            st = next(storages(t), None)  # one rank's piece (simulated ranks hold the same shapes)
            if st is None or _key(st) in self.param_ptrs:
                return t
            # t.detach(), not t: an output its own node saves (softmax's) would tie node and tensor in a cycle through
            # autograd's C++ graph, which gc cannot collect (every zero-bubble step's graph leaked: its B keeps it)
            return _Held(self, rank, st, t.detach())

        # seen beneath a ZeRO-3 Regather entered inside (a whole step's): gather_params.saved_tensors_hooks
        return saved_tensors_hooks(pack, lambda held: held.t if isinstance(held, _Held) else held)

    def add(self, rank: int, ptr: int, nbytes: int) -> None:
        refs = self.refs[rank]
        refs[ptr] = refs.get(ptr, 0) + 1
        if refs[ptr] == 1:
            self.live[rank] += nbytes
            self.peak[rank] = max(self.peak[rank], self.live[rank])

    def drop(self, rank: int, ptr: int, nbytes: int) -> None:
        refs = self.refs[rank]
        refs[ptr] -= 1
        if not refs[ptr]:
            del refs[ptr]
            self.live[rank] -= nbytes


def _key(st: torch.UntypedStorage) -> int:
    """A live storage's identity: its ``StorageImpl`` (not its data pointer, which is 0 for every fake tensor)."""
    return st._cdata


class _Held:
    def __init__(self, saved: SavedActivations, rank: int, st: torch.UntypedStorage, t: torch.Tensor):
        self.saved, self.rank, self.ptr, self.nbytes, self.t = saved, rank, _key(st), st.nbytes(), t
        saved.add(rank, self.ptr, self.nbytes)

    def __del__(self) -> None:
        self.saved.drop(self.rank, self.ptr, self.nbytes)


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def _nbytes(tree: Any) -> int:
    """Bytes one rank holds: a DTensor's local block, one simulated rank's piece."""
    local = [x.to_local() if isinstance(x, DTensor) else x for x in _tensors(tree)]
    return sum(x.numel() * x.element_size() for x in local)


def _receivable(tree: Any) -> Any:
    """A received carry: a fresh leaf per floating tensor, so backward stops here and yields its gradient."""
    return pytree.tree_map(lambda x: x.detach().requires_grad_(x.is_floating_point())
                           if isinstance(x, torch.Tensor) else x, tree)


class _Runner:
    def __init__(self, schedule: Schedule, stages: Stages, split: Split, params: Any, microbatches: Sequence[Any],
                 weights: Sequence[float], transport: Any):
        self.schedule, self.stages, self.split, self.transport = schedule, stages, split, transport
        self.microbatches, self.weights = microbatches, weights
        self.params = pytree.tree_map(lambda x: x.detach().requires_grad_(x.is_floating_point())
                                      if isinstance(x, torch.Tensor) else x, params)
        self.grads: dict[tuple[int, int], torch.Tensor] = {}  # (stage, id(leaf)) -> sum over microbatches so far
        self.early: list[dict[int, list[Any]]] = [{} for _ in range(schedule.stages)]  # per stage: mb -> grads
        self.summed = [0] * schedule.stages  # per stage: microbatches added to self.grads
        self.pending_w: dict[tuple[int, int], Any] = {}  # (stage, mb) -> what W needs (split backward)
        self.leaves = self._stage_leaves()
        self.saved = SavedActivations(schedule.pp, self.params)
        self.inputs: dict[tuple[int, int], Any] = {}  # (stage, mb) -> received carry
        self.graphs: dict[tuple[int, int], tuple[Any, Any]] = {}  # (stage, mb) -> (input carry, output)
        self.out_grads: dict[tuple[int, int], Any] = {}  # (stage, mb) -> gradient received for the output
        self.in_grads: dict[tuple[int, int], Any] = {}  # (stage, mb) -> gradient of the input, to send
        self.losses: dict[int, torch.Tensor] = {}  # mb -> its loss times its token share
        self.timeline: list[Timed] = []
        self.k = schedule.seq_chunks  # TeraPipe: chunks per microbatch (module docstring)
        self.prefixes = Prefixes(stages, self.k) if self.k > 1 else None

    def _stage_leaves(self) -> list[list[torch.Tensor]]:
        """The parameters each stage may use: its blocks; the rest on the first and the last stage."""
        rest = {k: v for k, v in self.params.items() if k != self.stages.blocks}
        blocks = self.params[self.stages.blocks]
        out = []
        for s, r in enumerate(self.split.ranges):
            mine = [blocks[i] for i in r] + ([rest] if s in (0, self.split.stages - 1) else [])
            out.append([x for x in _tensors(mine) if x.requires_grad])
        return out

    def ready(self, a: Action) -> bool:
        return not a.kind.startswith("RECV") or self.transport.ready(a.kind[-1], a.stage, a.mb)

    def do(self, rank: int, a: Action) -> None:
        start = time.perf_counter()
        getattr(self, "_" + a.kind.lower())(rank, a.stage, a.mb)
        self.timeline.append(Timed(rank, a, start, time.perf_counter()))

    def _f(self, rank: int, s: int, mb: int) -> None:
        batch = self.microbatches[mb]
        with self.saved.hooks(rank):
            carry = self._first(mb) if s == 0 else self.inputs.pop((s, mb))
            x = carry
            if self.prefixes is not None:
                blocks = [(i, self.params[self.stages.blocks][i]) for i in self.split.ranges[s]]
                x = self.prefixes.forward(s, mb, blocks, x)
            else:
                for i in self.split.ranges[s]:
                    x = self.stages.block(self.params[self.stages.blocks][i], x, i)
            if s == self.split.stages - 1:
                x = self.stages.last(self.params, x, batch) * self.weights[mb]
                self.losses[mb] = x.detach()
        self.graphs[(s, mb)] = (carry, x)

    def _first(self, unit: int) -> Any:
        """The first stage on unit ``unit``; a TeraPipe chunk at its offset, the earlier chunks' lengths."""
        if self.k == 1:
            return self.stages.first(self.params, self.microbatches[unit])
        offset = sum(seq_length(self.microbatches[u]) for u in range(unit - unit % self.k, unit))
        return self.stages.chunk_first(self.params, self.microbatches[unit], offset)

    def _b(self, rank: int, s: int, mb: int) -> None:
        carry, out = self.graphs.pop((s, mb))
        last = s == self.split.stages - 1
        outs = [out] if last else _tensors(out)
        cots = [torch.ones_like(out)] if last else _tensors(self.out_grads.pop((s, mb)))
        past: list[torch.Tensor] = []
        if self.prefixes is not None:  # its presents get what later chunks sent them; earlier chunks' leaves theirs
            presents, present_cots, past = self.prefixes.backward_terms(s, mb)
            outs, cots = outs + presents, cots + present_cots
        pairs = [(o, c) for o, c in zip(outs, cots) if o.requires_grad and c is not None]
        inputs = [x for x in _tensors(carry) if x.requires_grad and x.is_leaf] + past  # received: fresh leaves
        outs, cots, leaves = [o for o, _ in pairs], [c for _, c in pairs], self.leaves[s]
        if self.schedule.split_backward:  # B: the carry's gradient now, W the parameters' later
            in_grads, self.pending_w[(s, mb)] = backward_input(outs, cots, inputs, leaves)
        else:
            grads = torch.autograd.grad(outs, inputs + leaves, cots, allow_unused=True)
            in_grads = grads[: len(inputs)]
            self._accumulate(s, mb, grads[len(inputs):])
        if self.prefixes is not None:
            own = len(inputs) - len(past)
            self.prefixes.send_to_past(s, mb, list(in_grads[own:]))
            in_grads = in_grads[:own]
        if s > 0:
            it = iter(in_grads)
            self.in_grads[(s, mb)] = pytree.tree_map(
                lambda x: (next(it) if x.requires_grad else torch.zeros_like(x)) if isinstance(x, torch.Tensor) else x,
                carry)

    def _w(self, rank: int, s: int, mb: int) -> None:
        self._accumulate(s, mb, backward_weight(self.pending_w.pop((s, mb)), self.leaves[s]))

    def _accumulate(self, s: int, mb: int, grads: Any) -> None:
        """Add a microbatch's gradients to stage ``s``'s sums in microbatch order (an early one waits)."""
        self.early[s][mb] = grads
        while self.summed[s] in self.early[s]:
            for leaf, g in zip(self.leaves[s], self.early[s].pop(self.summed[s])):
                if g is not None:
                    key = (s, id(leaf))
                    held = self.grads.get(key)
                    self.grads[key] = g if held is None else held + g
            self.summed[s] += 1

    def _send_f(self, rank: int, s: int, mb: int) -> None:
        self.transport.send("F", s, mb, self.graphs[(s, mb)][1])

    def _send_b(self, rank: int, s: int, mb: int) -> None:
        self.transport.send("B", s, mb, self.in_grads.pop((s, mb)))

    def _recv_f(self, rank: int, s: int, mb: int) -> None:
        self.inputs[(s, mb)] = _receivable(self.transport.recv("F", s, mb))

    def _recv_b(self, rank: int, s: int, mb: int) -> None:
        self.out_grads[(s, mb)] = self.transport.recv("B", s, mb)

    def result(self) -> Result:
        def total(x: torch.Tensor) -> torch.Tensor:  # the stages' sums, added in stage order
            parts = [self.grads[s, id(x)] for s in range(self.split.stages) if (s, id(x)) in self.grads]
            return sum(parts[1:], parts[0]) if parts else torch.zeros_like(x)

        grads = pytree.tree_map(lambda x: total(x) if isinstance(x, torch.Tensor) and x.requires_grad else None,
                                self.params)
        losses = [self.losses[mb] for mb in sorted(self.losses)]
        loss = torch.stack(losses).sum() if losses else torch.zeros(())
        return Result(loss, grads, self.timeline, self.saved.peak, self.transport.p2p)


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
    """Run ``schedule``; ``weights[i]``: microbatch ``i``'s token share (module docstring). With
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
    runner = _Runner(schedule, stages, split, params, microbatches, weights, _Mailbox(schedule))
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
    runner = _Runner(schedule, stages, split, params, microbatches, weights, wire)
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
