"""experiments.bench.native_gpt: the torch-native model computes gpt.loss and its gradients, round-trips the tree."""

import dataclasses
import inspect

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import core
import models.gpt as gpt
from core import tree
from experiments.bench import native_gpt
from models import layers
from shardings.testing import assert_close

GQA = gpt.Config(vocab=96, dim=64, layers=2, heads=4, kv_heads=2, mlp=96, seq_len=12)
MHA = dataclasses.replace(GQA, kv_heads=None)
MQA = dataclasses.replace(GQA, kv_heads=1, head_dim=8)


def _assert_trees_close(got, want):
    assert_close(got, want)  # structure, shapes and every leaf by the project's rule


@pytest.mark.parametrize("cfg", [GQA, MHA, MQA], ids=["gqa", "mha", "mqa_head_dim"])
def test_loss_and_grads_equal_gpt(cfg):
    params = gpt.init(core.random.key(1), cfg)
    batch = gpt.example_batch(cfg, 3, seed=2, with_ignored=True)
    model = native_gpt.from_params(params, cfg)
    loss = model(batch)
    loss.backward()
    want_loss, want_grads = core.value_and_grad(gpt.loss)(params, batch, cfg)
    assert_close(loss, want_loss)
    _assert_trees_close(native_gpt.to_params(model, grads=True), want_grads)


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**16), layers=st.integers(1, 3), kv_heads=st.sampled_from([1, 2, 4]))
def test_to_params_inverts_from_params(seed, layers, kv_heads):
    cfg = dataclasses.replace(GQA, layers=layers, kv_heads=kv_heads)
    params = gpt.init(core.random.key(seed), cfg)
    back = native_gpt.to_params(native_gpt.from_params(params, cfg))
    assert tree.flatten(back)[1] == tree.flatten(params)[1]
    assert all(torch.equal(a, b) for a, b in zip(tree.leaves(back), tree.leaves(params)))


def test_module_layout_is_nn_linear_out_in():
    model = native_gpt.from_params(gpt.init(core.random.key(0), GQA), GQA)
    attn = model.blocks[0].attn
    assert attn.wq.weight.shape == (GQA.heads * GQA.d_head, GQA.dim)
    assert attn.wk.weight.shape == (GQA.n_kv_heads * GQA.d_head, GQA.dim)
    assert attn.wo.weight.shape == (GQA.dim, GQA.heads * GQA.d_head)
    assert model.blocks[0].mlp.down.weight.shape == (GQA.dim, GQA.mlp)
    assert model.unembed.weight.shape == (GQA.vocab, GQA.dim)


def test_the_native_side_runs_torchs_modules_and_sdpa_not_shardlabs_layers(monkeypatch):
    """The anchor must be what a PyTorch user writes: the module types, and one SDPA and RMSNorm call per use."""
    model = native_gpt.from_params(gpt.init(core.random.key(0), GQA), GQA)
    norms = [m for m in model.modules() if isinstance(m, nn.RMSNorm)]
    assert len(norms) == 2 * GQA.layers + 1 and all(n.eps == GQA.norm_eps for n in norms)
    assert isinstance(model.embed, nn.Embedding) and isinstance(model.unembed, nn.Linear)
    assert not [name for name, obj in vars(native_gpt).items() if inspect.getmodule(obj) is layers]
    calls = {"sdpa": [], "rms_norm": 0, "cross_entropy": 0}
    sdpa, rms_norm, cross_entropy = F.scaled_dot_product_attention, F.rms_norm, F.cross_entropy

    def counting_sdpa(q, k, v, **kw):
        calls["sdpa"].append((q.shape, k.shape, kw))
        return sdpa(q, k, v, **kw)

    def counting(name, fn):
        def wrapper(*args, **kw):
            calls[name] += 1
            return fn(*args, **kw)

        return wrapper

    monkeypatch.setattr(F, "scaled_dot_product_attention", counting_sdpa)
    monkeypatch.setattr(F, "rms_norm", counting("rms_norm", rms_norm))
    monkeypatch.setattr(F, "cross_entropy", counting("cross_entropy", cross_entropy))
    model(gpt.example_batch(GQA, 2))
    assert calls["rms_norm"] == 2 * GQA.layers + 1 and calls["cross_entropy"] == 1
    q_shape, k_shape = (2, GQA.heads, GQA.seq_len, GQA.d_head), (2, GQA.n_kv_heads, GQA.seq_len, GQA.d_head)
    assert calls["sdpa"] == [(q_shape, k_shape, {"is_causal": True, "enable_gqa": True})] * GQA.layers


def test_rope_tables_are_models_layers_rope():
    """Same theta, same float32 formula and rotate_half: the native RoPE equals shardlab's bitwise on plain tensors."""
    x = torch.randn(2, 12, 4, 16)  # (batch, seq, heads, head_dim)
    cos, sin = native_gpt.rope_tables(12, 16, GQA.rope_theta, x.device)
    native = native_gpt.apply_rope(x.transpose(1, 2), cos, sin).transpose(1, 2)
    assert torch.equal(native, layers.rope(x, GQA.rope_theta))


def _tp_loss_and_grads(cfg):
    """On each gloo rank: the tp-parallelized model's loss and full gradients (a gpt tree)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    torch.set_num_threads(1)
    model = native_gpt.from_params(gpt.init(core.random.key(1), cfg), cfg)
    model = native_gpt.parallelize(model, init_device_mesh("cpu", (torch.distributed.get_world_size(),)))
    with loss_parallel():
        loss = model(gpt.example_batch(cfg, 3, seed=2, with_ignored=True))
        loss.backward()
    plain = native_gpt.NativeGpt(cfg)
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        q.grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
    loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
    return loss.detach(), native_gpt.to_params(plain, grads=True)


@pytest.mark.multiprocess
def test_under_tp_each_rank_runs_sdpa_on_its_local_gqa_heads():
    """tp=2 of a 4-query/2-kv-head model: one kv head and its two query heads per rank; loss and grads as gpt's."""
    import shardings

    params, batch = gpt.init(core.random.key(1), GQA), gpt.example_batch(GQA, 3, seed=2, with_ignored=True)
    want_loss, want_grads = core.value_and_grad(gpt.loss)(params, batch, GQA)
    for loss, grads in shardings.launch(_tp_loss_and_grads, 2, GQA, backend="gloo"):
        assert_close(loss, want_loss)
        _assert_trees_close(grads, want_grads)


def test_tp_plan_is_torchtitans():
    plan = native_gpt.tp_plan(native_gpt.NativeGpt(GQA))
    kinds = {k: type(v).__name__ for k, v in plan.items()}
    for b in range(GQA.layers):
        for m in ("attn.wq", "attn.wk", "attn.wv", "mlp.gate", "mlp.up"):
            assert kinds[f"blocks.{b}.{m}"] == "ColwiseParallel"
        assert kinds[f"blocks.{b}.attn.wo"] == kinds[f"blocks.{b}.mlp.down"] == "RowwiseParallel"
        assert kinds[f"blocks.{b}.attn_norm"] == kinds[f"blocks.{b}.mlp_norm"] == "SequenceParallel"
    assert (kinds["embed"], kinds["final_norm"], kinds["unembed"]) == (
        "RowwiseParallel",
        "SequenceParallel",
        "ColwiseParallel",
    )


def test_tied_embeddings_are_refused_with_a_fix():
    with pytest.raises(ValueError, match=r"tie_embeddings.*Fix:"):
        native_gpt.NativeGpt(dataclasses.replace(GQA, tie_embeddings=True))
