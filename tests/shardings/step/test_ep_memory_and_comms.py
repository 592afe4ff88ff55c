"""ep layouts (models.moe): persistent bytes per rank per role and the collectives of one step, from formulas
(the ep row of docs/layouts.md's layout table)."""

import functools
import math

import pytest
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

import core
import models.moe as moe
import shardings
from core import tree
from shardings import Mesh
from tests.shardings.step.layout_cases import DP2_EP2, MOE_2  # the coverage cases' model and mesh


def _moe_sizes(cfg):
    """Elements of the dense weights and of the expert weights (leaves with an ``expert`` dim), the number of dense
    leaves and of all leaves, the MoE layers, and the root's elements (outside the blocks)."""
    params = moe.init(core.random.key(0), cfg)
    sizes = [x.numel() for x in tree.leaves(params)]
    is_expert = [("expert" in names) for names in tree.leaves(moe.axes(cfg), is_leaf=lambda a: isinstance(a, tuple))]
    expert = sum(n for n, e in zip(sizes, is_expert) if e)
    root = sum(x.numel() for k, x in params.items() if k != "blocks")
    return (sum(sizes) - expert, expert, is_expert.count(False), len(sizes), sum(map(cfg.is_moe, range(cfg.layers))),
            root)


def _ring(kind, n, nbytes):
    return nbytes * 2 * (n - 1) // n if kind == "all_reduce" else nbytes * (n - 1) // n


def _ep_memory(divisors):
    """Persistent bytes per rank per role: dense weights split by the data presets, expert weights by ep too;
    AdamW's two moments and its int32 step count."""
    dense, expert, *_ = _moe_sizes(MOE_2)
    out = {role: 4 * (dense // d + expert // e) * (2 if role == "opt_state" else 1) for role, (d, e) in
           zip(("params", "grads", "opt_state"), divisors)}
    out["opt_state"] += 4
    return {**out, "compute": 0, "host": 0}  # fp32: no compute-dtype copy; nothing offloaded


def _ep_comm(layout, mesh, rows):
    """Kinds, axes, counts and bytes of one step, from the model's sizes (docs/layouts.md's ep row)."""
    dense, expert, n_dense, n_leaves, moe_layers, root = _moe_sizes(MOE_2)
    ep, dp = mesh["ep"], mesh.get("dp", 1)
    local = 4 * (dense + expert // ep)  # a rank's share of the weights: experts split over ep
    # the MoE layers' all-to-alls: per layer 2 forward + 2 backward, each (ep-1)/ep of one rank's
    # (experts, rows · capacity, dim) fp32 buffer
    rank_rows = rows // math.prod(n for a, n in mesh.items() if a in ("dp", "fsdp", "ep"))
    buffer = 4 * MOE_2.experts * rank_rows * moe.capacity(MOE_2, MOE_2.seq_len) * MOE_2.dim
    table = {("all_to_all", "ep"): (4 * moe_layers, 4 * moe_layers * _ring("all_to_all", ep, buffer))}
    if layout in ("ep", "dp+ep"):
        # DDP over (dp, ep) for the dense weights (one bucket: all-reduce over each axis), over dp for experts
        table[("all_reduce", "ep")] = (1, _ring("all_reduce", ep, 4 * dense))
        if dp > 1:
            table[("all_reduce", "dp")] = (2, _ring("all_reduce", dp, local))
    elif layout in ("zero1+ep", "zero2+ep"):
        # per leaf (the DTensor path): reduce-scatter over dp, then the dense shard all-reduced over ep;
        # the updated shards all-gathered back over dp
        table[("reduce_scatter", "dp")] = (n_leaves, _ring("reduce_scatter", dp, local))
        table[("all_reduce", "ep")] = (n_dense, _ring("all_reduce", ep, 4 * dense // dp))
        table[("all_gather", "dp")] = (n_leaves, _ring("all_gather", dp, local))
    else:  # zero3+ep, hsdp+ep: ZeRO-3 over the shard axis
        # one bucket per block and one for the root: gathered, blocks again in backward, reduce-scattered;
        # before that each dense gradient is all-reduced over ep whole, one collective per leaf (and hsdp's
        # replica all-reduce over dp moves each leaf's whole gradient too: DTensor reduces Partial over the
        # mesh dims in order, dp before fsdp; reducing the fsdp shard would move half)
        units, axis = MOE_2.layers + 1, "fsdp" if "fsdp" in mesh else "dp"
        table[("all_gather", axis)] = (2 * units - 1, _ring("all_gather", mesh[axis], 2 * local - 4 * root))
        table[("reduce_scatter", axis)] = (units, _ring("reduce_scatter", mesh[axis], local))
        table[("all_reduce", "ep")] = (n_dense, _ring("all_reduce", ep, 4 * dense))
        if axis == "fsdp":
            table[("all_reduce", "dp")] = (n_leaves, _ring("all_reduce", dp, local))
    return table


# (dense divisor, expert divisor) of params, grads, opt_state per rank: the data presets split dense weights,
# ep splits expert weights in every role
EP_BYTES = {
    "ep ep2": ("ep", {"ep": 2}, [(1, 2), (1, 2), (1, 2)]),
    "ep ep4": ("ep", {"ep": 4}, [(1, 4), (1, 4), (1, 4)]),
    "dp+ep dp2×ep2": ("dp+ep", DP2_EP2, [(1, 2), (1, 2), (1, 2)]),
    "zero1+ep dp2×ep2": ("zero1+ep", DP2_EP2, [(1, 2), (1, 2), (2, 4)]),
    "zero2+ep dp2×ep2": ("zero2+ep", DP2_EP2, [(1, 2), (2, 4), (2, 4)]),
    "zero3+ep dp2×ep2": ("zero3+ep", DP2_EP2, [(2, 4), (2, 4), (2, 4)]),
    "hsdp+ep dp2×fsdp2×ep2": ("hsdp+ep", {"dp": 2, "fsdp": 2, "ep": 2}, [(2, 4), (2, 4), (2, 4)]),
}


@pytest.mark.parametrize(("layout", "sizes", "divisors"), list(EP_BYTES.values()), ids=list(EP_BYTES))
def test_ep_layouts_persistent_bytes_per_role_and_collectives_per_step(layout, sizes, divisors):
    # torch caches DTensor's sharding propagation by spec equality, so after an earlier simulate() in this process
    # some gradients carry that session's (equal, torn-down) DeviceMesh and buckets.plan, which keys buckets by the
    # DeviceMesh object, reduces them in two collectives instead of one: start from empty caches
    _clear_sharding_prop_cache()
    rows = max(4, math.prod(n for a, n in sizes.items() if a != "tp"))
    mesh, batch = Mesh(sizes), moe.example_batch(MOE_2, rows)  # built outside simulate(): one global batch
    with shardings.simulate(mesh.size):
        params = shardings.init(moe.init, core.random.key(0), MOE_2, axes=moe.axes(MOE_2), layout=layout, mesh=mesh)
        step = shardings.train_step(functools.partial(moe.loss, cfg=MOE_2), core.optim.adamw(1e-3), layout=layout,
                                    mesh=mesh, axes=moe.axes(MOE_2))
        _, _, metrics = step(params, step.init(params), batch)
    assert metrics["memory"] == _ep_memory(divisors)
    assert {(r["kind"], r["axis"]): (r["count"], r["bytes"]) for r in metrics["comm"]} == _ep_comm(layout, sizes, rows)
