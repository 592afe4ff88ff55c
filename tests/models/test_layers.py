"""models.layers: the invariants of RoPE, attention, RMSNorm and the masked cross-entropy."""

import einops
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from models.layers import arange_like, attention, cross_entropy, rms_norm, rope
from shardings.testing import assert_close


@settings(max_examples=15)
@given(seq=st.integers(2, 9), shift=st.integers(1, 5), half=st.integers(1, 4), seed=st.integers(0, 99))
def test_rope_scores_depend_only_on_relative_position(seq: int, shift: int, half: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, 1, 1, 2 * half, generator=gen).unbind(0)  # one query and one key vector
    # The same q at position i and k at position j, laid out in a sequence, then shifted by `shift`.
    seq_q = einops.repeat(q, "1 h d -> 1 s h d", s=seq + shift)
    seq_k = einops.repeat(k, "1 h d -> 1 s h d", s=seq + shift)
    rq, rk = rope(seq_q, theta=100.0), rope(seq_k, theta=100.0)
    scores = einops.einsum(rq, rk, "b s h d, b t h d -> b h s t")[0, 0]  # (seq + shift, seq + shift)
    assert_close(scores[shift:, shift:], scores[:seq, :seq])
    assert_close(rq[:, 0], q)  # position 0 is not rotated


def test_attention_is_causal_softmax_average() -> None:
    q, k, v = torch.randn(3, 1, 4, 2, 8).unbind(0)
    out = attention(q, k, v)
    mask = torch.ones(4, 4, dtype=torch.bool).tril()
    ref = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), attn_mask=mask).transpose(1, 2)
    assert_close(out, ref)


def test_rms_norm_has_unit_rms_times_weight() -> None:
    x, w = torch.randn(3, 5, 16), torch.rand(16) + 0.5
    y = rms_norm(x, w, eps=0.0) / w
    assert_close(y.pow(2).mean(-1), torch.ones(3, 5))


def test_cross_entropy_masks_and_never_divides_by_zero() -> None:
    logits, labels = torch.randn(2, 6, 10), torch.randint(0, 10, (2, 6))
    labels[0, :3] = -1
    expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-1)
    assert_close(cross_entropy(logits, labels, ignore_index=-1), expected)
    assert cross_entropy(logits, torch.full_like(labels, -1), ignore_index=-1) == 0
    assert torch.equal(arange_like(logits, 5), torch.arange(5))
