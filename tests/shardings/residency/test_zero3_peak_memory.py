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


def _peak(layout, axes, local, model, layers):
    """Peak live bytes of one forward + backward above what was live before it, and the formulas' bytes."""
    cfg, mesh = _cfg(model, layers), Mesh(**axes)
    batch = model.example_batch(cfg, mesh.size // axes.get("tp", 1) // axes.get("cp", 1))
    names = model.axes(cfg)
    with shardings.simulate(mesh.size):
        params = shardings.init(model.init, core.random.key(0), cfg, axes=names, layout=layout, mesh=mesh)
        step = shardings.train_step(functools.partial(model.loss, cfg=cfg), core.optim.sgd(0.1), layout=layout,
                                    mesh=mesh, local=local, count_comms=False)
        step.grads(params, batch)  # plans and caches built once
        gc.collect()
        with peak_memory() as m:
            step.grads(params, batch)
    roles = {role: _role_bytes(params, names, layout, mesh, role) for role in ("grads", "compute")}
    return m.peak - m.at_entry, roles


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
