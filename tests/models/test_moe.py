"""models.moe: the MoE MLP equals a loop over tokens and experts (values, grads, per-row aux losses, capacity
drops), locally and under expert parallelism (ep = 1, 2, 4, 8; tp+ep), with 2 all-to-alls each way and no
collective for the aux losses; hand-computed capacity, routing, aux losses and loss weighting; the loss of a
batch is its row splits' token-weighted sum. The layout x accumulation matrix: test_moe_layouts.py."""

import dataclasses
import functools
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import core
import shardings
from models import gpt, moe
from shardings import Mesh, P, ShardingError, comms, per_rank, shard, use
from shardings.spec import layouts

TOL = dict(rtol=1e-5, atol=1e-6)
WEIGHTS = ("router", "w_gate", "w_up", "w_down")
CFG = moe.Config(vocab=32, dim=8, mlp=8, layers=2, heads=2, seq_len=8, experts=8, top_k=2, moe_every=2)


def loop_reference(p, x, cfg):
    """Token by token: top-k routing, per-row expert queues (first choices first), capacity drops, per-row aux."""
    batch, seq, dim = x.shape
    cap = _spec_capacity(cfg, seq)
    logits = x.float() @ p["router"]  # (batch, seq, experts)
    probs = logits.softmax(-1)
    dropped, rows, lb, z = 0, [], [], []
    for b in range(batch):
        counts = [0] * cfg.experts  # this row's assignments per expert
        top = [probs[b, t].topk(cfg.top_k) for t in range(seq)]
        fill, kept = [0] * cfg.experts, {}
        for j in range(cfg.top_k):
            for t in range(seq):
                e = int(top[t].indices[j])
                kept[t, j], fill[e] = fill[e] < cap, fill[e] + 1
        out = []
        for t in range(seq):
            weights = top[t].values / top[t].values.sum()
            y = torch.zeros(dim)
            for j in range(cfg.top_k):
                e = int(top[t].indices[j])
                counts[e] += 1
                if not kept[t, j]:
                    dropped += 1
                    continue
                h = F.silu(x[b, t] @ p["w_gate"][e]) * (x[b, t] @ p["w_up"][e])
                y = y + weights[j] * (h @ p["w_down"][e])
            out.append(y)
        rows.append(torch.stack(out))
        f = torch.tensor(counts, dtype=torch.float32) / (seq * cfg.top_k)
        lb.append(cfg.experts * (f * probs[b].mean(0)).sum())
        z.append(torch.logsumexp(logits[b], -1).pow(2).mean())
    return torch.stack(rows), {"load_balance": torch.stack(lb), "z_loss": torch.stack(z)}, dropped


def _spec_capacity(cfg, seq):
    """The documented capacity, written out here: the oracle must not trust moe.capacity."""
    if cfg.capacity_factor is None:
        return seq
    return min(seq, math.ceil(cfg.capacity_factor * seq * cfg.top_k / cfg.experts))


def _case(cfg, batch, seed):
    params = moe.init(core.random.key(seed), cfg)["blocks"][cfg.moe_every - 1]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, cfg.seq_len, cfg.dim, generator=gen)
    cot = torch.randn(batch, cfg.seq_len, cfg.dim, generator=gen)
    return {k: params[k] for k in WEIGHTS}, x, cot


def _objective(y, aux, cot, row_weights=None):
    """A scalar of output and per-row aux; rows weighed differently, so a row mixed up would show."""
    if row_weights is None:
        row_weights = torch.arange(1, y.shape[0] + 1, dtype=torch.float32)
    return (y * cot).sum() + ((3.0 * aux["load_balance"] + 5.0 * aux["z_loss"]) * row_weights).sum()


def _grads(fn, p, x, cot):
    leaves = [x.clone().requires_grad_()] + [p[k].clone().requires_grad_() for k in WEIGHTS]
    y, aux, *rest = fn(dict(zip(WEIGHTS, leaves[1:])), leaves[0])
    grads = torch.autograd.grad(_objective(y, aux, cot), leaves)
    return y.detach(), {k: v.detach() for k, v in aux.items()}, grads, rest


@settings(max_examples=10)
@given(cf=st.sampled_from([0.5, 1.0, 2.0, None]), top_k=st.integers(1, 3), experts=st.sampled_from([3, 4]),
       batch=st.integers(1, 3), seed=st.integers(0, 9))
def test_moe_mlp_equals_loop_reference(cf, top_k, experts, batch, seed):
    cfg = dataclasses.replace(CFG, capacity_factor=cf, top_k=top_k, experts=experts)
    p, x, cot = _case(cfg, batch, seed)
    want_y, want_aux, want_g, (dropped,) = _grads(lambda p, x: loop_reference(p, x, cfg), p, x, cot)
    got_y, got_aux, got_g, _ = _grads(lambda p, x: moe.moe_mlp(p, x, cfg), p, x, cot)
    torch.testing.assert_close(got_y, want_y, **TOL)
    for k in want_aux:
        torch.testing.assert_close(got_aux[k], want_aux[k], **TOL)
    for g, w in zip(got_g, want_g):
        torch.testing.assert_close(g, w, **TOL)
    assert cf is not None or dropped == 0  # dropless
    overflow = batch * (cfg.seq_len * top_k - experts * _spec_capacity(cfg, cfg.seq_len))  # more than the slots
    assert dropped >= overflow and (cf != 0.5 or overflow > 0)  # half the fair share: drops are certain


def _expert_parallel(cfg, p, x, cot, mesh, layout, w_spec):
    """moe_mlp under a layout: output, aux and grads as full tensors (every rank's copy), plus comms rows."""
    with use(mesh, layout):
        x_spec = shardings.logical_to_spec(moe.RESIDUAL, layout.activation_rules, mesh)
        x_d = shard(x, x_spec, mesh).requires_grad_()
        w_d = [shard(p[k], w_spec[k], mesh).requires_grad_() for k in WEIGHTS]
        with comms() as fwd:
            y, aux = moe.moe_mlp(dict(zip(WEIGHTS, w_d)), x_d, cfg)
        rows = shard(torch.arange(1, x.shape[0] + 1, dtype=torch.float32), shardings.spec_of(aux["z_loss"]), mesh)
        with comms() as bwd:
            grads = torch.autograd.grad(_objective(y, aux, shard(cot, shardings.spec_of(y), mesh), rows), [x_d, *w_d])
    full = lambda t: per_rank(t.full_tensor())
    return full(y), {k: full(v) for k, v in aux.items()}, [full(g) for g in grads], fwd, bwd


EP_SPECS = {"router": P(), "w_gate": P("ep"), "w_up": P("ep"), "w_down": P("ep")}


@pytest.mark.parametrize("cf", [1.0, None])
@pytest.mark.parametrize("ep", [1, 2, 4, 8])
def test_expert_parallel_equals_loop_reference(ep, cf):
    cfg = dataclasses.replace(CFG, capacity_factor=cf)
    p, x, cot = _case(cfg, 8, seed=ep)
    want_y, want_aux, want_g, (dropped,) = _grads(lambda p, x: loop_reference(p, x, cfg), p, x, cot)
    assert (dropped > 0) == (cf is not None)
    with shardings.simulate(ep):
        mesh = Mesh(ep=ep)
        assert mesh.device_mesh is not None  # built before counting
        y, aux, grads, fwd, bwd = _expert_parallel(cfg, p, x, cot, mesh, layouts.get("ep"), EP_SPECS)
    for got, want in [(y, want_y), *((aux[k], want_aux[k]) for k in want_aux), *zip(grads, want_g)]:
        for rank_value in got:
            torch.testing.assert_close(rank_value, want, **TOL)
    a2a = lambda c: [r for r in c.rows() if r["kind"] == "all_to_all"]
    assert fwd.rows() == a2a(fwd)  # the per-row aux losses need no collective (no psum of routing statistics)
    if ep == 1:
        assert a2a(fwd) == a2a(bwd) == []
        return
    # the (experts, rows · capacity, dim) buffer goes out and comes back; backward: the transposes
    buffer = cfg.experts * (8 // ep) * _spec_capacity(cfg, cfg.seq_len) * cfg.dim * 4
    sent = 2 * buffer * (ep - 1) // ep
    assert a2a(fwd) == a2a(bwd) == [{"kind": "all_to_all", "axis": "ep", "count": 2, "bytes": sent}]


def test_tp_inside_experts_with_ep():
    cfg = dataclasses.replace(CFG, capacity_factor=1.0)
    p, x, cot = _case(cfg, 4, seed=3)
    want_y, want_aux, want_g, _ = _grads(lambda p, x: loop_reference(p, x, cfg), p, x, cot)
    specs = {"router": P(), "w_gate": P("ep", None, "tp"), "w_up": P("ep", None, "tp"), "w_down": P("ep", "tp")}
    with shardings.simulate(4):
        y, aux, grads, fwd, _ = _expert_parallel(cfg, p, x, cot, Mesh(ep=2, tp=2), layouts.get("tp+ep"), specs)
    for got, want in [(y, want_y), *((aux[k], want_aux[k]) for k in want_aux), *zip(grads, want_g)]:
        for rank_value in got:
            torch.testing.assert_close(rank_value, want, **TOL)
    reduces = [{k: r[k] for k in ("kind", "axis", "count")} for r in fwd.rows() if r["kind"] != "all_to_all"]
    assert reduces == [{"kind": "all_reduce", "axis": "tp", "count": 1}]  # partial expert outputs; aux: none


def test_model_structure_and_loss():
    cfg = dataclasses.replace(CFG, layers=4)
    params, names = moe.init(core.random.key(0), cfg), moe.axes(cfg)
    assert core.tree.structure(params) == core.tree.structure(names, is_leaf=shardings.spec.rules.is_names)
    assert [("router" in b) for b in params["blocks"]] == [False, True, False, True]
    assert params["blocks"][0].keys() == gpt.init(core.random.key(0), cfg)["blocks"][0].keys()
    named = core.tree.leaves(names, is_leaf=shardings.spec.rules.is_names)
    for leaf, leaf_names in zip(core.tree.leaves(params), named):
        assert leaf.ndim == len(leaf_names)
    batch = moe.example_batch(cfg, 3, seed=1, with_ignored=True)  # counted labels per row: 4, 7, 6
    logits, aux = moe.apply_with_aux(params, batch["tokens"], cfg)
    assert sorted(aux) == ["load_balance", "z_loss"] and all(v.shape == (3,) and (v > 0).all() for v in aux.values())
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
    counted = (batch["labels"] != -100).sum(-1).float()  # each row weighs its counted labels
    assert len(set(counted.tolist())) > 1  # rows of unequal weight: a plain mean over rows would differ
    per_row = cfg.aux_loss_coef * aux["load_balance"] + cfg.z_loss_coef * aux["z_loss"]
    want = ce + (counted * per_row).sum() / counted.sum()
    torch.testing.assert_close(moe.loss(params, batch, cfg), want)
    remat = dataclasses.replace(cfg, remat=True)
    torch.testing.assert_close(moe.loss(params, batch, remat), want)
    ignored = {"tokens": batch["tokens"], "labels": torch.full_like(batch["labels"], -100)}
    assert moe.loss(params, ignored, cfg).item() == 0.0  # no counted label: 0, not NaN (as cross_entropy)


def test_config_and_sharding_errors():
    with pytest.raises(ValueError, match=r"top_k=5 must be in \[1, experts=4\].*Fix"):
        moe.Config(experts=4, top_k=5)
    with pytest.raises(ValueError, match="capacity_factor=0 must be > 0"):
        moe.Config(capacity_factor=0)
    with pytest.raises(ValueError, match="moe_every=0"):
        moe.Config(moe_every=0)
    assert moe.capacity(moe.Config(experts=4, top_k=2, capacity_factor=None), 8) == 8
    cfg = dataclasses.replace(CFG, experts=3)
    p, x, _ = _case(cfg, 4, seed=0)
    with shardings.simulate(2), use(Mesh(ep=2), layouts.get("ep")), pytest.raises(
        ShardingError, match=r"3 experts cannot be split evenly over \('ep',\).*Fix:"
    ):
        moe.moe_mlp(p, x, cfg)


def test_loss_of_a_batch_is_its_row_splits_weighted_by_token_share():
    """What makes every data layout and accumulation exact: split the rows anyhow, weigh by counted labels."""
    cfg = dataclasses.replace(CFG, moe_every=1)
    params = moe.init(core.random.key(0), cfg)
    batch = moe.example_batch(cfg, 6, seed=3, with_ignored=True)
    counted = (batch["labels"] != -100).sum(-1)
    assert len(set(counted.tolist())) > 2  # unequal rows: a plain mean over rows (or splits) would differ
    value_and_grad = core.value_and_grad(functools.partial(moe.loss, cfg=cfg))
    want_loss, want_grads = value_and_grad(params, batch)
    for split in ([0, 1, 2], [3], [4, 5]), ([5, 0], [2, 4, 1, 3]):
        loss, grads = 0.0, core.tree.map(torch.zeros_like, params)
        for rows in split:
            part_loss, part_grads = value_and_grad(params, {k: v[rows] for k, v in batch.items()})
            share = counted[rows].sum() / counted.sum()
            loss = loss + share * part_loss
            grads = core.tree.map(lambda g, p, share=share: g + share * p, grads, part_grads)
        torch.testing.assert_close(loss, want_loss, **TOL)
        for g, w in zip(core.tree.leaves(grads), core.tree.leaves(want_grads)):
            torch.testing.assert_close(g, w, **TOL)


# -- hand-computed semantics: tiny cases whose expected values are worked out in the comments -------------

L3, L7 = math.log(3.0), math.log(7.0)
LN2_SQ = math.log(2.0) ** 2
# router = identity on dim 2, so a token's router logits are the token itself
A, B, C = [L3, 0.0], [0.0, L3], [L7, 0.0]  # softmax (3/4, 1/4), (1/4, 3/4), (7/8, 1/8); logsumexp ln 4, ln 4, ln 8


def _hand_block(experts=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = lambda *shape: torch.randn(*shape, generator=gen)
    router = torch.eye(2, experts)  # logits (x0, x1, 0, ...)
    return {"router": router, "w_gate": w(experts, 2, 3), "w_up": w(experts, 2, 3), "w_down": w(experts, 3, 2)}


def _hand_cfg(**kw):
    kw = {"experts": 2} | kw
    return moe.Config(vocab=4, dim=2, heads=1, mlp=4, expert_mlp=3, seq_len=3, layers=1, moe_every=1, **kw)


def _expert(p, e, v):
    """Expert ``e``'s SwiGLU on one token ``v: (dim,)``."""
    return (F.silu(v @ p["w_gate"][e]) * (v @ p["w_up"][e])) @ p["w_down"][e]


def test_capacity_by_hand():
    cap = lambda cf, seq, experts=4, top_k=2: moe.capacity(moe.Config(experts=experts, top_k=top_k,
                                                                      capacity_factor=cf), seq)
    assert cap(1.25, 8) == 5  # ceil(1.25 · 8 · 2 / 4) = ceil(5.0)
    assert cap(1.0, 6, top_k=1) == 2  # ceil(1.0 · 6 · 1 / 4) = ceil(1.5)
    assert cap(0.1, 8) == 1  # ceil(0.4)
    assert cap(None, 8) == 8  # dropless: the whole row fits in one expert
    assert cap(10.0, 8) == 8  # ceil(40) capped at seq: an expert never gets more than every token


def test_aux_losses_per_row_by_hand():
    cfg = _hand_cfg(top_k=1, capacity_factor=None)
    x = torch.tensor([[A, A, B], [C, C, C]])
    _, aux = moe.moe_mlp(_hand_block(), x, cfg)
    # row 0: top-1 choices e0, e0, e1 -> f = (2/3, 1/3); P = mean of (3/4,1/4), (3/4,1/4), (1/4,3/4) = (7/12, 5/12)
    #        LB = 2 · (2/3 · 7/12 + 1/3 · 5/12) = 2 · 19/36 = 19/18; z = (ln 4)² = 4 ln²2
    # row 1: choices e0, e0, e0 -> f = (1, 0); P = (7/8, 1/8); LB = 2 · 7/8 = 7/4; z = (ln 8)² = 9 ln²2
    torch.testing.assert_close(aux["load_balance"], torch.tensor([19 / 18, 7 / 4]))
    torch.testing.assert_close(aux["z_loss"], torch.tensor([4 * LN2_SQ, 9 * LN2_SQ]))
    # each row on its own gives its own value: no statistic crosses rows
    for r in range(2):
        _, alone = moe.moe_mlp(_hand_block(), x[r:r + 1], cfg)
        torch.testing.assert_close(alone["load_balance"], aux["load_balance"][r:r + 1])


def test_top_k_routing_and_renormalized_weights_by_hand():
    cfg = _hand_cfg(experts=3, top_k=2, capacity_factor=None)
    p = _hand_block(experts=3)
    x = torch.tensor([[[math.log(4.0), math.log(2.0)], [-math.log(2.0), L3]]])
    y, aux = moe.moe_mlp(p, x, cfg)
    # t0: logits (ln 4, ln 2, 0) -> probs (4, 2, 1)/7 -> e0, e1, weights renormalized (4, 2)/6 = (2/3, 1/3)
    # t1: logits (-ln 2, ln 3, 0) -> probs (1/2, 3, 1)/4.5 = (1, 6, 2)/9 -> e1, e2, weights (6, 2)/8 = (3/4, 1/4)
    want = torch.stack([2 / 3 * _expert(p, 0, x[0, 0]) + 1 / 3 * _expert(p, 1, x[0, 0]),
                        3 / 4 * _expert(p, 1, x[0, 1]) + 1 / 4 * _expert(p, 2, x[0, 1])])[None]
    torch.testing.assert_close(y, want)
    # f = assignments (1, 2, 1)/4; P = ((4/7 + 1/9)/2, (2/7 + 6/9)/2, (1/7 + 2/9)/2) = (43, 60, 23)/126
    # LB = 3 · (43/4 + 60/2 + 23/4)/126 = 3 · 46.5/126 = 31/28; z = ((ln 7)² + (ln 4.5)²)/2
    torch.testing.assert_close(aux["load_balance"], torch.tensor([31 / 28]))
    torch.testing.assert_close(aux["z_loss"], torch.tensor([(L7 ** 2 + math.log(4.5) ** 2) / 2]))


def test_drops_earlier_tokens_first_by_hand():
    cfg = _hand_cfg(top_k=1, capacity_factor=0.5)  # capacity ceil(0.5 · 3 · 1 / 2) = 1 slot per expert per row
    p = _hand_block()
    x = torch.tensor([[A, A, B], [C, C, C]])
    y, _ = moe.moe_mlp(p, x, cfg)
    # row 0: e0 takes token 0, token 1 (also e0) is dropped, token 2 goes to e1. Row 1: only token 0 fits.
    # top-1: the renormalized weight is 1
    want = torch.stack([
        torch.stack([_expert(p, 0, x[0, 0]), torch.zeros(2), _expert(p, 1, x[0, 2])]),
        torch.stack([_expert(p, 0, x[1, 0]), torch.zeros(2), torch.zeros(2)]),
    ])
    torch.testing.assert_close(y, want)


def test_first_choices_before_second_choices_by_hand():
    cfg = _hand_cfg(top_k=2, capacity_factor=0.5)  # capacity ceil(0.5 · 3 · 2 / 2) = 2 slots per expert
    p = _hand_block()
    x = torch.tensor([[A, A, B]])
    y, _ = moe.moe_mlp(p, x, cfg)
    # first choices: t0 -> e0, t1 -> e0, t2 -> e1; second choices: t0 -> e1, t1 -> e1, t2 -> e0
    # e0's queue: t0, t1 (first), t2 (second: 3rd in line, dropped); e1's: t2 (first), t0, t1 (t1 dropped).
    # (token order instead would drop t2's first choice.) Weights: the softmax itself (both experts chosen).
    want = torch.stack([
        0.75 * _expert(p, 0, x[0, 0]) + 0.25 * _expert(p, 1, x[0, 0]),
        0.75 * _expert(p, 0, x[0, 1]),  # its second choice (e1, weight 1/4) was dropped: not renormalized
        0.75 * _expert(p, 1, x[0, 2]),
    ])[None]
    torch.testing.assert_close(y, want)


def test_loss_weighs_rows_by_counted_labels_by_hand(monkeypatch):
    cfg = _hand_cfg(top_k=1, capacity_factor=None, aux_loss_coef=0.5, z_loss_coef=0.25)
    x = torch.tensor([[A, A, B], [C, C, C]])
    _, aux = moe.moe_mlp(_hand_block(), x, cfg)
    monkeypatch.setattr(moe, "apply_with_aux", lambda params, tokens, cfg: (torch.zeros(2, 3, 4), aux))
    labels = torch.tensor([[1, 2, 3], [-100, -100, 0]])  # 3 counted labels in row 0, 1 in row 1
    got = moe.loss({}, {"tokens": torch.zeros(2, 3, dtype=torch.int64), "labels": labels}, cfg)
    # cross-entropy of zero logits over 4 classes: ln 4. Aux: (3 · aux_0 + 1 · aux_1) / 4 with
    #   aux_0 = 0.5 · 19/18 + 0.25 · 4 ln²2 = 19/36 + ln²2,  aux_1 = 0.5 · 7/4 + 0.25 · 9 ln²2 = 7/8 + 9/4 ln²2
    #   -> (19/12 + 7/8) / 4 + (3 + 9/4) ln²2 / 4 = 59/96 + 21/16 ln²2
    torch.testing.assert_close(got, torch.tensor(math.log(4) + 59 / 96 + 21 / 16 * LN2_SQ))
    none = moe.loss({}, {"tokens": torch.zeros(2, 3, dtype=torch.int64), "labels": torch.full((2, 3), -100)}, cfg)
    assert none.item() == 0.0  # nothing counted: 0, not NaN (cross_entropy's guard)
