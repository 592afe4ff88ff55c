"""experiments.native_gpt: the nn.Module mirror computes gpt.loss and its gradients, and round-trips the tree."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import core
import models.gpt as gpt
from core import tree
from experiments import native_gpt
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
