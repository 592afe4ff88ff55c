"""models.moe: the MoE MLP equals a loop over tokens and experts (values, grads, aux losses, capacity drops),
locally and under expert parallelism (ep = 1, 2, 4, 8; tp+ep), with 2 all-to-alls each way."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import core
import shardings
from models import gpt, moe
from shardings import Mesh, P, ShardingError, comms, layouts, per_rank, shard, use
from shardings.testing.equivalence import check_equivalence

TOL = dict(rtol=1e-5, atol=1e-6)
WEIGHTS = ("router", "w_gate", "w_up", "w_down")
CFG = moe.Config(vocab=32, dim=8, mlp=8, layers=2, heads=2, seq_len=8, experts=8, top_k=2, moe_every=2)


def loop_reference(p, x, cfg):
    """Token by token: top-k routing, per-row expert queues (first choices first), capacity drops, aux losses."""
    batch, seq, dim = x.shape
    cap = moe.capacity(cfg, seq)
    logits = x.float() @ p["router"]  # (batch, seq, experts)
    probs = logits.softmax(-1)
    counts, dropped, rows = [0] * cfg.experts, 0, []
    for b in range(batch):
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
    tokens = batch * seq
    f = torch.tensor(counts, dtype=torch.float32) / (tokens * cfg.top_k)
    aux = {"load_balance": cfg.experts * (f * probs.mean((0, 1))).sum(),
           "z_loss": torch.logsumexp(logits, -1).pow(2).mean()}
    return torch.stack(rows), aux, dropped


def _case(cfg, batch, seed):
    params = moe.init(core.random.key(seed), cfg)["blocks"][cfg.moe_every - 1]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, cfg.seq_len, cfg.dim, generator=gen)
    cot = torch.randn(batch, cfg.seq_len, cfg.dim, generator=gen)
    return {k: params[k] for k in WEIGHTS}, x, cot


def _objective(y, aux, cot):
    return (y * cot).sum() + 3.0 * aux["load_balance"] + 5.0 * aux["z_loss"]


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
    overflow = batch * (cfg.seq_len * top_k - experts * moe.capacity(cfg, cfg.seq_len))  # more than the slots
    assert dropped >= overflow and (cf != 0.5 or overflow > 0)  # half the fair share: drops are certain


def _expert_parallel(cfg, p, x, cot, mesh, layout, w_spec):
    """moe_mlp under a layout: output, aux and grads as full tensors (every rank's copy), plus comms rows."""
    with use(mesh, layout):
        x_spec = shardings.logical_to_spec(moe.RESIDUAL, layout.activation_rules, mesh)
        x_d = shard(x, x_spec, mesh).requires_grad_()
        w_d = [shard(p[k], w_spec[k], mesh).requires_grad_() for k in WEIGHTS]
        with comms() as fwd:
            y, aux = moe.moe_mlp(dict(zip(WEIGHTS, w_d)), x_d, cfg)
        with comms() as bwd:
            grads = torch.autograd.grad(_objective(y, aux, shard(cot, shardings.spec_of(y), mesh)), [x_d, *w_d])
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
    if ep == 1:
        assert a2a(fwd) == a2a(bwd) == []
        return
    # the (experts, rows · capacity, dim) buffer goes out and comes back; backward: the transposes
    buffer = cfg.experts * (8 // ep) * moe.capacity(cfg, cfg.seq_len) * cfg.dim * 4
    sent = 2 * buffer * (ep - 1) // ep
    assert a2a(fwd) == a2a(bwd) == [{"kind": "all_to_all", "axis": "ep", "count": 2, "bytes": sent}]


def test_tp_inside_experts_with_ep():
    cfg = dataclasses.replace(CFG, capacity_factor=1.0)
    p, x, cot = _case(cfg, 4, seed=3)
    want_y, want_aux, want_g, _ = _grads(lambda p, x: loop_reference(p, x, cfg), p, x, cot)
    specs = {"router": P(), "w_gate": P("ep", None, "tp"), "w_up": P("ep", None, "tp"), "w_down": P("ep", "tp")}
    with shardings.simulate(4):
        y, aux, grads, fwd, _ = _expert_parallel(cfg, p, x, cot, Mesh(ep=2, tp=2), layouts.get("tp+ep"), specs)
    for got, want in [(y, want_y), (aux["z_loss"], want_aux["z_loss"]), *zip(grads, want_g)]:
        for rank_value in got:
            torch.testing.assert_close(rank_value, want, **TOL)
    assert {"kind": "all_reduce", "axis": "tp", "count": 1} in [
        {k: r[k] for k in ("kind", "axis", "count")} for r in fwd.rows()]  # partial expert outputs psummed


def test_model_structure_and_loss():
    cfg = dataclasses.replace(CFG, layers=4)
    params, names = moe.init(core.random.key(0), cfg), moe.axes(cfg)
    assert core.tree.structure(params) == core.tree.structure(names, is_leaf=shardings.rules.is_names)
    assert [("router" in b) for b in params["blocks"]] == [False, True, False, True]
    assert params["blocks"][0].keys() == gpt.init(core.random.key(0), cfg)["blocks"][0].keys()
    for leaf, leaf_names in zip(core.tree.leaves(params), core.tree.leaves(names, is_leaf=shardings.rules.is_names)):
        assert leaf.ndim == len(leaf_names)
    batch = moe.example_batch(cfg, 2)
    logits, aux = moe.apply_with_aux(params, batch["tokens"], cfg)
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
    want = ce + cfg.aux_loss_coef * aux["load_balance"] + cfg.z_loss_coef * aux["z_loss"]
    torch.testing.assert_close(moe.loss(params, batch, cfg), want)
    remat = dataclasses.replace(cfg, remat=True)
    torch.testing.assert_close(moe.loss(params, batch, remat), want)
    assert sorted(aux) == ["load_balance", "z_loss"] and min(float(v) for v in aux.values()) > 0


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


@pytest.mark.parametrize(("layout", "mesh"), [
    ("dp+ep", Mesh(dp=2, ep=2)),
    ("zero3+ep", Mesh(dp=2, ep=2)),
    ("tp+ep", Mesh(tp=2, ep=2)),  # the experts' hidden dim on tp
])
def test_expert_parallel_layouts_train_like_one_device(layout, mesh):
    """3 AdamW steps of the whole model: loss, grads and params on every rank vs the single-device run."""
    cfg = moe.Config(vocab=32, dim=8, layers=1, heads=2, mlp=8, seq_len=4, experts=4, top_k=2, moe_every=1,
                     capacity_factor=1.0)
    report = check_equivalence(moe.init, moe.loss, moe.axes, cfg, moe.example_batch(cfg, 4), layouts=[layout],
                               mesh=mesh, steps=3)
    assert report.ok and len(report.rows) == 9
