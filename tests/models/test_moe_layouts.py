"""models.moe trains like one device under every layout and accumulation (issue 17, deliverable 1).

The load-balancing and z losses are per sequence (batch row) and weighted by the row's counted
labels (``models.moe``'s docstring), so any split of the batch by rows — data-parallel ranks
weighted by token share, accumulation microbatches, both — is exactly the single-device loss. With
statistics over each rank's or microbatch's tokens, ``dp``/``zero3``/``hsdp`` and ``dp+ep`` with
accumulation did not train like one device; those cases are pinned as the issue reported them.
The matrix runs both train-step paths: the local path (plain tensors: ``dp``, ``zero*``, ``hsdp``)
and the DTensor path (``tp``/``ep`` layouts, and ``dp`` with ``local=False``). Two planted bugs
(a plain mean over rows; statistics over the local batch) must make ``check_equivalence`` fail.
"""

import functools

import pytest

import core
from models import moe
from shardings import Mesh
from shardings.testing import EquivalenceError, check_equivalence

# One block, MoE (the issue's table below has a dense block before the MoE one). Capacity 0.5: 2 slots per
# expert for a row's 16 assignments over 4 experts, so every row drops assignments (pigeonhole) and capacity
# is exercised under every layout.
CFG = moe.Config(vocab=64, dim=32, mlp=32, layers=1, heads=2, seq_len=8, experts=4, top_k=2, moe_every=1,
                 capacity_factor=0.5)
# seed 3: counted labels per row 7, 3, 6, 7, 7, 5, 4, 6 (ranks and microbatches of unequal token share)
IGNORED = moe.example_batch(CFG, 8, seed=3, with_ignored=True)
SGD = functools.partial(core.optim.sgd, 0.1)  # param differences proportional to grad differences
ADAMW = functools.partial(core.optim.adamw, 1e-3)  # check_equivalence's default
DP2_EP2, DP2_TP2, TP2_EP2 = Mesh(dp=2, ep=2), Mesh(dp=2, tp=2), Mesh(tp=2, ep=2)


def _check(layouts, mesh, accum_steps, cfg=CFG, batch=IGNORED, steps=2, **kw):
    report = check_equivalence(moe.init, moe.loss, moe.axes, cfg, batch, layouts=layouts, mesh=mesh, steps=steps,
                               accum_steps=accum_steps, **kw)
    assert report.ok and len(report.rows) == 3 * steps * len(layouts)  # loss, grads, params per step and layout


def test_batch_has_unequal_rows_and_the_clipped_cases_clip():
    """What the cases below rely on: rows of unequal token counts, and a gradient norm above the clip."""
    assert (IGNORED["labels"] != -100).sum(-1).tolist() == [7, 3, 6, 7, 7, 5, 4, 6]
    grads = core.grad(functools.partial(moe.loss, cfg=CFG))(moe.init(core.random.key(0), CFG), IGNORED)
    assert float(core.optim.global_norm(core.tree.leaves(grads))) > 0.05


# -- the layout x accumulation matrix: 4 simulated ranks, SGD, ignored labels -------------------------------

MATRIX = [  # (mesh, layouts on it, accum_steps): one single-device reference per case
    (Mesh(dp=4), ["dp", "zero1", "zero2", "zero3"], (1, 2)),
    (Mesh(dp=2, fsdp=2), ["hsdp"], (1, 2)),
    (DP2_TP2, ["tp", "dp+tp+sp"], (1, 2)),
    (DP2_EP2, ["ep", "dp+ep", "zero3+ep"], (1, 2)),
    (DP2_EP2, ["zero1+ep", "zero2+ep"], (2,)),
    (TP2_EP2, ["tp+sp+ep"], (1, 2)),
    (TP2_EP2, ["tp+ep"], (2,)),
]


def _id(mesh, layouts, accum_steps):
    return f"{','.join(layouts)}-{'x'.join(f'{a}{n}' for a, n in mesh.shape.items())}-accum{accum_steps}"


@pytest.mark.parametrize(("mesh", "layouts", "accum_steps"), [
    pytest.param(mesh, layouts, k, id=_id(mesh, layouts, k)) for mesh, layouts, accums in MATRIX for k in accums])
def test_layouts_train_like_one_device(mesh, layouts, accum_steps):
    """accum_steps=2 with 4 data ranks (dp, or dp×ep) leaves one row per microbatch."""
    _check(layouts, mesh, accum_steps, optimizer=SGD)


@pytest.mark.parametrize(("layout", "mesh", "optimizer", "kw"), [
    pytest.param("dp", Mesh(dp=4), ADAMW, dict(local=False), id="dp-dtensor-path-adamw"),
    pytest.param("hsdp", Mesh(dp=2, fsdp=2), SGD, dict(clip_norm=0.05), id="hsdp-sgd-clipped"),
    pytest.param("zero3+ep", DP2_EP2, ADAMW, dict(clip_norm=0.05), id="zero3+ep-adamw-clipped"),
    pytest.param("tp+sp+ep", TP2_EP2, ADAMW, dict(clip_norm=0.05), id="tp+sp+ep-adamw-clipped"),
])
def test_more_options_with_accumulation(layout, mesh, optimizer, kw):
    _check([layout], mesh, 2, optimizer=optimizer, **kw)


# -- issue 17's table, as reported: default Config, batch 8, 2 steps, AdamW --------------------------------

DEFAULT = moe.Config()  # 2 blocks, the second MoE; seq 64, capacity 1.25


@pytest.mark.parametrize(("layouts", "mesh", "accum_steps"), [
    pytest.param(["dp", "zero3"], Mesh(dp=4), 1, id="dp,zero3-dp4"),
    pytest.param(["hsdp"], Mesh(dp=2, fsdp=2), 1, id="hsdp-dp2xfsdp2"),
    pytest.param(["dp+ep"], DP2_EP2, 2, id="dp+ep-dp2xep2-accum2"),
])
def test_issue_17_table(layouts, mesh, accum_steps):
    _check(layouts, mesh, accum_steps, cfg=DEFAULT, batch=moe.example_batch(DEFAULT, 8))


# -- planted bugs are caught --------------------------------------------------------------------------------


def test_plain_mean_over_rows_is_caught(monkeypatch):
    """Rows weighed equally: each rank's mean over its own rows is not its share of the batch's mean."""
    monkeypatch.setattr(moe, "_weigh_rows", lambda per_row, labels, ignore_index: per_row.mean())
    with pytest.raises(EquivalenceError, match=r"layout 'dp'.*grads differ"):
        _check(["dp"], Mesh(dp=4), 1, optimizer=SGD)


_ROUTE = moe._route


def _route_over_batch(x, router, cfg):
    """The pre-fix routing statistics: one group of all the rows the call sees, every row given its aux."""
    b, s, dim = x.shape
    top_i, weights, chosen, aux = _ROUTE(x.reshape(1, b * s, dim), router, cfg)
    unflat = lambda t: t.reshape(b, s, *t.shape[2:])
    return unflat(top_i), unflat(weights), unflat(chosen), {k: v.expand(b) for k, v in aux.items()}


def test_statistics_over_the_local_batch_are_caught(monkeypatch):
    """The semantics issue 17 reported (aux statistics over the rows a rank or microbatch sees)."""
    monkeypatch.setattr(moe, "_route", _route_over_batch)
    with pytest.raises(EquivalenceError, match=r"layout 'dp'.*differ"):
        _check(["dp"], Mesh(dp=4), 2, optimizer=SGD)
    # the same loss on one rank without accumulation sees the whole batch: it is not wrong in itself
    _check(["dp"], Mesh(dp=1), 1, optimizer=SGD, steps=1)
