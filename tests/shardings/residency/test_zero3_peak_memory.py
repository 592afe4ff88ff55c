"""ZeRO-3 frees what it gathers: the peak of a forward + backward grows, per added block, by that block's reduced
gradients (the grads role of the layout, DESIGN §6) and by at most one gathered block in all — not by a
gathered copy of every block, which is data parallelism's memory.

Measured with ``shardings.comm.peak_memory`` on simulated ranks (the sum over ranks of live tensor bytes) at 1
and 3 blocks, on each path (local, DTensor) and each composition with ZeRO-3; the bounds come from the per-role
formulas (``shardings.describe_layout``'s shares), not from a previous run. The model is wide and the batch
tiny (one row of 4 tokens per data rank) so that weights, not activations, make the difference: a block's
activations are under a tenth of its gathered weights here, and the allowance of one gathered block covers
them. The optimizer's update is not measured (its temporaries belong to the optimizer, not to the gathers).
"""

import functools
import gc

import pytest

import core
import shardings
from models import gpt, moe
from shardings import Mesh
from shardings.comm.peak_memory import peak_memory

F32 = 4
CASES = [  # (layout, mesh axes, local, model): every path and composition with ZeRO-3's gather
    ("zero3", {"dp": 4}, True, gpt),  # the local path
    ("zero3", {"dp": 4}, False, gpt),  # the DTensor path
    ("hsdp", {"dp": 2, "fsdp": 2}, True, gpt),
    ("zero3+tp+sp", {"dp": 2, "tp": 2}, False, gpt),
    ("zero3+cp", {"dp": 2, "cp": 2}, False, gpt),
    ("zero3+ep", {"dp": 2, "ep": 2}, False, moe),
]


def _cfg(model, layers):
    kw = dict(vocab=32, dim=64, layers=layers, heads=4, kv_heads=4, mlp=256, seq_len=4)
    if model is moe:
        kw |= dict(experts=4, top_k=2, moe_every=1, capacity_factor=None, expert_mlp=128)
    return model.Config(**kw)


def _role_bytes(params, axes, layout, mesh, role):
    """Bytes of ``role`` (grads: reduced gradients; compute: params gathered for compute) summed over the ranks,
    by the layout's per-role shares (fp32)."""
    view = shardings.describe_layout(params, axes, layout, mesh)
    return sum(F32 * r.count * _numel(r.shape) * mesh.size * r.shares[role] for r in view.rows)


def _numel(shape):
    out = 1
    for d in shape:
        out *= d
    return out


def _marked_loss(params, batch, cfg, model, marks):
    """``model.loss``, noting the live and peak bytes when backward starts (its first hook: the loss's gradient)."""
    loss = model.loss(params, batch, cfg)
    m = marks.get("m")
    if m is not None:
        loss.register_hook(lambda g: marks.update(forward_peak=m.peak, forward_live=m.live))
    return loss


@functools.cache
def _measured(layout, axes, local, model, layers):
    """Peak live bytes of one forward + backward, and of the forward alone (until backward starts), above what was
    live before it; and the formulas' bytes per role. Cached: the forward and the whole step share the runs."""
    axes = dict(axes)
    cfg, mesh = _cfg(model, layers), Mesh(**axes)
    batch = model.example_batch(cfg, mesh.size // axes.get("tp", 1) // axes.get("cp", 1))
    names = model.axes(cfg)
    marks = {}
    with shardings.simulate(mesh.size):
        params = shardings.init(model.init, core.random.key(0), cfg, axes=names, layout=layout, mesh=mesh)
        loss = functools.partial(_marked_loss, cfg=cfg, model=model, marks=marks)
        step = shardings.train_step(loss, core.optim.sgd(0.1), layout=layout, mesh=mesh, local=local,
                                    count_comms=False)
        step.grads(params, batch)  # plans and caches built once
        gc.collect()
        with peak_memory() as m:
            marks["m"] = m
            step.grads(params, batch)
    roles = {role: _role_bytes(params, names, layout, mesh, role) for role in ("grads", "compute")}
    return m.peak - m.at_entry, marks["forward_peak"] - m.at_entry, roles


def _peak(layout, axes, local, model, layers):
    whole, _, roles = _measured(layout, tuple(axes.items()), local, model, layers)
    return whole, roles


@pytest.mark.parametrize(("layout", "axes", "local", "model"), CASES,
                         ids=[f"{c[0]}-{'local' if c[2] else 'dtensor'}" for c in CASES])
def test_the_peak_grows_by_the_blocks_gradients_and_at_most_one_gathered_block(layout, axes, local, model):
    (small, roles_1), (large, roles_3) = (_peak(layout, axes, local, model, n) for n in (1, 3))
    grads = roles_3["grads"] - roles_1["grads"]  # the reduced gradients of 2 more blocks, as the layout stores them
    gathered_block = (roles_3["compute"] - roles_1["compute"]) / 2  # one block gathered for compute, on every rank
    growth = large - small
    assert grads <= growth <= grads + gathered_block, (
        f"{layout} ({'local' if local else 'DTensor'} path): 2 more blocks raised the peak by {growth:,.0f} B; "
        f"their gradients are {grads:,.0f} B and one gathered block {gathered_block:,.0f} B"
    )


FORWARD_CASES = [  # ZeRO-3's presets on each path they run (tp: the DTensor path only)
    ("zero3", {"dp": 4}, True),
    ("zero3", {"dp": 4}, False),
    ("hsdp", {"dp": 2, "fsdp": 2}, True),
    ("hsdp", {"dp": 2, "fsdp": 2}, False),
    ("zero3+tp+sp", {"dp": 2, "tp": 2}, False),
]


@pytest.mark.parametrize(("layout", "axes", "local"), FORWARD_CASES,
                         ids=[f"{c[0]}-{'local' if c[2] else 'dtensor'}" for c in FORWARD_CASES])
def test_the_forward_alone_holds_one_gathered_bucket_whatever_the_depth(layout, axes, local):
    """The forward's peak (until backward starts) grows from 1 to 3 blocks by the 2 blocks' saved activations
    only, under one gathered block (the one-bucket bound; activations are a fifth of it here): the forward holds one
    block's gathered weights at a time, and autograd saves none of them. A forward that keeps every block's gathered
    weights (data parallelism's forward) grows by 2 gathered blocks."""
    key = tuple(axes.items())
    (_, small, roles_1), (_, large, roles_3) = (_measured(layout, key, local, gpt, n) for n in (1, 3))
    gathered_block = (roles_3["compute"] - roles_1["compute"]) / 2  # one block gathered for compute, on every rank
    growth = large - small
    assert 0 < growth <= gathered_block, (
        f"{layout} ({'local' if local else 'DTensor'} path): 2 more blocks raised the forward's peak by "
        f"{growth:,.0f} B ({growth / gathered_block:.2f} gathered blocks of {gathered_block:,.0f} B)"
    )
