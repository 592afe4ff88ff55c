"""shardings.ops.vocab_parallel: logsumexp block by block over a sharded dim (no gather of the logits), equal to
torch's."""

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

import shardings
from models.layers import cross_entropy
from shardings import Mesh, P, per_rank, shard
from shardings.ops.vocab_parallel import embedding, logsumexp, nll
from shardings.testing import assert_close

IGNORE = -100  # models.gpt.Config's ignore_index


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


# -- the vocab-parallel cross-entropy on large logits ------------------------------------------------------------------


def _large_logits(kind, vocab, tp):
    """``(4, 6, vocab)`` logits of magnitude 1e4 (exp() overflows without the max shift): spread (N(0, 1e4²): the
    softmax is ~one-hot) or shifted (1e4 + N(0, 3²): a full softmax on top of a large common offset); labels with
    about a quarter ignored; a cotangent per token."""
    gen = torch.Generator().manual_seed(tp + vocab)
    noise = torch.randn(4, 6, vocab, generator=gen)
    x = noise * 1e4 if kind == "spread" else 1e4 + 3 * noise
    labels = torch.randint(0, vocab, (4, 6), generator=gen)
    ignored = labels.masked_fill(torch.rand(4, 6, generator=gen) < 0.25, IGNORE)
    return x, labels, ignored, torch.randn(4, 6, generator=gen)


def _vocab_parallel(x, labels, ignored, cot, tp):
    """On tp simulated ranks, x's vocab dim sharded: per rank, per-token nll and its gradient, the mean loss
    (``cross_entropy`` with ignored labels) and its gradient, as full tensors."""
    with shardings.simulate(tp):
        mesh = Mesh(tp=tp)
        logits = shard(x, P(None, None, "tp"), mesh).requires_grad_()
        per_token = nll(logits, shard(labels, P(), mesh))
        (grad,) = torch.autograd.grad(per_token, logits, shard(cot, P(), mesh))
        logits = shard(x, P(None, None, "tp"), mesh).requires_grad_()
        mean = cross_entropy(logits, shard(ignored, P(), mesh), IGNORE)
        (mean_grad,) = torch.autograd.grad(mean, logits)
        return list(zip(*(shardings.per_rank(t.full_tensor()) for t in (per_token, grad, mean, mean_grad))))


def _values_and_grads(fn, x, labels, ignored, cot):
    ref = x.clone().requires_grad_()
    per_token = fn(ref, labels, None)
    (grad,) = torch.autograd.grad(per_token, ref, cot)
    ref = x.clone().requires_grad_()
    mean = fn(ref, ignored, IGNORE)
    (mean_grad,) = torch.autograd.grad(mean, ref)
    return per_token.detach(), grad, mean.detach(), mean_grad


def _ours(x, labels, ignore_index):  # shardlab's single-device loss: what the gpt reference runs
    return nll(x, labels) if ignore_index is None else cross_entropy(x, labels, ignore_index)


def _torch(x, labels, ignore_index):
    if ignore_index is None:
        return F.cross_entropy(x.flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)
    return F.cross_entropy(x.flatten(0, 1), labels.flatten(), ignore_index=ignore_index)


# vocab 64: nll's block function on each rank's block; vocab 60 over tp 8: uneven blocks, the composite form
@pytest.mark.parametrize(("kind", "vocab", "tp"), list(itertools.product(["spread", "shifted"], [64, 60], [4, 8])))
def test_vocab_parallel_cross_entropy_on_logits_of_magnitude_1e4_equals_one_device_and_torch(kind, vocab, tp):
    x, labels, ignored, cot = _large_logits(kind, vocab, tp)
    references = {"one device": _values_and_grads(_ours, x, labels, ignored, cot),
                  "torch": _values_and_grads(_torch, x, labels, ignored, cot)}
    names = ("per-token loss", "its gradient", "mean loss", "its gradient")
    for rank, got in enumerate(_vocab_parallel(x, labels, ignored, cot, tp)):
        for reference, want in references.items():
            for name, g, w in zip(names, got, want):
                assert w.isfinite().all(), name
                # a loss subtracts logits of size |x| (the rule's magnitude); gradients take the plain rule
                magnitude = float(x.abs().max()) if "loss" in name else None
                assert_close(g, w, terms=vocab, magnitude=magnitude, msg=f"rank {rank} vs {reference}, {name}")
