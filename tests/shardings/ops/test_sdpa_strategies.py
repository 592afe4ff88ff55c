"""shardings.ops.sdpa_strategies: CPU attention on DTensors split by batch, heads or query rows, no collectives."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import shardings
from shardings import Mesh, per_rank
from shardings.ops.sdpa_strategies import attention_placements
from shardings.testing import assert_close

SPLITS = st.sampled_from([Replicate(), Shard(0), Shard(1), Shard(2)])  # whole, batch, heads, query rows
MASKS = st.sampled_from([None, (6, 6), (4, 1, 1, 6), (4, 4, 6, 6)])  # absent, broadcast, per example, per head


def _layout(split, mask_shape, causal):
    """(q, k/v, mask) placements of the strategy for ``split`` on one mesh dim (causal: no query split)."""
    choice = next(c for c in attention_placements(mask_shape, causal=causal) if c[0] == split)
    return choice[2], choice[3], choice[5] if mask_shape is not None else None


@given(dp=SPLITS, tp=SPLITS, mask_shape=MASKS, as_the_strategy_asks=st.booleans(), causal=st.booleans())
@settings(max_examples=10)
def test_attention_on_dtensors_equals_one_device_and_keeps_a_split_without_collectives(
    dp, tp, mask_shape, as_the_strategy_asks, causal
):
    causal = causal and mask_shape is None  # SDPA takes one or the other
    q, k, v = (torch.randn(4, 4, 6, 8) for _ in range(3))  # (batch, heads, seq, head_dim)
    mask = None if mask_shape is None else torch.randn(mask_shape)
    want = [x.clone().requires_grad_() for x in (q, k, v)]
    out = F.scaled_dot_product_attention(*want, attn_mask=mask, is_causal=causal)
    want_grads = torch.autograd.grad(out, want, out)
    local = as_the_strategy_asks and not (causal and Shard(2) in (dp, tp))
    if local:  # q, k, v and the mask as the strategy for (dp, tp) takes them
        (q_dp, kv_dp, mask_dp), (q_tp, kv_tp, mask_tp) = (_layout(s, mask_shape, causal) for s in (dp, tp))
        layouts = [(q_dp, q_tp), (kv_dp, kv_tp), (kv_dp, kv_tp), (mask_dp, mask_tp)]
    else:  # anything else: redistributed, still exact
        layouts = [(dp, tp)] * 3 + [(Replicate(), Replicate())]
    with shardings.simulate(4):
        mesh = Mesh(dp=2, tp=2).device_mesh
        got = [distribute_tensor(x, mesh, p).requires_grad_() for x, p in zip((q, k, v), layouts)]
        dmask = None if mask is None else distribute_tensor(mask, mesh, layouts[3])
        with CommDebugMode() as comm:
            got_out = F.scaled_dot_product_attention(*got, attn_mask=dmask, is_causal=causal)
            grads = torch.autograd.grad(got_out, got, got_out)
        if local:  # attention ran on each rank's own block
            assert got_out.placements == (dp, tp) and comm.get_total_counts() == 0
        full = [per_rank(x.full_tensor()) for x in (got_out, *grads)]
    for values, expected in zip(full, (out, *want_grads)):
        for value in values:
            assert_close(value, expected.detach(), terms=6 * 8)


def test_a_mask_split_on_its_key_dim_is_refused_not_misread():
    # the mask is a keyword argument, which DTensor never redistributes: the strategy must take it as it is
    q = torch.randn(4, 4, 6, 8)
    with shardings.simulate(4):
        mesh = Mesh(dp=2, tp=2).device_mesh
        dq = distribute_tensor(q, mesh, (Shard(0), Shard(1)))
        whole = distribute_tensor(torch.zeros(4, 1, 6, 6), mesh, (Replicate(), Replicate()))
        F.scaled_dot_product_attention(dq, dq, dq, attn_mask=whole)  # fills DTensor's cache for this op
        by_key = distribute_tensor(torch.zeros(4, 1, 6, 6), mesh, (Shard(3), Replicate()))
        with pytest.raises(RuntimeError, match=r"attention mask of shape \(4, 1, 6, 6\) is laid out"):
            F.scaled_dot_product_attention(dq, dq, dq, attn_mask=by_key)
