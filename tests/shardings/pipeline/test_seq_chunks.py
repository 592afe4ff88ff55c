"""TeraPipe's pieces on their own: the chunked GPipe and 1F1B schedules, what the checker knows of chunks, the
chunk-size dynamic program, and the executor against one device over drawn chunk counts and uneven lengths."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import core
from models import gpt
from shardings import Mesh, pipeline
from shardings.pipeline import Action, Schedule, ScheduleError, SeqChunks


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp,m,k", [(2, 1, 2), (4, 2, 4), (4, 4, 8), (3, 3, 2)])
def test_chunked_schedules_check_and_shrink_the_bubble_as_more_microbatches_would(name, pp, m, k):
    schedule = pipeline.build(name, pp, m, seq_chunks=k)
    pipeline.check(schedule)
    assert (schedule.seq_chunks, schedule.units) == (k, m * k)
    assert schedule.bubble() == pytest.approx((pp - 1) / (m * k + pp - 1))  # as m·k whole microbatches
    if name == "1f1b":  # k - 1 more warm-up chunks than 1F1B's microbatches: rank r holds pp - r + k - 1 chunks
        assert schedule.peak_in_flight() == tuple(min(pp - r + k - 1, m * k) for r in range(pp))


def test_backwards_run_each_microbatchs_chunks_last_first_and_the_table_names_them():
    schedule = pipeline.build("1f1b", 2, 2, seq_chunks=2)
    computes = [schedule.label(a) for a in schedule.ranks[1] if a.kind in ("F", "B")]
    assert computes == ["F0.0", "F0.1", "B0.1", "F1.0", "B0.0", "F1.1", "B1.1", "B1.0"]
    assert "seq_chunks=2" in schedule.table() and "B0.1" in schedule.table()


def _swap(actions, a, b):
    actions = list(actions)
    i, j = actions.index(a), actions.index(b)
    actions[i], actions[j] = actions[j], actions[i]
    return tuple(actions)


@pytest.mark.parametrize("kind,first,then,says", [
    ("F", 0, 1, "F0.1 runs before F0.0: it attends over the keys and values"),
    ("B", 1, 0, "B0.0 runs before B0.1: the earlier chunk's B needs"),
])
def test_the_checker_knows_a_chunk_waits_for_its_neighbour_on_the_same_stage(kind, first, then, says):
    good = pipeline.build("gpipe", 1, 1, seq_chunks=2)
    ranks = (_swap(good.ranks[0], Action(kind, 0, first), Action(kind, 0, then)),)
    with pytest.raises(ScheduleError, match=says):
        pipeline.check(Schedule("swapped", 1, 1, ranks, seq_chunks=2))


def test_schedules_without_chunked_orders_refuse_seq_chunks():
    with pytest.raises(ScheduleError, match=r"'zb_h1' does not cut sequences.*Fix: use one of \['1f1b', 'gpipe'\]"):
        pipeline.build("zb_h1", 2, 2, seq_chunks=2)


def _brute_force(chunks: SeqChunks, n: int) -> float:
    return min(max(chunks.costs(tuple(b - a for a, b in zip((0, *cuts), (*cuts, n)))))
               for cuts in itertools.combinations(range(1, n), chunks.count - 1))


@given(st.integers(1, 5), st.integers(1, 14), st.floats(0, 4), st.floats(0, 1))
def test_the_dynamic_program_minimizes_the_slowest_chunk(k, extra, token_cost, pair_cost):
    chunks = SeqChunks(k, token_cost=token_cost, pair_cost=pair_cost, stages=4, microbatches=2)
    n = k + extra
    sizes = chunks.sizes(n)
    assert len(sizes) == k and sum(sizes) == n and min(sizes) >= 1
    assert max(chunks.costs(sizes)) == pytest.approx(_brute_force(chunks, n))
    # T = m Σt + (K-1) max t: no worse than equal chunks' (Σt is the same for any cuts)
    equal = SeqChunks(k, "equal", token_cost=token_cost, pair_cost=pair_cost, stages=4, microbatches=2).sizes(n)
    assert sum(chunks.costs(sizes)) == pytest.approx(sum(chunks.costs(equal)))
    assert chunks.time(sizes) <= chunks.time(equal) * (1 + 1e-12)


def test_attention_heavy_chunks_shrink_along_the_sequence_and_the_plan_says_why():
    cfg = gpt.Config(vocab=64, dim=32, layers=4, heads=4, kv_heads=2, mlp=64)
    params = gpt.init(core.random.key(0), cfg)
    plan = pipeline.plan("pp", Mesh(pp=2), params, schedule="gpipe", microbatches=2, seq_chunks=4, seq_len=2048)
    sizes = plan.chunk_sizes(2048)
    assert sum(sizes) == 2048 and list(sizes) == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]
    text = str(plan)
    assert f"sizes {list(sizes)}" in text and "T = m·Σt + (K-1)·max t" in text and "equal chunks [512, 512" in text
    equal = pipeline.plan("pp", Mesh(pp=2), params, schedule="gpipe", microbatches=2, seq_chunks=4,
                          chunk_sizes="equal")
    assert equal.chunk_sizes(2048) == (512,) * 4
    with pytest.raises(ScheduleError, match="add up to 10, not the sequence's 12 tokens"):
        pipeline.plan("pp", Mesh(pp=2), params, seq_chunks=2, chunk_sizes=(6, 4), seq_len=12)


def test_a_layout_that_splits_attentions_sequence_refuses_chunks():
    params = gpt.init(core.random.key(0), gpt.Config(vocab=64, dim=32, layers=2, heads=4, mlp=64))
    with pytest.raises(ScheduleError, match="context parallelism"):
        pipeline.plan("cp+pp", Mesh(cp=2, pp=2), params, seq_chunks=2)


CFG = gpt.Config(vocab=64, dim=32, layers=3, heads=4, kv_heads=2, mlp=64, seq_len=16)
PARAMS = gpt.init(core.random.key(0), CFG)


@settings(max_examples=6)
@given(st.sampled_from(["gpipe", "1f1b"]), st.integers(1, 3), st.integers(1, 3), st.data())
def test_the_executor_equals_one_device_over_chunk_counts_and_uneven_lengths(name, pp, m, data):
    seq = data.draw(st.integers(4, 16), label="seq_len")
    k = data.draw(st.integers(1, min(seq, 5)), label="seq_chunks")
    cuts = sorted(data.draw(st.sets(st.integers(1, seq - 1), min_size=k - 1, max_size=k - 1), label="cuts"))
    sizes = tuple(b - a for a, b in zip((0, *cuts), (*cuts, seq)))
    batch = {key: x[:, :seq] for key, x in gpt.example_batch(CFG, 2 * m, with_ignored=True).items()}
    stages, total = gpt.stages(CFG), (batch["labels"] != CFG.ignore_index).sum()
    params = core.tree.map(lambda x: x.detach().requires_grad_(), PARAMS)
    want_loss = stages.loss(params, batch)
    want = torch.autograd.grad(want_loss, core.tree.leaves(params))
    units = [c for i in range(m) for c in pipeline.cut({key: x.chunk(m)[i] for key, x in batch.items()}, sizes)]
    weights = [float((c["labels"] != CFG.ignore_index).sum() / total) for c in units]
    got = pipeline.run(pipeline.build(name, pp, m, seq_chunks=k), stages, pipeline.split(PARAMS, pp), PARAMS, units,
                       weights)
    torch.testing.assert_close(got.loss, want_loss.detach(), rtol=1e-5, atol=1e-6)
    for g, w in zip(core.tree.leaves(got.grads), want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


def test_a_chunks_attention_over_its_prefix_is_the_whole_sequences_rows():
    from models.layers import rope
    from shardings.ops.attention_kernels import fused
    from shardings.ops.ring_attention import reference_attention

    q, k, v = torch.randn(2, 10, 4, 8), torch.randn(2, 10, 2, 8), torch.randn(2, 10, 2, 8)
    whole = fused(q, k, v, causal=True)
    for start in (1, 6, 9):
        torch.testing.assert_close(fused(q[:, start:], k, v, causal=True), whole[:, start:])
        torch.testing.assert_close(reference_attention(q[:, start:], k, v), whole[:, start:])
        torch.testing.assert_close(rope(q[:, start:], 1e4, offset=start), rope(q, 1e4)[:, start:])


def test_1f1b_with_chunks_holds_fewer_activations_on_stage_0_as_planned():
    """Rank 0 holds p + k - 1 chunks of 1/k of a microbatch (``peak_in_flight``) instead of 1F1B's p microbatches;
    the saved bytes (exact, simulated ranks) follow, plus each chunk's concatenated prefix keys and values."""
    cfg = gpt.Config(vocab=64, dim=64, layers=4, heads=4, kv_heads=2, seq_len=64, mlp=128)
    params, batch, pp, m = gpt.init(core.random.key(0), cfg), gpt.example_batch(cfg, 8), 4, 4
    peaks = {}
    for k in (1, 2, 4, 8):
        schedule = pipeline.build("1f1b", pp, m, seq_chunks=k)
        units = [c for i in range(m)
                 for c in pipeline.cut({key: x.chunk(m)[i].clone() for key, x in batch.items()}, (64 // k,) * k)]
        result = pipeline.run(schedule, gpt.stages(cfg), pipeline.split(params, pp), params, units,
                              [1 / len(units)] * len(units))
        peaks[k] = (result.saved_peak[0], schedule.peak_in_flight()[0] / k)
    for k in (2, 4, 8):
        measured, planned = peaks[k][0] / peaks[1][0], peaks[k][1] / peaks[1][1]
        assert planned <= measured <= 1.2 * planned, (k, measured, planned)
