"""Data-parallel layouts run the loss on local tensors: DDP/FSDP's speed from the same specs.

When a layout computes with every parameter replicated and splits only the batch (``dp``,
``zero1/2/3``, ``hsdp``: no model-parallel axis in its compute or activation rules), nothing
inside the loss needs a DTensor. Each rank's loss is the single-device loss on its own rows, so
the train step runs ``loss_fn`` on plain local tensors — no sharding propagation, no per-op
dispatch — and performs the layout's collectives itself, bucketed and asynchronous:

- **stored sharded** (ZeRO-3, HSDP): the shards are all-gathered in buckets (a bucket never spans
  two blocks) as the loss first uses them (:mod:`shardings.residency.lazy_params`), the next bucket's gather
  in flight meanwhile; a block's are freed when the loss moves on to the next (FSDP2's forward).
  Gathered parameters saved for backward are re-gathered there, one bucket at a time, prefetching
  the next bucket backward will need; the root unit's (outside the blocks) stay gathered, as FSDP2's.
  A bucket's backward reduce-scatters its gradients in one collective (then all-reduces over any
  other data axis, HSDP), launched asynchronously and awaited after backward.
- **stored replicated** (DP, ZeRO-1/2): gradients are packed into buckets in backward order; a
  bucket's collective (all-reduce; reduce-scatter into ZeRO's sharded optimizer state) is
  launched the moment its last gradient is produced, overlapping the rest of backward (DDP).

Each rank weighs its loss by its share of the global token count (one scalar all-reduce), so
the summed gradients are those of the global mean loss. Results equal the DTensor path's (the
equivalence tests run both); :func:`plan` returns ``None`` for layouts this does not cover.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from core import optim, tree
from core.optim.fused import fusable
from shardings.comm import flat_comm as fc
from shardings.residency import offload as host
from shardings.residency.gather_params import Regather
from shardings.residency.lazy_params import Gathers
from shardings.runtime.compat import funcol
from shardings.spec.layouts import LOGICAL_NAMES, Layout
from shardings.spec.mesh import Mesh
from shardings.spec.rules import logical_to_spec
from shardings.step.mixed import Cast

__all__ = ["LocalPlan", "apply", "global_norm", "plan", "run", "update_blocks"]

DEFAULT_GATHER_MB = 25.0  # bucket cap for re-gathering updated ZeRO-1/2 parameters
ShardAt = fc.ShardAt


class LocalPlan(NamedTuple):
    """How the local path moves each parameter and gradient.

    Attributes:
        data_dims: device-mesh dims the batch rows are split over (gradients are summed over them).
        stored: per leaf, where its storage is split (gathered before the loss when not None).
        target: per leaf, where its reduced gradient goes (the optimizer-state layout).
        gathers: buckets of stored-sharded leaves, in forward order (gathered and reduced together).
        reduces: buckets of stored-replicated leaves, in backward (reverse) order.
        kept: the ``gathers`` buckets autograd keeps gathered for backward (``flat_comm.unit_buckets``).
    """

    data_dims: tuple[int, ...]
    stored: tuple[ShardAt, ...]
    target: tuple[ShardAt, ...]
    gathers: tuple[tuple[int, ...], ...]
    reduces: tuple[tuple[int, ...], ...]
    kept: tuple[int, ...] = ()


def _split_at(placements: Sequence[Any], shape: Sequence[int], sizes: Sequence[int], data_dims) -> ShardAt | bool:
    """Where ``placements`` split a tensor: ``None`` (replicated), ``(mesh dim, dim)``, or ``False``: unsupported."""
    split = [(m, p.dim) for m, p in enumerate(placements) if not isinstance(p, Replicate)]
    if not split:
        return None
    if len(split) > 1 or type(placements[split[0][0]]) is not Shard or split[0][0] not in data_dims:
        return False
    m, d = split[0]
    return (m, d) if shape[d] % sizes[m] == 0 else False


def plan(placements: dict[str, list], params: Sequence[torch.Tensor], layout: Layout, mesh: Mesh,
         bucket_mb: float | None, units: Sequence[Any] | None = None) -> LocalPlan | None:
    """The local path's plan for these parameters and layout, or ``None`` if the layout needs DTensors.

    Stored-sharded leaves are gathered in buckets that never mix ``units`` (per leaf, e.g.
    ``flat_comm.unit_of(path)``: one transformer block), so backward holds one unit's gathered
    weights and gradients at a time, as FSDP does per wrapped block.

    >>> plan(step.plan(params).placements, tree.leaves(params), layouts.get("dp"), Mesh(dp=4), 25)  # doctest: +SKIP
    LocalPlan(data_dims=(0,), stored=(None, ...), ...)
    """
    axes = mesh.device_axes
    batch = (*logical_to_spec(("batch", "seq"), layout.role("batch"), mesh).dim_axes(), (), ())
    if batch[1] or not batch[0]:
        return None
    data_dims = tuple(axes.index(a) for a in batch[0])
    acts = layout.activation_rules
    if any(logical_to_spec((n,), acts, mesh).dim_axes()[:1] not in ((), ((),)) for n in LOGICAL_NAMES if n != "batch"):
        return None
    if any(not isinstance(p, Replicate) for pl in placements["compute"] for p in pl):
        return None
    sizes = [mesh.shape[a] for a in axes]
    stored, target = [], []
    for x, s, t in zip(params, placements["params"], placements["opt_state"]):
        s, t = _split_at(s, x.shape, sizes, data_dims), _split_at(t, x.shape, sizes, data_dims)
        if s is False or t is False or (s is not None and s != t):
            return None
        stored.append(s)
        target.append(t)
    gathered = [i for i, s in enumerate(stored) if s is not None]
    kept = [i for i, s in enumerate(stored) if s is None][::-1]
    def key(i: int) -> tuple:
        return target[i][0] if target[i] else None, params[i].dtype

    gathers, stays = fc.unit_buckets(gathered, params, key, bucket_mb, units)
    return LocalPlan(data_dims, tuple(stored), tuple(target), gathers, fc.buckets(kept, params, key, bucket_mb), stays)


# -- one step ------------------------------------------------------------------------------------------
class _Gathered:
    """Stored-sharded buckets: gathered before the loss, re-gathered in backward (``Regather``), reduce-scattered."""

    def __init__(self, comm: fc.Comm, lp: LocalPlan, shards: list[torch.Tensor], cast: Cast):
        self.comm, self.lp, self.shards, self.cast = comm, lp, shards, cast
        self.regather = Regather()
        self.registered: dict[int, int] = {}  # bucket -> its id in self.regather
        self.forward_gathers = Gathers(len(lp.gathers), lp.kept, self._launch, self._build)

    def forward(self) -> dict[int, torch.Tensor]:
        """Leaf index -> its full parameter: a placeholder gathered, with its bucket, when the loss first
        uses it (:class:`~shardings.residency.lazy_params.Gathers`)."""
        return self.forward_gathers.placeholders(self.lp.gathers, self.shards, lambda i: _full_shape(self, i))

    def _build(self, k: int, flat: torch.Tensor) -> list[torch.Tensor]:
        fulls = list(_GatherBucket.apply(self, k, flat, *[self.shards[i] for i in self.lp.gathers[k]]))
        if k not in self.lp.kept:  # else autograd keeps them: no backward re-gather
            self.registered[k] = self.regather.add(fulls, functools.partial(self._launch, k),
                                                   functools.partial(self._assemble, k))
        return fulls

    def _assemble(self, k: int, flat: torch.Tensor) -> list[torch.Tensor]:
        b = self.lp.gathers[k]
        return fc.assemble(self.comm, flat, [self.shards[i] for i in b], [self.lp.stored[i] for i in b])

    def _launch(self, k: int) -> torch.Tensor:
        b = self.lp.gathers[k]
        with torch.no_grad():  # the gather's backward is _GatherBucket's, not autograd's
            # cast before gathering: the collective moves compute-dtype bytes (FSDP2's param_dtype)
            return fc.launch_gather(self.comm, [self.cast.to_compute(self.shards[i].detach()) for i in b],
                                    self.lp.stored[b[0]])


class _GatherBucket(torch.autograd.Function):
    @staticmethod
    def forward(ctx, owner: _Gathered, k: int, flat: torch.Tensor, *shards: torch.Tensor):
        ctx.owner, ctx.k = owner, k
        b = owner.lp.gathers[k]
        return tuple(fc.assemble(owner.comm, flat, list(shards), [owner.lp.stored[i] for i in b]))

    @staticmethod
    def backward(ctx, *grads):
        owner, b = ctx.owner, ctx.owner.lp.gathers[ctx.k]
        if ctx.k in owner.registered:  # every user of this bucket has run its backward: free it
            owner.regather.release(owner.registered[ctx.k])
        reduce = owner.cast.reduce or owner.shards[b[0]].dtype
        grads = [torch.zeros(_full_shape(owner, i), dtype=reduce) if g is None else owner.cast.to_reduce(g)
                 for i, g in zip(b, grads)]
        target = [owner.lp.target[i] for i in b]
        flat = fc.launch_reduce(owner.comm, grads, target)
        return (None, None, None, *fc.split_reduced(owner.comm, flat, grads, target))


def _full_shape(owner: _Gathered, i: int) -> torch.Size:
    s, (m, d) = owner.shards[i].shape, owner.lp.stored[i]
    return torch.Size((*s[:d], s[d] * owner.comm.size(m), *s[d + 1:]))


def run(lp: LocalPlan, mesh: Mesh, loss_fn: Callable, treedef: Any, params: Sequence[DTensor],
        microbatches: Sequence[Any], token_count: Callable, cast: Cast, targets: Sequence[Any],
        scale: torch.Tensor | None = None):
    """``(loss, grads, tokens)`` of the global mean loss; grads are DTensors in ``targets`` placements.

    Args:
        lp: the plan from :func:`plan`.
        mesh: the mesh.
        loss_fn: the single-device loss ``(params, batch) -> mean over the batch's tokens``.
        treedef: the params' tree structure.
        params: parameter leaves in storage layout.
        microbatches: this rank's rows of each microbatch (plain tensors).
        token_count: ``batch -> tokens`` weighting each rank's and microbatch's loss.
        cast: the policy's dtypes (:mod:`shardings.step.mixed`): blocks cast to compute dtype before they
            are gathered, gradients reduced, accumulated and returned in reduce dtype.
        targets: each leaf's placements after reduction (the optimizer-state layout).
        scale: the loss scale: backward runs on ``loss * scale`` (the returned loss is unscaled).

    >>> loss, grads, tokens = run(lp, mesh, loss_fn, treedef, leaves, [rows], count, cast, targets)  # doctest: +SKIP
    """
    comm = fc.Comm(mesh.device_mesh, lp.data_dims)
    local = [p.to_local().detach().requires_grad_(True) for p in params]
    counts = torch.stack([torch.as_tensor(token_count(mb)) for mb in microbatches]).to(torch.int64)
    for m in lp.data_dims:
        counts = fc.wait(funcol.all_reduce(counts, "sum", comm.group(m)))
    total = counts.sum()
    acc: dict[int, torch.Tensor] = {}
    launched: list[Any] = [None] * len(lp.reduces)
    ready: list[dict[int, torch.Tensor]] = [{} for _ in lp.reduces]
    loss_sum = torch.zeros((), dtype=torch.float32)

    def on_grad(j: int, i: int) -> Callable:
        def hook(g: torch.Tensor) -> None:
            g = cast.to_reduce(g)
            ready[j][i] = g + acc[i] if i in acc else g
            if len(ready[j]) == len(lp.reduces[j]):  # the bucket's last gradient: launch its collective
                b = lp.reduces[j]
                launched[j] = fc.launch_reduce(comm, [ready[j][i] for i in b], [lp.target[i] for i in b])
        return hook

    for k, mb in enumerate(microbatches):
        last = k == len(microbatches) - 1
        gathered = _Gathered(comm, lp, local, cast)
        hooks = [local[i].register_hook(on_grad(j, i)) for j, b in enumerate(lp.reduces) for i in b] if last else []
        try:
            with gathered.regather.saving():
                fulls = gathered.forward()
                compute = [cast.to_compute(fulls.get(i, x)) for i, x in enumerate(local)]
                del fulls
                weight = torch.as_tensor(token_count(mb)).to(torch.float32) / total
                loss = loss_fn(tree.unflatten(treedef, compute), mb) * weight
                del compute
                gathered.forward_gathers.close()  # forward is over: autograd holds what backward needs
            grads = gathered.forward_gathers.grad(loss if scale is None else loss * scale, local, treedef)
        finally:
            gathered.forward_gathers.close()
            for h in hooks:
                h.remove()
        loss_sum = loss_sum + loss.detach().float()
        for i, g in enumerate(grads):
            if lp.stored[i] is not None:  # already reduce-scattered by its bucket's backward
                g = torch.zeros_like(local[i]) if g is None else fc.wait(g)
            elif last or g is None:
                continue
            g = cast.to_reduce(g)
            acc[i] = acc[i] + g if i in acc else g
    for j, b in enumerate(lp.reduces):  # buckets whose gradients did not all arrive (unused params)
        if launched[j] is None:
            grads = [ready[j].get(i, acc.get(i, cast.to_reduce(torch.zeros_like(local[i])))) for i in b]
            launched[j] = fc.launch_reduce(comm, grads, [lp.target[i] for i in b])
    reduced = {i: g for i, g in acc.items() if lp.stored[i] is not None}
    for j, b in enumerate(lp.reduces):
        like = [local[i] for i in b]
        reduced.update(zip(b, fc.split_reduced(comm, launched[j], like, [lp.target[i] for i in b])))
    for m in lp.data_dims:
        loss_sum = fc.wait(funcol.all_reduce(loss_sum, "sum", comm.group(m)))
    dm = mesh.device_mesh
    out = [fc.dtensor(reduced[i], dm, targets[i], p) for i, p in enumerate(params)]  # in reduce dtype
    return loss_sum, out, total


def update_blocks(optimizer: Any, treedef: Any, blocks: list[torch.Tensor], opt_state: Any, grads: Sequence[Any],
                  donate: bool = False, offload: bool = False,
                  blocks_on_host: bool = False) -> tuple[list[torch.Tensor], Any]:
    """An elementwise optimizer's update on each rank's blocks; returns ``(new blocks, new state)``.

    ``blocks`` are the local blocks of the parameters in the optimizer-state layout; ``grads`` and
    ``opt_state`` are in that layout (DTensors or not). The update runs the optimizer's
    ``fused_step`` (one fused kernel, in place; on copies unless ``donate``) where it has one and
    the blocks are plain (or LocalTensor) tensors, else its pure ``update`` (one foreach kernel per
    op); no DTensor dispatch either way. New state leaves are placed like the old ones.

    ``offload``: ``opt_state`` lives in host memory; the blocks and gradients are copied there, updated there,
    and the new blocks copied back (:mod:`shardings.residency.offload`). ``blocks_on_host``: the blocks are the
    master weights, which live on the host with the state (``mixed.Master``): only the gradients travel, and the
    new blocks stay there.

    >>> blocks, state = update_blocks(adamw, treedef, [p.to_local() for p in leaves], state, grads)  # doctest: +SKIP
    """
    def unwrap(x: Any) -> Any:
        return x.to_local() if isinstance(x, DTensor) else x

    local_grads, local_state = tree.unflatten(treedef, [unwrap(g) for g in grads]), tree.map(unwrap, opt_state)
    device = blocks[0].device if blocks else None
    if offload:  # the update runs where the state lives: on the host
        blocks = blocks if blocks_on_host else [host.to_host(b) for b in blocks]
        local_grads = host.to_host(local_grads)
    fused_step = getattr(optimizer, "fused_step", None)
    if fused_step is not None and fusable(blocks, local_state, local_grads):
        if not donate:  # offloaded: already fresh host copies (but the master's own blocks are not)
            blocks = blocks if offload and not blocks_on_host else [x.clone() for x in blocks]
            local_state = tree.map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, local_state)
        new, new_state = fused_step(local_grads, local_state, tree.unflatten(treedef, blocks))
    else:
        updates, new_state = optimizer.update(local_grads, local_state, tree.unflatten(treedef, blocks))
        new = optim.apply_updates(tree.unflatten(treedef, blocks), updates)

    def wrap(x: Any, like: Any) -> Any:  # a new state leaf, placed like the old one
        return fc.dtensor(x, like.device_mesh, like.placements, like) if isinstance(like, DTensor) else x

    new = tree.leaves(new)
    if offload and not blocks_on_host:
        new = [host.to_device(x, device) for x in new]
    return new, tree.map(wrap, new_state, opt_state)


def apply(lp: LocalPlan, mesh: Mesh, optimizer: Any, treedef: Any, params: Sequence[DTensor], opt_state: Any,
          grads: Sequence[DTensor], targets: Sequence[Any], storage: Sequence[Any],
          donate: bool = False, offload: bool = False,
          master: Cast | None = None) -> tuple[list[DTensor], list[DTensor] | None, Any]:
    """One update of an elementwise optimizer on local shards (:func:`update_blocks`); returns
    ``(params in storage layout, master weights or None, state)``. Parameters stored replicated whose state is
    sharded (ZeRO-1/2) are all-gathered back in buckets, one collective per bucket.

    ``master``: ``params`` are the master weights (``mixed.Master``, already in the ``targets`` layout): the
    update runs on their blocks, which are returned updated, and the new stored params are those blocks cast to
    ``master.compute`` before the all-gather (it moves compute-dtype bytes).

    >>> params, _, state = apply(lp, mesh, adamw, treedef, leaves, state, grads, targets, storage)  # doctest: +SKIP
    """
    dm = mesh.device_mesh
    p_opt = [p.to_local() if master is not None or lp.stored[i] is not None or lp.target[i] is None
             else p.redistribute(dm, targets[i]).to_local() for i, p in enumerate(params)]  # a local chunk, no comm
    device = p_opt[0].device if p_opt else None
    new, new_state = update_blocks(optimizer, treedef, p_opt, opt_state, grads, donate, offload,
                                   blocks_on_host=master is not None)
    weights = None
    if master is not None:
        weights = [fc.dtensor(x, dm, pl, p) for x, p, pl in zip(new, params, targets)]
        new = [master.to_compute(x) for x in new]
        if offload:  # the master stays on the host; the compute copy goes to the device
            new = [host.to_device(x, device) for x in new]
    regather = [i for i in range(len(new)) if lp.stored[i] is None and lp.target[i] is not None]
    comm = fc.Comm(dm, lp.data_dims)
    for b in fc.buckets(regather, new, lambda i: (lp.target[i][0], new[i].dtype), DEFAULT_GATHER_MB):
        shards = [new[i] for i in b]
        at = [lp.target[i] for i in b]
        new_b = fc.assemble(comm, fc.launch_gather(comm, shards, at[0]), shards, at)
        for i, x in zip(b, new_b):
            new[i] = x
    out = [fc.dtensor(x, dm, pl, p) for x, p, pl in zip(new, params, storage)]  # the dtype is the block's
    return out, weights, new_state


def global_norm(mesh: Mesh, grads: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The L2 norm of reduced gradients (DTensors split or replicated, none ``Partial``) as a plain 0-d
    tensor, or ``None`` when a gradient is not such a DTensor.

    Local blocks are normed with foreach kernels (``core.optim.global_norm``); the sums of squares of
    the blocks split over the same mesh dims are all-reduced over those: a few scalar collectives,
    and no DTensor op per leaf.

    >>> global_norm(mesh, tree.leaves(grads))  # doctest: +SKIP
    tensor(1.2345)
    """
    by_dims: dict[tuple[int, ...], list[torch.Tensor]] = {}
    for g in grads:
        if not isinstance(g, DTensor) or any(p.is_partial() for p in g.placements):
            return None
        dims = tuple(m for m, p in enumerate(g.placements) if p.is_shard() and mesh.device_mesh.size(m) > 1)
        by_dims.setdefault(dims, []).append(g.to_local())
    total = torch.zeros(())
    for dims, blocks in by_dims.items():
        sq = optim.global_norm(blocks).square()
        for m in dims:
            sq = fc.wait(funcol.all_reduce(sq, "sum", mesh.device_mesh.get_group(m)))
        total = total + sq
    return total.sqrt()
