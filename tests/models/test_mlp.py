"""models.mlp: parameter/axes contract, per-token independence, loss masking, training, configs."""

import math

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
from models import mlp
from shardings.testing import assert_close
from tests.models.helpers import assert_init_is_block_evaluable, assert_tensor_parallel_matches

LOGICAL = {"batch", "seq", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab", "expert", "layers"}
SMALL = mlp.Config(vocab=32, dim=16, mlp=32, layers=2, seq_len=8)

configs = st.builds(
    mlp.Config,
    vocab=st.integers(2, 48),
    dim=st.integers(1, 24),
    mlp=st.integers(1, 24),
    layers=st.integers(1, 3),
    seq_len=st.integers(1, 8),
)


def _is_names(x: object) -> bool:
    return isinstance(x, tuple) and all(isinstance(n, str) for n in x)


@settings(max_examples=15)
@given(cfg=configs)
def test_axes_match_params(cfg: mlp.Config) -> None:
    params = mlp.init(core.random.key(0), cfg)
    names = mlp.axes(cfg)
    assert tree.structure(names, is_leaf=_is_names) == tree.structure(params)
    for p, n in zip(tree.leaves(params), tree.leaves(names, is_leaf=_is_names)):
        assert len(n) == p.ndim and set(n) <= LOGICAL


@settings(max_examples=10)
@given(cfg=configs, data=st.data())
def test_each_position_sees_only_its_own_token(cfg: mlp.Config, data: st.DataObject) -> None:
    params = mlp.init(core.random.key(1), cfg)
    tokens = mlp.example_batch(cfg, 2, seed=data.draw(st.integers(0, 99)))["tokens"]
    t = data.draw(st.integers(0, cfg.seq_len - 1))
    changed = tokens.clone()
    changed[:, t] = (tokens[:, t] + 1) % cfg.vocab
    before, after = mlp.apply(params, tokens, cfg), mlp.apply(params, changed, cfg)
    others = torch.arange(cfg.seq_len) != t
    assert_close(after[:, others], before[:, others])
    assert not torch.allclose(after[:, t], before[:, t])


@settings(max_examples=10)
@given(cfg=configs.filter(lambda c: c.seq_len > 1), seed=st.integers(0, 99))  # seq 1: all labels ignored
def test_loss_is_mean_cross_entropy_over_kept_labels(cfg: mlp.Config, seed: int) -> None:
    params = mlp.init(core.random.key(seed), cfg)
    batch = mlp.example_batch(cfg, 3, seed=seed, with_ignored=True)
    logits = mlp.apply(params, batch["tokens"], cfg)
    expected = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=cfg.ignore_index)
    assert_close(mlp.loss(params, batch, cfg), expected)


def _by_hand(params, batch, cfg: mlp.Config):
    """The module docstring's model token by token: embed → blocks of [RMSNorm → up → gelu (erf) → down +
    residual] → RMSNorm → unembed; the mean negative log-likelihood of the labels that are not ignored."""
    def rms(x, w):
        return w * x / torch.sqrt((x * x).mean() + cfg.norm_eps)

    def gelu(u):
        return 0.5 * u * (1 + torch.erf(u / math.sqrt(2)))

    nll = []
    for r in range(batch["tokens"].shape[0]):
        for t in range(batch["tokens"].shape[1]):
            x = params["embed"][batch["tokens"][r, t]]
            for p in params["blocks"]:
                x = x + gelu(rms(x, p["norm"]) @ p["w_up"]) @ p["w_down"]
            logits = rms(x, params["final_norm"]) @ params["unembed"]
            label = int(batch["labels"][r, t])
            if label != cfg.ignore_index:
                nll.append(torch.logsumexp(logits, 0) - logits[label])
    return sum(nll) / len(nll)


def test_loss_and_gradients_equal_a_token_by_token_reference_by_hand() -> None:
    """An independent reference of what the docstring promises, over several blocks (3), with large weights so
    the norms, the gelu and the residuals all matter."""
    cfg = mlp.Config(vocab=16, dim=8, mlp=12, layers=3, seq_len=5, init_std=0.5)
    wobble = lambda x: x + 0.1 * torch.arange(x.numel()).view(x.shape).sin()  # norms ≠ 1
    params = tree.map(wobble, mlp.init(core.random.key(7), cfg))
    batch = mlp.example_batch(cfg, 3, seed=1, with_ignored=True)
    want_loss, want_grads = core.value_and_grad(lambda p: _by_hand(p, batch, cfg))(params)
    got_loss, got_grads = core.value_and_grad(lambda p: mlp.loss(p, batch, cfg))(params)
    assert_close(got_loss, want_loss, terms=cfg.mlp)
    assert_close(got_grads, want_grads, terms=cfg.mlp * 15)


def test_ignored_labels_do_not_affect_the_loss() -> None:
    params, batch = mlp.init(core.random.key(2), SMALL), mlp.example_batch(SMALL, 4, with_ignored=True)
    ignored = batch["labels"] == SMALL.ignore_index
    assert ignored.any() and not ignored.all()
    # Any label value may sit behind an ignored position's token: make those tokens different.
    changed = {**batch, "tokens": torch.where(ignored, (batch["tokens"] + 1) % SMALL.vocab, batch["tokens"])}
    torch.testing.assert_close(mlp.loss(params, changed, SMALL), mlp.loss(params, batch, SMALL), rtol=0, atol=0)


def test_initial_loss_is_log_vocab_and_sgd_lowers_it() -> None:
    params, batch = mlp.init(core.random.key(3), SMALL), mlp.example_batch(SMALL, 4)
    losses = []
    for _ in range(3):
        value, grads = core.value_and_grad(mlp.loss)(params, batch, SMALL)
        losses.append(value.item())
        params = tree.map(lambda p, g: p - 1.0 * g, params, grads)
    assert math.isfinite(losses[0]) and abs(losses[0] - math.log(SMALL.vocab)) < 0.05
    assert losses[2] < losses[1] < losses[0]


@settings(max_examples=10)
@given(cfg=configs, data=st.data())
def test_init_is_block_evaluable(cfg: mlp.Config, data: st.DataObject) -> None:
    assert_init_is_block_evaluable(mlp, cfg, data)


def test_init_is_deterministic_per_key() -> None:
    same = [mlp.init(core.random.key(4), SMALL) for _ in range(2)]
    other = mlp.init(core.random.key(5), SMALL)
    assert all(torch.equal(a, b) for a, b in zip(*map(tree.leaves, same)))
    weights = [(a, b) for a, b in zip(tree.leaves(same[0]), tree.leaves(other)) if a.ndim > 1]
    assert weights and not any(torch.equal(a, b) for a, b in weights)
    assert not torch.equal(same[0]["blocks"][0]["w_up"], same[0]["blocks"][1]["w_up"])


def test_tensor_parallel_matches_single_device() -> None:
    """mlp and vocab over tp: the same code on DTensors gives the reference loss and grads."""
    params, batch = mlp.init(core.random.key(6), SMALL), mlp.example_batch(SMALL, 4, with_ignored=True)
    rules = shardings.Rules(batch=None, seq=None, block_seq=None, embed=None, mlp="tp", vocab="tp")
    assert_tensor_parallel_matches(mlp, SMALL, params, batch, rules)


def test_config_validation_and_registry() -> None:
    with pytest.raises(ValueError, match=r"mlp=0 must be >= 1.*Fix:"):
        mlp.Config(mlp=0)
    assert models.get("mlp") is mlp
