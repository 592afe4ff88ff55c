"""shardings.ops.vocab_parallel: logsumexp block by block over a sharded dim (no gather of the logits), equal to
torch's."""

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

import shardings
from shardings import Mesh, P, per_rank, shard
from shardings.ops.vocab_parallel import embedding, logsumexp, nll
from shardings.testing import assert_close


def _collectives(mode: CommDebugMode) -> dict[str, int]:
    return {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}


@pytest.mark.parametrize("vocab", [64, 31])  # 31: uneven blocks (16, 15)
def test_vocab_sharded_values_and_grads_equal_torch_with_two_small_all_reduces(vocab):
    x, cot = torch.randn(4, 8, vocab), torch.randn(4, 8)
    ref = x.clone().requires_grad_()
    want = torch.logsumexp(ref, -1)
    (want_grad,) = torch.autograd.grad(want, ref, cot)
    with shardings.simulate(4):
        mesh = Mesh(dp=2, tp=2)
        assert mesh.device_mesh is not None
        logits = shard(x, P("dp", None, "tp"), mesh).requires_grad_()
        with CommDebugMode() as fwd:
            got = logsumexp(logits, -1)
        with CommDebugMode() as bwd:
            (grad,) = torch.autograd.grad(got, logits, shard(cot, P("dp", None), mesh))
        values, grads = per_rank(got.full_tensor()), per_rank(grad.full_tensor())
    assert _collectives(fwd) == {"all_reduce": 2} and _collectives(bwd) == {}  # the max, the sum: (batch, seq)
    assert got.placements == (Shard(0), Replicate()) and grad.placements == logits.placements
    for v, g in zip(values, grads):
        assert_close(v, want)
        assert_close(g, want_grad)


def test_plain_tensors_unsharded_dims_and_empty_blocks_take_torchs_op():
    x = torch.randn(3, 7)
    assert torch.equal(logsumexp(x, 1), torch.logsumexp(x, 1))
    with shardings.simulate(4):
        mesh = Mesh(tp=4)
        assert mesh.device_mesh is not None
        rows = shard(x, P(None, "tp"), mesh)  # 7 over 4: blocks of 2, 2, 2, 1
        empty = shard(torch.randn(3, 3), P(None, "tp"), mesh)  # 3 over 4: the last block is empty
        with CommDebugMode() as mode:
            by_blocks = logsumexp(rows, 1)
        assert _collectives(mode) == {"all_reduce": 2}
        gathered = logsumexp(empty, 1)  # no max of an empty block: torch's (gathering) op
        for v in per_rank(by_blocks.full_tensor()):
            assert_close(v, torch.logsumexp(x, 1))
        assert gathered.shape == (3,)


@pytest.mark.parametrize("vocab", [12, 3])  # 3 over tp=4: one block empty, so the rows are gathered first
def test_vocab_sharded_embedding_is_a_partial_lookup_equal_to_torchs(vocab):
    table, tokens = torch.randn(vocab, 5), torch.randint(0, vocab, (4, 6))
    cot = torch.randn(4, 6, 5)
    ref = table.clone().requires_grad_()
    want = torch.nn.functional.embedding(tokens, ref)
    (want_grad,) = torch.autograd.grad(want, ref, cot)
    assert torch.equal(embedding(tokens, table), torch.nn.functional.embedding(tokens, table))
    with shardings.simulate(8):
        mesh = Mesh(dp=2, tp=4)
        assert mesh.device_mesh is not None
        weight = shard(table, P("tp"), mesh).requires_grad_()
        with CommDebugMode() as fwd:
            got = embedding(shard(tokens, P("dp"), mesh), weight)
        (grad,) = torch.autograd.grad(got, weight, shard(cot, P("dp"), mesh))
        values, grads = per_rank(got.full_tensor()), per_rank(grad.full_tensor())
    if vocab == 12:  # each rank looks up its rows: the result is a pending sum over tp, nothing moved
        assert _collectives(fwd) == {} and got.placements[1].is_partial()
    else:
        assert _collectives(fwd) == {"all_gather_into_tensor": 1}
    for v, g in zip(values, grads):
        assert_close(v, want)
        assert_close(g, want_grad)


@pytest.mark.parametrize("vocab", [16, 15])  # 16: each rank's block on its own; 15 (uneven): the composite form
def test_per_token_nll_equals_torchs_cross_entropy_with_three_small_all_reduces(vocab):
    x, labels, cot = torch.randn(4, 6, vocab), torch.randint(0, vocab, (4, 6)), torch.randn(4, 6)
    labels[0, :2] = -1  # outside the vocab: picks no logit (the caller masks such tokens out)
    ref = x.clone().requires_grad_()
    want = torch.nn.functional.cross_entropy(ref.flatten(0, 1), labels.clamp(min=0).flatten(), reduction="none")
    want = torch.where(labels >= 0, want.view(4, 6), torch.logsumexp(ref, -1))
    (want_grad,) = torch.autograd.grad(want, ref, cot)
    assert_close(nll(x, labels), want.detach())
    with shardings.simulate(4):
        mesh = Mesh(dp=2, tp=2)
        assert mesh.device_mesh is not None
        logits = shard(x, P("dp", None, "tp"), mesh).requires_grad_()
        with CommDebugMode() as fwd:
            got = nll(logits, shard(labels, P("dp"), mesh))
        with CommDebugMode() as bwd:
            (grad,) = torch.autograd.grad(got, logits, shard(cot, P("dp"), mesh))
        values, grads = per_rank(got.full_tensor()), per_rank(grad.full_tensor())
    if vocab == 16:  # the max, the sum of exponentials, the target logit: (batch, seq) each; backward none
        assert _collectives(fwd) == {"all_reduce": 3} and _collectives(bwd) == {}
        assert got.placements == (Shard(0), Replicate()) and grad.placements == logits.placements
    for v, g in zip(values, grads):
        assert_close(v, want.detach())
        assert_close(g, want_grad)
