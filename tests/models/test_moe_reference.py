"""models.moe against an independent reference with several MoE blocks: Hugging Face ``MixtralForCausalLM`` on
the same weights (dropless top-k routing, weights renormalized over the chosen k) for the logits, and the
documented loss — cross-entropy over the counted labels plus each row's load-balancing and z-losses from every
block's router logits, summed over the blocks and weighted by the row's counted labels — written out as plain
loops over HF's router logits. Values and gradients (``tests/models/test_moe.py`` checks one MoE MLP against a
token loop; this checks the model around it, block after block)."""

import dataclasses
import math

import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM

import core
from core import tree
from models import moe
from shardings.testing import assert_close

CFG = moe.Config(vocab=32, dim=16, layers=3, heads=2, kv_heads=1, mlp=24, expert_mlp=24, seq_len=6, experts=4,
                 top_k=2, moe_every=1, capacity_factor=None, init_std=0.3, aux_loss_coef=0.5, z_loss_coef=0.25)


def _mixtral(cfg: moe.Config) -> MixtralForCausalLM:
    config = MixtralConfig(
        vocab_size=cfg.vocab, hidden_size=cfg.dim, intermediate_size=cfg.d_expert, num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads, num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.d_head,
        num_local_experts=cfg.experts, num_experts_per_tok=cfg.top_k, rms_norm_eps=cfg.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta}, max_position_embeddings=cfg.seq_len,
        tie_word_embeddings=False, router_jitter_noise=0.0, attn_implementation="eager")
    return MixtralForCausalLM(config).float().eval()


def _hf_weights(params: dict) -> dict[str, torch.Tensor]:
    """Our params under Mixtral's names and shapes (nn.Linear stores (out, in)); differentiable in params."""
    out = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["final_norm"],
           "lm_head.weight": params["unembed"].T}
    for i, b in enumerate(params["blocks"]):
        at = f"model.layers.{i}."
        out |= {at + "self_attn.q_proj.weight": b["wq"].flatten(1).T,
                at + "self_attn.k_proj.weight": b["wk"].flatten(1).T,
                at + "self_attn.v_proj.weight": b["wv"].flatten(1).T,
                at + "self_attn.o_proj.weight": b["wo"].flatten(0, 1).T,
                at + "input_layernorm.weight": b["attn_norm"], at + "post_attention_layernorm.weight": b["mlp_norm"],
                at + "mlp.gate.weight": b["router"].T,
                at + "mlp.experts.gate_up_proj": torch.cat([b["w_gate"], b["w_up"]], dim=2).transpose(1, 2),
                at + "mlp.experts.down_proj": b["w_down"].transpose(1, 2)}
    return out


def _reference_loss(model, params, batch, cfg):
    """The documented loss, by hand around Mixtral: plain loops over rows, tokens, blocks and experts."""
    hf = torch.func.functional_call(model, _hf_weights(params), (batch["tokens"],),
                                    {"output_router_logits": True})
    rows, seq = batch["tokens"].shape
    labels = batch["labels"]
    nll, counted, aux = [], [], []
    for r in range(rows):
        kept = [t for t in range(seq) if labels[r, t] != cfg.ignore_index]
        nll += [-torch.log_softmax(hf.logits[r, t], -1)[labels[r, t]] for t in kept]
        counted.append(len(kept))
        row_aux = 0.0
        for router_logits in hf.router_logits:  # one (rows·seq, experts) per block: every block is MoE
            logits = router_logits.view(rows, seq, cfg.experts)[r]
            probs = logits.softmax(-1)
            chosen = [0] * cfg.experts  # the row's top-k assignments per expert
            for t in range(seq):
                for e in probs[t].topk(cfg.top_k).indices.tolist():
                    chosen[e] += 1
            balance = cfg.experts * sum(chosen[e] / (seq * cfg.top_k) * probs[:, e].mean() for e in range(cfg.experts))
            z = sum(torch.logsumexp(logits[t], -1) ** 2 for t in range(seq)) / seq
            row_aux = row_aux + cfg.aux_loss_coef * balance + cfg.z_loss_coef * z
        aux.append(row_aux)
    return sum(nll) / len(nll) + sum(n * a for n, a in zip(counted, aux)) / sum(counted), hf.logits


@pytest.mark.parametrize("seed", [0, 1])
def test_logits_loss_and_gradients_equal_mixtral_and_the_documented_aux_losses(seed):
    cfg = dataclasses.replace(CFG, seq_len=6)
    params = moe.init(core.random.key(seed), cfg)
    batch = moe.example_batch(cfg, 3, seed=seed, with_ignored=True)
    counted = (batch["labels"] != cfg.ignore_index).sum(-1)
    assert len(set(counted.tolist())) > 1  # rows of unequal weight: a plain mean over rows would differ
    model = _mixtral(cfg)
    want_loss, want_grads = core.value_and_grad(lambda p: _reference_loss(model, p, batch, cfg)[0])(params)
    got_loss, got_grads = core.value_and_grad(lambda p: moe.loss(p, batch, cfg))(params)
    logits = _reference_loss(model, params, batch, cfg)[1]
    assert_close(moe.apply(params, batch["tokens"], cfg), logits, terms=cfg.dim)
    assert_close(got_loss, want_loss, terms=cfg.dim)
    assert_close(got_grads, want_grads, terms=cfg.dim * cfg.seq_len * 3)
    aux_share = float(want_loss) - float(torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=cfg.ignore_index))
    assert aux_share > 0.1 * float(want_loss)  # the aux losses weigh in: a wrong one would show
    assert math.isfinite(float(got_loss)) and tree.structure(got_grads) == tree.structure(params)
