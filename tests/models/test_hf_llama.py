"""models.gpt against Hugging Face ``LlamaForCausalLM``: logits/loss parity and exact weight round trips."""

import dataclasses

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

import core
from core import tree
from models import gpt
from shardings.testing import assert_close


@st.composite
def llama_configs(draw: st.DrawFn) -> LlamaConfig:
    """Tiny random Llama configs: MHA, GQA and MQA, tied and untied, head_dim derived or explicit."""
    heads = draw(st.sampled_from([1, 2, 4]))
    kv_heads = draw(st.sampled_from([d for d in (1, 2, 4) if heads % d == 0]))
    head_dim = draw(st.sampled_from([4, 8]))
    dim = draw(st.sampled_from([heads * head_dim, 16]))  # 16: head_dim not derived from dim in general
    return LlamaConfig(
        vocab_size=draw(st.integers(8, 40)),
        hidden_size=dim,
        intermediate_size=draw(st.integers(4, 40)),
        num_hidden_layers=draw(st.integers(1, 2)),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=16,
        rms_norm_eps=draw(st.sampled_from([1e-6, 1e-5])),
        rope_parameters={"rope_type": "default", "rope_theta": draw(st.sampled_from([10000.0, 500000.0]))},
        tie_word_embeddings=draw(st.booleans()),
        attn_implementation="eager",
    )


def _randomized(config: LlamaConfig, seed: int) -> LlamaForCausalLM:
    """A float32 HF model whose weights are O(1/sqrt(fan_in)) and norms ≠ 1, so logits are O(1).

    HF's default init (std 0.02) makes logits ~1e-2, where a relative tolerance checks little;
    larger weights and non-trivial norm scales make every mapped tensor matter.
    """
    model = LlamaForCausalLM(config).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.2 * noise if p.ndim == 1 else noise / p.shape[-1] ** 0.5)
            assert "norm" in name or p.ndim == 2
    return model


TWO_BLOCKS = LlamaConfig(vocab_size=24, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=4, max_position_embeddings=16,
                         rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                         tie_word_embeddings=False, attn_implementation="eager")


@settings(max_examples=12)
@given(config=llama_configs(), seed=st.integers(0, 2**16), batch=st.integers(1, 3), seq=st.integers(2, 12))
@example(config=TWO_BLOCKS, seed=3, batch=2, seq=9)  # pinned: the independent reference covers several blocks
def test_logits_and_loss_match_hf(config: LlamaConfig, seed: int, batch: int, seq: int) -> None:
    model = _randomized(config, seed)
    cfg = gpt.config_from_hf(model.config)
    params = gpt.from_hf_llama(model.state_dict(), cfg)
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, cfg.vocab, (batch, seq), generator=gen)
    hf_labels = torch.where(torch.rand(batch, seq, generator=gen) < 0.2, -100, tokens)
    hf_labels[:, 1] = tokens[:, 1]  # at least one counted label per row
    # HF shifts labels inside the loss; ours are already next-token labels.
    labels = torch.cat([hf_labels[:, 1:], torch.full((batch, 1), -100)], dim=1)
    with torch.no_grad():
        out = model(input_ids=tokens, labels=hf_labels)
        logits = gpt.apply(params, tokens, cfg)
    # Usually bit-identical; where einsum and HF's matmuls sum in another order, a logit close to 0
    # can differ by ~1e-6 absolute (a large relative error): the rule's floor scales with max|logits|.
    assert_close(logits, out.logits)
    ours = gpt.loss(params, {"tokens": tokens, "labels": labels}, cfg)
    assert_close(ours, out.loss)


@settings(max_examples=6)
@given(config=llama_configs(), seed=st.integers(0, 2**16))
def test_round_trips_are_exact(config: LlamaConfig, seed: int) -> None:
    model = _randomized(config, seed)
    cfg = gpt.config_from_hf(model.config)
    sd = model.state_dict()
    back = gpt.to_hf_llama(gpt.from_hf_llama(sd, cfg), cfg)
    assert sorted(back) == sorted(sd)
    assert all(torch.equal(back[k], sd[k]) for k in sd)

    params = gpt.init(core.random.key(seed), cfg)
    again = gpt.from_hf_llama(gpt.to_hf_llama(params, cfg), cfg)
    assert tree.structure(again) == tree.structure(params)
    assert all(torch.equal(a, b) for a, b in zip(tree.leaves(again), tree.leaves(params)))
    model.load_state_dict(gpt.to_hf_llama(params, cfg), strict=True)


def test_tied_export_shares_the_embedding() -> None:
    cfg = gpt.Config(vocab=16, dim=16, layers=1, heads=2, mlp=8, tie_embeddings=True)
    sd = gpt.to_hf_llama(gpt.init(core.random.key(0), cfg), cfg)
    assert sd["lm_head.weight"] is sd["model.embed_tokens.weight"]


def test_config_helpers_round_trip() -> None:
    cfg = gpt.Config(vocab=32, dim=24, layers=3, heads=6, kv_heads=2, head_dim=8, mlp=40, rope_theta=5e5)
    assert gpt.config_from_hf(gpt.hf_config(cfg)) == cfg
    assert gpt.config_from_hf(gpt.hf_config(cfg), seq_len=7).seq_len == 7


def test_conversion_errors_name_the_key_and_fix() -> None:
    cfg = gpt.Config(vocab=16, dim=16, layers=2, heads=2, mlp=8)
    sd = gpt.to_hf_llama(gpt.init(core.random.key(0), cfg), cfg)
    with pytest.raises(ValueError, match=r"'model.layers.1.mlp.up_proj.weight' is missing.*Fix:"):
        gpt.from_hf_llama({k: v for k, v in sd.items() if "layers.1.mlp.up" not in k}, cfg)
    with pytest.raises(ValueError, match=r"q_proj.weight: shape \(16, 16\) .* expected \(32, 16\).*Fix:"):
        gpt.from_hf_llama(sd, dataclasses.replace(cfg, head_dim=16))
    with pytest.raises(ValueError, match=r"lm_head.weight' differs.*Fix:"):
        gpt.from_hf_llama(sd, dataclasses.replace(cfg, tie_embeddings=True))
    with pytest.raises(ValueError, match=r"attention_bias.*Fix:"):
        gpt.config_from_hf(gpt.hf_config(cfg, attention_bias=True))
