"""Layouts with context (cp) and expert (ep) parallelism train like one device: loss, grads and params after
3 AdamW steps (simulated ranks), and 2 steps on 4 real gloo processes. The fixed ep compositions of the MoE
model run in tests/models/test_moe_layouts.py (this file stays under ~90 s); random meshes here draw them too."""

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate

import core
import shardings
from models import gpt, moe
from shardings import Mesh, comms, gather, launch
from shardings.spec import layouts
from shardings.testing import assert_close, check_equivalence

GPT = gpt.Config(vocab=32, dim=16, layers=1, heads=4, kv_heads=2, mlp=16, seq_len=8)
MOE = moe.Config(vocab=32, dim=8, layers=1, heads=2, mlp=8, seq_len=4, experts=4, top_k=2, moe_every=1,
                 capacity_factor=1.0)
MODELS = {"gpt": (gpt, GPT), "moe": (moe, MOE)}


def _check(model_name: str, layout: str, mesh: Mesh, steps: int = 3, batch_size: int = 4) -> None:
    model, cfg = MODELS[model_name]
    report = check_equivalence(model.init, model.loss, model.axes, cfg, model.example_batch(cfg, batch_size),
                               layouts=[layout], mesh=mesh, steps=steps)
    assert report.ok and len(report.rows) == 3 * steps  # loss, grads, params per step


@pytest.mark.parametrize(("layout", "mesh"), [
    ("dp+cp", Mesh(dp=2, cp=2)),
    ("zero3+cp", Mesh(dp=2, cp=2)),
    ("dp+cp_allgather", Mesh(dp=2, cp=2)),
    ("tp+sp+cp", Mesh(tp=2, cp=2)),
    # 8 ranks: shardings.einsum multiplies local blocks (DTensor's einsum flattened (batch, seq) on (dp, cp) to a
    # _StridedShard and spent minutes planning redistributions on the 3-D mesh)
    ("zero3+tp+sp+cp", Mesh(dp=2, cp=2, tp=2)),
])
def test_gpt_with_context_parallelism(layout, mesh):
    _check("gpt", layout, mesh, batch_size=2)


@settings(max_examples=2)
@given(data=st.data())
def test_random_meshes_and_layouts(data):
    """Random (model, mesh with a cp or ep axis, composition) triples, as in the layouts property test."""
    model_name = data.draw(st.sampled_from(["gpt", "moe"]))
    extra = "cp" if model_name == "gpt" else "ep"
    sizes = {extra: data.draw(st.sampled_from([2, 4]))}
    if sizes[extra] == 2:
        sizes[data.draw(st.sampled_from(["dp", "fsdp", "tp"]))] = 2
    data_preset = data.draw(st.sampled_from(["dp", "zero1", "zero3"] if set(sizes) & {"dp", "fsdp"} else [None]))
    variant = data.draw(st.sampled_from(["cp", "cp_allgather"])) if extra == "cp" else "ep"
    parts = [p for p in (data_preset, "tp" if "tp" in sizes else None, variant) if p]
    _check(model_name, "+".join(parts), Mesh(sizes), steps=3, batch_size=4)


def test_compositions_are_validated_against_the_mesh():
    with pytest.raises(shardings.ShardingError, match=r"needs a mesh axis ep.*Fix:"):
        layouts.validate(layouts.get("dp+ep"), Mesh(dp=4))
    with pytest.raises(shardings.ShardingError, match=r"layout 'ep\+ep'.*two ep strategies"):
        layouts.get("ep+ep")
    zero3_tp_sp_cp = layouts.get("zero3+tp+sp+cp")
    layouts.validate(zero3_tp_sp_cp, Mesh(dp=2, tp=2, cp=2))
    rules, mesh = zero3_tp_sp_cp.activation_rules, Mesh(dp=2, tp=2, cp=2)
    # inside attention: seq on cp, heads on tp; the residual's seq on cp and tp (sp with cp); block inputs on cp
    assert shardings.logical_to_spec(("batch", "seq", "heads", "head_dim"), rules, mesh) == shardings.P(
        "dp", "cp", "tp", None)
    assert shardings.logical_to_spec(("batch", "seq", "embed"), rules, mesh) == shardings.P("dp", ("cp", "tp"), None)
    assert shardings.logical_to_spec(("batch", "block_seq", "embed"), rules, mesh) == shardings.P("dp", "cp", None)
    # ep ranks before tp: experts on ep (not tp's "expert -> None"), tokens split over the data axes and ep
    ep_rules = layouts.get("tp+ep").activation_rules
    assert shardings.logical_to_spec(("expert", "embed", "mlp"), ep_rules, Mesh(tp=2, ep=2)) == shardings.P(
        "ep", None, "tp")
    assert shardings.logical_to_spec(("batch",), layouts.get("dp+ep").batch + ep_rules,
                                     Mesh(dp=2, ep=2)) == shardings.P(("dp", "ep"))


# -- real processes -------------------------------------------------------------------------------------


REAL_CASES = [("gpt", "dp+cp", {"dp": 2, "cp": 2}), ("moe", "dp+ep", {"dp": 2, "ep": 2})]


def _train_on_ranks(steps: int) -> list:
    """Every case of REAL_CASES on this rank (one launch: process start-up is paid once)."""
    torch.set_num_threads(1)
    out = []
    for model_name, layout, sizes in REAL_CASES:
        model, cfg = MODELS[model_name]
        mesh = Mesh(sizes)
        params = shardings.init(model.init, core.random.key(0), cfg, axes=model.axes(cfg), layout=layout, mesh=mesh)
        step = shardings.train_step(functools.partial(model.loss, cfg=cfg), core.optim.adamw(1e-3), layout=layout,
                                    mesh=mesh, axes=model.axes(cfg))
        state, losses = step.init(params), []
        for _ in range(steps):
            params, state, metrics = step(params, state, model.example_batch(cfg, 4))
            losses.append(metrics["loss"])
        out.append((losses, gather(params)))
    return out


def _reference(model_name: str, steps: int):
    model, cfg = MODELS[model_name]
    params, opt = model.init(core.random.key(0), cfg), core.optim.adamw(1e-3)
    state, losses = opt.init(params), []
    for _ in range(steps):
        loss, grads = core.value_and_grad(functools.partial(model.loss, cfg=cfg))(params, model.example_batch(cfg, 4))
        updates, state = opt.update(grads, state, params)
        params = core.optim.apply_updates(params, updates)
        losses.append(float(loss))
    return losses, params


@pytest.mark.multiprocess
def test_real_processes_dp_cp_and_dp_ep():
    results = launch(_train_on_ranks, 4, 2, backend="gloo")  # per rank: one (losses, params) per case
    for i, (model_name, layout, _) in enumerate(REAL_CASES):
        want_losses, want_params = _reference(model_name, steps=2)
        for rank, per_case in enumerate(results):
            losses, params = per_case[i]
            assert_close(torch.tensor(losses), torch.tensor(want_losses), msg=f"{layout}, rank {rank}, losses")
            assert_close(params, want_params, msg=f"{layout}, rank {rank}, params")


def test_step_reduces_cp_replicated_grads_over_cp_and_rings_kv():
    batch = gpt.example_batch(GPT, 2)
    with shardings.simulate(2):
        mesh = Mesh(cp=2)
        params = shardings.init(gpt.init, core.random.key(0), GPT, axes=gpt.axes(GPT), layout="cp", mesh=mesh)
        step = shardings.train_step(functools.partial(gpt.loss, cfg=GPT), core.optim.sgd(0.1), layout="cp", mesh=mesh)
        with comms() as c:
            _, grads, _ = step.grads(params, batch)
    # every grad ends reduced over cp (replicated); DTensor reduces some as Partial grads (all-reduce) and, at
    # these tiny sizes, gets others by all-gathering the seq-sharded activations first: its cost model picks
    assert all(g.placements == (Replicate(),) for g in core.tree.leaves(grads))
    rows = {(r["kind"], r["axis"]): r for r in c.rows()}
    assert rows["all_reduce", "cp"]["count"] > 0 and {a for _, a in rows} == {"cp"}
    kv = 2 * 2 * (GPT.seq_len // 2) * GPT.n_kv_heads * GPT.d_head * 4  # one rank's K+V block (batch 2), fp32
    # and the zigzag relayout's: q, k, v in as one and the output back (their transposes in backward), half blocks
    zigzag = 2 * (GPT.seq_len // 4) * (2 * GPT.heads + 2 * GPT.n_kv_heads) * GPT.d_head * 4
    assert rows["ppermute", "cp"] == {"kind": "ppermute", "axis": "cp", "count": 1 + 2 + 4,
                                      "bytes": (1 + 3) * kv + 2 * zigzag}
