"""A pipeline rank's actions on one step: what :func:`shardings.pipeline.run` drives, on one rank or on all of them.

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

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import torch

from shardings.pipeline.backward import backward_input, backward_weight
from shardings.pipeline.prefix import Prefixes
from shardings.pipeline.saved_activations import SavedActivations, tensor_leaves
from shardings.pipeline.schedule import Action, Schedule
from shardings.pipeline.seq_chunks import seq_length
from shardings.pipeline.stages import Split, Stages
from shardings.pipeline.wire import Message
from shardings.runtime.compat import pytree

__all__ = ["Result", "Runner", "Timed"]


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


def _receivable(tree: Any) -> Any:
    """A received carry: a fresh leaf per floating tensor, so backward stops here and yields its gradient."""
    return pytree.tree_map(lambda x: x.detach().requires_grad_(x.is_floating_point())
                           if isinstance(x, torch.Tensor) else x, tree)


class Runner:
    """One or every pipeline rank's actions on one step (module docstring), messages through ``transport``: the
    in-process mailbox of simulated ranks or the ``pp`` group's wire (:mod:`shardings.pipeline.execute`)."""

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
            out.append([x for x in tensor_leaves(mine) if x.requires_grad])
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
        outs = [out] if last else tensor_leaves(out)
        cots = [torch.ones_like(out)] if last else tensor_leaves(self.out_grads.pop((s, mb)))
        past: list[torch.Tensor] = []
        if self.prefixes is not None:  # its presents get what later chunks sent them; earlier chunks' leaves theirs
            presents, present_cots, past = self.prefixes.backward_terms(s, mb)
            outs, cots = outs + presents, cots + present_cots
        pairs = [(o, c) for o, c in zip(outs, cots) if o.requires_grad and c is not None]
        inputs = [x for x in tensor_leaves(carry) if x.requires_grad and x.is_leaf] + past  # received: fresh leaves
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
