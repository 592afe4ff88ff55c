"""Pipeline messages between real processes: point-to-point sends on the mesh's ``pp`` process group.

A message (a carry, or its gradient) travels as one byte buffer: its tensors' bytes concatenated, so a
pytree carry of mixed dtypes (``(x, aux_losses)``) is still one ``isend``. The receiver knows the layout
beforehand from a shape-only run of the stages on the first microbatch (fake tensors of the real tensors' device,
so a constant the model makes inside its loss, ``torch.arange`` rotary tables or a ``torch.ones(s, s)`` mask, meets
tensors of its own device as in the real run), so nothing but the payload crosses the wire. That run costs about as
much as a forward of the whole model in Python (meta kernels): ~0.27 s for the bench's 8-block gpt, a fifth of a
step; it is cached per stages object, split, layout and the shapes and dtypes of the parameters and the microbatch,
so a training loop pays it once.
Sends are non-blocking (``isend``, awaited once a message from the peers proves them delivered, which frees
their buffers: :mod:`shardings.pipeline.delivery`; the rest at the end of the step) and a receive is posted when the
program reaches it, as ``torch.distributed.pipelining`` does: gloo writes a message in the sending thread when its
receive is already posted (~2.4 ms for 256 KiB here, against 0.03 ms for an ``isend`` whose receive comes later,
its bytes then moved by gloo's own threads), so posting receives ahead stalled the senders' compute.
Each message has its own tag (direction, boundary, microbatch), so a schedule may send a boundary's
microbatches in any order. Between two stages on the same rank (the turn of ZB-V's V) nothing travels: the
payload is handed over in process.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from shardings.pipeline.delivery import delivered_by
from shardings.pipeline.schedule import Action, Schedule
from shardings.pipeline.stages import Split, Stages
from shardings.runtime import watchdog
from shardings.runtime.compat import FakeTensorMode, compute_local_shape_and_global_offset, pytree

__all__ = ["Message", "Template", "Wire", "cached_templates", "templates"]


@dataclasses.dataclass(frozen=True)
class Message:
    kind: str  # "F": an activation to stage + 1; "B": a gradient to stage - 1
    stage: int  # the sending stage
    mb: int
    nbytes: int


class Template:
    """The layout of one boundary's message: the carry's tree structure, each tensor's shape and dtype, and
    (a carry of DTensors on a stage mesh) each one's placements: then the local blocks travel."""

    def __init__(self, carry: Any, placements: list[Any] | None = None, device_mesh: Any = None):
        leaves, self.spec = pytree.tree_flatten(carry)
        if not all(isinstance(x, torch.Tensor) for x in leaves):
            raise TypeError(f"pipeline: the carry between stages must be a pytree of tensors, got {carry!r}. Fix: "
                            "pass plain values through the model's config, not the carry.")
        self.global_shapes = [x.shape for x in leaves]
        self.placements, self.device_mesh = placements, device_mesh
        local = [x.shape if placements is None else compute_local_shape_and_global_offset(x.shape, device_mesh, pl)[0]
                 for x, pl in zip(leaves, placements or [None] * len(leaves))]
        self.shapes = [(torch.Size(shape), x.dtype) for shape, x in zip(local, leaves)]
        self.nbytes = sum(s.numel() * d.itemsize for s, d in self.shapes)

    def pack(self, payload: Any) -> torch.Tensor:
        leaves = [x.to_local() if isinstance(x, DTensor) else x for x in self.conform(pytree.tree_leaves(payload))]
        return torch.cat([x.detach().contiguous().reshape(-1).view(torch.uint8) for x in leaves])

    def conform(self, leaves: list[Any]) -> list[Any]:
        """``leaves`` laid out as this message travels: a carry leaf whose layout is not its ``carry_names``' (an aux
        loss from ``torch.zeros(b)``, replicated where the names say ``("batch",)``), or an input gradient that came
        out ``Partial``, is redistributed first (a plain tensor counts as replicated), so sender and receiver agree
        on every block's bytes."""
        if self.placements is None:
            return leaves
        out = []
        for x, pl in zip(leaves, self.placements):
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, self.device_mesh, [Replicate()] * self.device_mesh.ndim, run_check=False)
            out.append(x if tuple(x.placements) == tuple(pl) else x.redistribute(self.device_mesh, pl))
        return out

    def unpack(self, buf: torch.Tensor) -> Any:
        out, at = [], 0
        for i, (shape, dtype) in enumerate(self.shapes):
            n = shape.numel() * dtype.itemsize
            x = buf[at:at + n].view(dtype).reshape(shape)
            if self.placements is not None:
                g = self.global_shapes[i]
                x = DTensor.from_local(x, self.device_mesh, self.placements[i], run_check=False, shape=g,
                                       stride=torch.empty(g, device="meta").stride())
            out.append(x)
            at += n
        return pytree.tree_unflatten(out, self.spec)


def _device(*trees: Any) -> torch.device:
    """The device the stages compute on: the first tensor's that is not meta (a real rank holds the blocks of
    other ranks' stages as meta placeholders), else the CPU."""
    found = (x.device for x in pytree.tree_leaves(trees) if isinstance(x, torch.Tensor) and x.device.type != "meta")
    return next(found, torch.device("cpu"))


def _fake(tree: Any, device: torch.device) -> Any:
    """Plain fake tensors of the global shapes (a DTensor's too) on ``device`` (call inside a
    :class:`FakeTensorMode`): a constant the stages create (CPU by default) then meets tensors of the device it
    meets in the real run, where meta tensors refused it (``Tensor on device cpu is not on the expected device
    meta``)."""
    return pytree.tree_map(lambda x: torch.empty(x.shape, dtype=x.dtype, device=device)
                           if isinstance(x, torch.Tensor) else x, tree)


def templates(stages: Stages, split: Split, params: Any, microbatch: Any,
              placements: Callable[[Any], list[Any]] | None = None, device_mesh: Any = None) -> list[Template]:
    """``out[s]``: the message between stage ``s`` and ``s + 1`` (a forward carry; its gradient has its layout).

    ``stages`` run on fake tensors of the global shapes (outside any layout; constants made outside the mode, such
    as a module-level table, are allowed as they are on every other path); ``placements(carry)``, when given,
    lays each carry leaf out on ``device_mesh`` (a stage mesh): then messages hold local blocks.
    """
    carries, device = [], _device(microbatch, params)
    with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True):
        params = _fake(params, device)
        carry = stages.first(params, _fake(microbatch, device))
        for blocks in split.ranges[:-1]:
            for i in blocks:
                carry = stages.block(params[stages.blocks][i], carry, i)
            carries.append(carry)
    return [Template(c, placements(c) if placements else None, device_mesh) for c in carries]


def _signature(tree: Any) -> tuple[Any, ...]:
    """A tree's structure and each leaf's type, global shape and dtype (what :func:`templates` reads)."""
    leaves, spec = pytree.tree_flatten(tree)
    return spec, tuple((type(x), x.shape, x.dtype) if isinstance(x, torch.Tensor) else x for x in leaves)


# stages -> {(split, layout, params' and microbatch's signatures): templates}; dropped with the stages
_CACHE: weakref.WeakKeyDictionary[Stages, dict[Any, list[Template]]] = weakref.WeakKeyDictionary()


def cached_templates(stages: Stages, split: Split, params: Any, microbatch: Any,
                     placements: Callable[[Any], list[Any]] | None = None, device_mesh: Any = None) -> list[Template]:
    """:func:`templates`, computed once per ``stages`` object, split, layout and input shapes and dtypes."""
    key = (split.ranges, placements, device_mesh, _signature(params), _signature(microbatch))
    try:
        hash(key)
    except TypeError:  # a non-tensor leaf that cannot be a key: no caching
        return templates(stages, split, params, microbatch, placements, device_mesh)
    mine = _CACHE.setdefault(stages, {})
    if key not in mine:
        mine[key] = templates(stages, split, params, microbatch, placements, device_mesh)
    return mine[key]


def _laid_out(g: Any, placements: Any) -> Any:
    """``g`` with ``placements`` (``None``: a plain tensor, as the output it is the gradient of was)."""
    if not isinstance(g, DTensor):
        return g
    if placements is None:
        return g.full_tensor()
    return g if tuple(g.placements) == tuple(placements) else g.redistribute(g.device_mesh, placements)


class Wire:
    """One rank's sends and receives (the runner's transport on real processes)."""

    def __init__(self, schedule: Schedule, rank: int, group: Any, layouts: list[Template] | list[list[Template]]):
        # layouts[boundary]; a TeraPipe schedule's chunks differ in length: layouts[chunk][boundary]
        self.schedule, self.group = schedule, group
        self.layouts = layouts if schedule.seq_chunks > 1 else [layouts]
        self.rank = rank
        self.local: dict[tuple[str, int, int], Any] = {}  # (kind, receiving stage, mb) -> payload
        self.sends: dict[Action, tuple[Any, torch.Tensor]] = {}  # in flight: the send's work and buffer
        self.delivered = delivered_by(schedule, rank)
        self.p2p: list[Any] = []
        self.sent_as: dict[tuple[int, int], list[Any]] = {}  # (stage, mb) -> its sent output leaves' placements

    def _peer(self, stage: int) -> int:
        return dist.get_global_rank(self.group, self.schedule.rank_of(stage))

    def _tag(self, kind: str, boundary: int, mb: int) -> int:
        return 2 * (mb * self.schedule.stages + boundary) + (kind == "B")

    def ready(self, kind: str, stage: int, mb: int) -> bool:
        return True  # a receive blocks until its message arrives

    def recv(self, kind: str, stage: int, mb: int) -> Any:
        if (kind, stage, mb) in self.local:
            return self.local.pop((kind, stage, mb))
        boundary, sender = (stage - 1, stage - 1) if kind == "F" else (stage, stage + 1)
        layout = self.layouts[mb % self.schedule.seq_chunks][boundary]
        buf = torch.empty(layout.nbytes, dtype=torch.uint8)
        peer = self._peer(sender)
        message = (f"for the {'activations' if kind == 'F' else 'input gradient'} of microbatch {mb} from rank {peer} "
                   f"(stage {sender})")
        try:
            with watchdog.waiting_for(message):  # a silent peer is named with the message (runtime/watchdog.py)
                dist.irecv(buf, src=peer, group=self.group, tag=self._tag(kind, boundary, mb)).wait()
        except RuntimeError as e:  # a timeout or a closed connection: say which message from whom
            raise RuntimeError(f"pipeline: stage {stage} waited {message} and got none "
                               f"({type(e).__name__}: {e})") from e
        for sent in self.delivered.get(Action(f"RECV_{kind}", stage, mb), ()):  # known received: free their buffers
            self.sends.pop(sent)[0].wait()
        payload = layout.unpack(buf)
        if kind == "B":  # the output's gradient in the layout the output had (conform() may have changed it to send)
            leaves, spec = pytree.tree_flatten(payload)
            payload = pytree.tree_unflatten([_laid_out(g, pl) for g, pl in zip(leaves, self.sent_as.pop((stage, mb)))],
                                            spec)
        return payload

    def send(self, kind: str, stage: int, mb: int, payload: Any) -> None:
        boundary = stage if kind == "F" else stage - 1
        to = stage + 1 if kind == "F" else stage - 1
        if self.schedule.rank_of(to) == self.rank:  # the next stage runs here too: hand it over
            self.local[(kind, to, mb)] = pytree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x,
                                                         payload)
            return
        if kind == "F":
            self.sent_as[(stage, mb)] = [x.placements if isinstance(x, DTensor) else None
                                         for x in pytree.tree_leaves(payload)]
        flat = self.layouts[mb % self.schedule.seq_chunks][boundary].pack(payload)
        self.p2p.append(Message(kind, stage, mb, flat.numel()))
        self.sends[Action(f"SEND_{kind}", stage, mb)] = (
            dist.isend(flat, dst=self._peer(to), group=self.group, tag=self._tag(kind, boundary, mb)), flat)

    def finish(self) -> None:
        for work, _ in self.sends.values():
            work.wait()
        self.sends.clear()
