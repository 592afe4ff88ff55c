"""models.gpt: parameter/axes contract, causality, GQA, remat, tying, loss masking, training, configs."""

import dataclasses
import math

import einops
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import core
import core.deferred
import models
import shardings
from core import tree
from models import gpt
from models.layers import cross_entropy
from shardings.testing import assert_close
from tests.models.helpers import assert_init_is_block_evaluable, assert_tensor_parallel_matches

LOGICAL = {"batch", "seq", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab", "expert", "layers"}
SMALL = gpt.Config(vocab=32, dim=32, layers=2, heads=4, kv_heads=2, mlp=48, seq_len=8)


@st.composite
def configs(draw: st.DrawFn) -> gpt.Config:
    heads = draw(st.sampled_from([1, 2, 4]))
    head_dim = draw(st.sampled_from([2, 4, 8]))
    return gpt.Config(
        vocab=draw(st.integers(4, 48)),
        dim=draw(st.sampled_from([heads * head_dim, 12])),
        layers=draw(st.integers(1, 2)),
        heads=heads,
        kv_heads=draw(st.sampled_from([d for d in (1, 2, 4) if heads % d == 0])),
        head_dim=head_dim,
        mlp=draw(st.integers(1, 24)),
        seq_len=draw(st.integers(2, 8)),
        tie_embeddings=draw(st.booleans()),
    )


def _is_names(x: object) -> bool:
    return isinstance(x, tuple) and all(isinstance(n, str) for n in x)


def _sgd(params: dict, grads: dict, lr: float) -> dict:
    return tree.map(lambda p, g: p - lr * g, params, grads)


@settings(max_examples=15)
@given(cfg=configs())
def test_axes_match_params(cfg: gpt.Config) -> None:
    params = gpt.init(core.random.key(0), cfg)
    names = gpt.axes(cfg)
    assert tree.structure(names, is_leaf=_is_names) == tree.structure(params)
    for p, n in zip(tree.leaves(params), tree.leaves(names, is_leaf=_is_names)):
        assert len(n) == p.ndim and set(n) <= LOGICAL
        assert p.dtype == torch.float32
    assert ("unembed" in params) is not cfg.tie_embeddings


@settings(max_examples=10)
@given(cfg=configs(), data=st.data())
def test_causal_logits_ignore_future_tokens(cfg: gpt.Config, data: st.DataObject) -> None:
    params = gpt.init(core.random.key(1), cfg)
    tokens = gpt.example_batch(cfg, 2, seed=data.draw(st.integers(0, 99)))["tokens"]
    t = data.draw(st.integers(0, cfg.seq_len - 1))
    changed = tokens.clone()
    changed[:, t] = (tokens[:, t] + 1) % cfg.vocab
    before, after = gpt.apply(params, tokens, cfg), gpt.apply(params, changed, cfg)
    assert_close(after[:, :t], before[:, :t])
    assert not torch.allclose(after[:, t:], before[:, t:])  # the changed token and later ones do see it


@pytest.mark.parametrize("kv_heads", [1, 2])  # MQA, GQA
def test_grouped_kv_equals_mha_with_repeated_heads(kv_heads: int) -> None:
    cfg = dataclasses.replace(SMALL, kv_heads=kv_heads)
    params = gpt.init(core.random.key(2), cfg)
    mha_cfg = dataclasses.replace(cfg, kv_heads=None)
    groups = cfg.heads // kv_heads
    repeat = lambda w: einops.repeat(w, "e k d -> e (k g) d", g=groups)  # query head h reads kv head h // groups
    mha = {**params, "blocks": [{**b, "wk": repeat(b["wk"]), "wv": repeat(b["wv"])} for b in params["blocks"]]}
    tokens = gpt.example_batch(cfg, 2)["tokens"]
    assert_close(gpt.apply(mha, tokens, mha_cfg), gpt.apply(params, tokens, cfg))


@pytest.mark.parametrize("tie", [False, True])
def test_remat_gives_identical_loss_and_grads(tie: bool) -> None:
    cfg = dataclasses.replace(SMALL, tie_embeddings=tie)
    params, batch = gpt.init(core.random.key(3), cfg), gpt.example_batch(cfg, 2, with_ignored=True)
    plain = core.value_and_grad(gpt.loss)(params, batch, cfg)
    remat = core.value_and_grad(gpt.loss)(params, batch, dataclasses.replace(cfg, remat=True))
    for a, b in zip(tree.leaves(plain), tree.leaves(remat)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # recomputation replays the same float ops


def test_tied_embedding_is_also_the_unembedding() -> None:
    cfg = dataclasses.replace(SMALL, tie_embeddings=True)
    params = gpt.init(core.random.key(4), cfg)
    batch = {k: v % (cfg.vocab // 2) for k, v in gpt.example_batch(cfg, 2).items()}  # only the low half is used
    grads = core.grad(gpt.loss)(params, batch, cfg)
    # Rows never looked up still get gradient: through the unembedding, which is the same tensor.
    assert grads["embed"][cfg.vocab // 2 :].abs().sum() > 0
    tied_logits = gpt.apply(params, batch["tokens"], cfg)
    untied = {**params, "unembed": params["embed"].T.clone()}
    assert_close(gpt.apply(untied, batch["tokens"], dataclasses.replace(cfg, tie_embeddings=False)), tied_logits)


@settings(max_examples=10)
@given(cfg=configs(), seed=st.integers(0, 99))
def test_loss_is_mean_cross_entropy_over_kept_labels(cfg: gpt.Config, seed: int) -> None:
    params = gpt.init(core.random.key(seed), cfg)
    batch = gpt.example_batch(cfg, 3, seed=seed, with_ignored=True)
    logits = gpt.apply(params, batch["tokens"], cfg)
    expected = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=cfg.ignore_index)
    assert_close(gpt.loss(params, batch, cfg), expected)


def test_ignored_labels_do_not_affect_the_loss() -> None:
    params, batch = gpt.init(core.random.key(5), SMALL), gpt.example_batch(SMALL, 2, with_ignored=True)
    ignored = batch["labels"] == SMALL.ignore_index
    assert ignored.any() and not ignored.all()
    # The logits at ignored positions get no gradient, whatever they are.
    logits = gpt.apply(params, batch["tokens"], SMALL).detach().requires_grad_(True)
    (g,) = torch.autograd.grad(cross_entropy(logits, batch["labels"], SMALL.ignore_index), logits)
    assert g[ignored].abs().max() == 0 and g[~ignored].abs().max() > 0
    all_ignored = {**batch, "labels": torch.full_like(batch["labels"], SMALL.ignore_index)}
    assert gpt.loss(params, all_ignored, SMALL) == 0  # 0, not NaN, when nothing counts


@pytest.mark.parametrize("tie", [False, True])
def test_initial_loss_is_log_vocab_and_sgd_lowers_it(tie: bool) -> None:
    cfg = dataclasses.replace(SMALL, vocab=128, tie_embeddings=tie)
    params, batch = gpt.init(core.random.key(6), cfg), gpt.example_batch(cfg, 4)
    losses = []
    for _ in range(3):
        value, grads = core.value_and_grad(gpt.loss)(params, batch, cfg)
        losses.append(value.item())
        params = _sgd(params, grads, lr=1.0)
    assert math.isfinite(losses[0]) and abs(losses[0] - math.log(cfg.vocab)) < 0.05
    assert losses[2] < losses[1] < losses[0]


@settings(max_examples=10)
@given(cfg=configs(), data=st.data())
def test_init_is_block_evaluable(cfg: gpt.Config, data: st.DataObject) -> None:
    assert_init_is_block_evaluable(gpt, cfg, data)


def test_init_is_deterministic_per_key() -> None:
    same = [gpt.init(core.random.key(7), SMALL) for _ in range(2)]
    other = gpt.init(core.random.key(8), SMALL)
    assert all(torch.equal(a, b) for a, b in zip(*map(tree.leaves, same)))
    random_leaves = [(a, b) for a, b in zip(tree.leaves(same[0]), tree.leaves(other)) if a.ndim > 1]
    assert random_leaves and not any(torch.equal(a, b) for a, b in random_leaves)
    blocks = same[0]["blocks"]
    assert not torch.equal(blocks[0]["wq"], blocks[1]["wq"])  # layers get their own keys
    out_std, in_std = blocks[0]["wo"].std().item(), blocks[0]["wq"].std().item()
    assert abs(in_std - 0.02) < 0.004 and abs(out_std - 0.02 / 2) < 0.003  # wo: 0.02 / sqrt(2 * layers)


def test_tensor_parallel_matches_single_device() -> None:
    """The same model code on DTensors (heads, kv_heads, mlp and vocab over tp) gives the same loss and grads.

    Only a tp axis: the first call through each DTensor op is slow (sharding propagation warm-up),
    and data parallelism needs nothing from the model that the other layouts' tests do not cover.
    """
    cfg = dataclasses.replace(SMALL, layers=1)
    params, batch = gpt.init(core.random.key(9), cfg), gpt.example_batch(cfg, 4, with_ignored=True)
    rules = shardings.Rules(batch=None, seq=None, block_seq=None, embed=None, head_dim=None, heads="tp", kv_heads="tp")
    rules += shardings.Rules(mlp="tp", vocab="tp")
    specs = assert_tensor_parallel_matches(gpt, cfg, params, batch, rules)
    assert specs["blocks"][0]["wk"] == shardings.P(None, "tp")  # kv heads are split


def test_config_validation() -> None:
    with pytest.raises(ValueError, match=r"kv_heads=3 must divide heads=4.*Fix: pick kv_heads among \[1, 2, 4\]"):
        gpt.Config(heads=4, kv_heads=3)
    with pytest.raises(ValueError, match=r"dim=100 is not divisible by heads=3.*Fix:"):
        gpt.Config(dim=100, heads=3)
    with pytest.raises(ValueError, match=r"head_dim=5 must be even.*Fix:"):
        gpt.Config(dim=20, heads=4)
    with pytest.raises(ValueError, match=r"layers=0 must be >= 1"):
        gpt.Config(layers=0)
    cfg = gpt.Config(dim=20, heads=4, head_dim=6)  # an explicit head_dim need not divide dim
    assert (cfg.d_head, cfg.n_kv_heads) == (6, 4)


def test_registry_and_example_batch() -> None:
    assert models.get("gpt") is gpt
    with pytest.raises(ValueError, match=r"unknown model 'bert'.*Fix: use one of \['gpt', 'mlp', 'moe'\]"):
        models.get("bert")
    a, b = gpt.example_batch(SMALL, 3, seed=1), gpt.example_batch(SMALL, 3, seed=1)
    assert a["tokens"].dtype == a["labels"].dtype == torch.int64 and a["tokens"].shape == (3, SMALL.seq_len)
    assert torch.equal(a["tokens"], b["tokens"]) and not torch.equal(a["tokens"], gpt.example_batch(SMALL, 3)["tokens"])
    assert torch.equal(a["tokens"][:, 1:], a["labels"][:, :-1])  # labels are the next tokens
    assert (gpt.example_batch(SMALL, 3, with_ignored=True)["labels"] == SMALL.ignore_index).any()
