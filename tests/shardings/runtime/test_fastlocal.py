"""shardings.runtime.fastlocal: simulate's cheaper per-rank loop computes what torch's loop computes (random draws
included: every rank draws the same numbers, as under torch's), and is torch's again outside simulate."""

import pytest
import torch

import shardings
from shardings import Mesh, P
from shardings.runtime import fastlocal
from shardings.runtime.compat import local_tensor_internals


def _run(monkeypatch, fast):
    monkeypatch.setenv("SHARDLAB_SIMULATE_FAST", "1" if fast else "0")
    torch.manual_seed(0)
    with shardings.simulate(4):
        x = shardings.shard(torch.arange(8.0).reshape(4, 2), P("dp"), Mesh(dp=4)).to_local()  # differs per rank
        y = (x * 2 + torch.rand(2)).sum(0)  # a random op between rank-dependent ones
        drawn = torch.rand(3)
        cat = torch.cat([drawn, drawn + 1])  # a list argument
        return [shardings.per_rank(t) for t in (y, drawn, cat)]


def test_fast_loop_equals_torchs_loop(monkeypatch):
    fast, slow = _run(monkeypatch, True), _run(monkeypatch, False)
    for a, b in zip(fast, slow, strict=True):
        assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    drawn = fast[1]
    assert all(torch.equal(d, drawn[0]) for d in drawn)  # the same draw on every rank


def test_installed_only_inside_simulate():
    lt = local_tensor_internals()
    with shardings.simulate(2):
        assert lt.module._for_each_rank_run_func is fastlocal._run
        assert lt.module._compute_local_tensor_meta is fastlocal._local_meta
        assert lt.LocalTensorMode.__torch_dispatch__ is fastlocal._mode_dispatch
        assert lt.LocalTensor.__dict__["__torch_dispatch__"] is not fastlocal._TORCH_TENSOR_DISPATCH
    assert lt.module._for_each_rank_run_func is fastlocal._ORIGINAL
    assert lt.module._compute_local_tensor_meta is fastlocal._TORCH_META
    assert lt.LocalTensorMode.__torch_dispatch__ is fastlocal._TORCH_MODE_DISPATCH
    assert lt.LocalTensor.__dict__["__torch_dispatch__"] is fastlocal._TORCH_TENSOR_DISPATCH


def _views_program():
    """View ops on an even and an uneven (per-rank sizes) LocalTensor, a write through one view: each result's
    per-rank values, sizes, strides and storage offsets, and whether each view shares its base's storage."""
    mesh = Mesh(dp=4)
    even = shardings.shard(torch.arange(32.0).reshape(8, 4), P("dp"), mesh).to_local()  # (2, 4) a rank
    uneven = shardings.shard(torch.arange(28.0).reshape(7, 4), P("dp"), mesh).to_local()  # 2, 2, 2, 1 rows
    views = [even.t(), even[1:], even.view(8), even.transpose(0, 1)[1],
             uneven.t(), uneven.select(1, 2), uneven.unsqueeze(0)]
    views[1].mul_(-1)  # a write through a view reaches its base
    out = []
    for v in [even, uneven, *views]:
        ranks = v._local_tensors
        out.append([(r, t.tolist(), t.shape, t.stride(), t.storage_offset()) for r, t in sorted(ranks.items())])
    shared = [all(v._local_tensors[r].untyped_storage().data_ptr() == b._local_tensors[r].untyped_storage().data_ptr()
                  for r in v._local_tensors) for v, b in zip(views, [even] * 4 + [uneven] * 3, strict=True)]
    return out, shared, [(repr(v.shape), repr(v.stride()), repr(v.storage_offset())) for v in views]  # the wrappers'


def test_view_ops_equal_torchs_loop_and_enter_no_fresh_mode(monkeypatch):
    """A view op's aliasing fix-up reads the new LocalTensor's sizes, strides and offset with no mode active; torch
    entered a fresh LocalTensorMode for each read (every rank's RNG state cloned), shardlab's answers them directly."""
    lt = local_tensor_internals()
    entered = []
    enter = lt.LocalTensorMode.__enter__
    monkeypatch.setattr(lt.LocalTensorMode, "__enter__", lambda self: entered.append(1) or enter(self))
    results = {}
    for fast in ("1", "0"):
        monkeypatch.setenv("SHARDLAB_SIMULATE_FAST", fast)
        with shardings.simulate(4):
            before = len(entered)
            results[fast] = _views_program()
            results[fast + "-entered"] = len(entered) - before
    assert results["1"] == results["0"]
    assert all(results["1"][1])  # every view aliases its base's storage on every rank
    assert results["1-entered"] == 0 < results["0-entered"]  # torch's: at least one fresh mode per view


def _writes_program():
    """In-place writes into a replicated buffer by rank-dependent values, a foreach write, an all-gather and ops on
    its results: every rank's values, and how many distinct tensors each result holds."""
    mesh = Mesh(dp=2, tp=2)
    x = shardings.shard(torch.arange(8.0).reshape(4, 2), P(("dp", "tp")), mesh).to_local()  # differs per rank
    w = torch.ones(2, 3) * 0.5  # a factory and an op on it: the same value on every rank
    acc = torch.zeros(1, 3)
    view = acc[:, 1:]  # a view: it sees the writes below
    acc.add_(x @ w)  # each rank adds its own value
    acc.mul_(2.0)
    pair = [torch.zeros(2), torch.ones(2)]
    torch._foreach_add_(pair, [x[0], x[0] * 2])  # a foreach write of rank-dependent values
    full = shardings.reshard(shardings.shard(torch.arange(8.0), P("tp"), mesh), P()).to_local()  # all-gather
    y = (full * 3 - 1).exp()
    half = shardings.reshard(shardings.shard(torch.arange(8.0), P(("dp", "tp")), mesh), P("dp")).to_local()
    z = half.sin()  # gathered over tp: the same within a dp group, not across them
    out = [acc, view, *pair, w, full, y, z]
    return [shardings.per_rank(t) for t in out], [len({id(v) for v in t._local_tensors.values()}) for t in out]


def test_writes_views_foreach_and_collectives_equal_torchs_loop(monkeypatch):
    monkeypatch.setenv("SHARDLAB_SIMULATE_FAST", "1")
    with shardings.simulate(4):
        fast, fast_distinct = _writes_program()
    monkeypatch.setenv("SHARDLAB_SIMULATE_FAST", "0")
    with shardings.simulate(4):
        torchs, torchs_distinct = _writes_program()
    for a, b in zip(fast, torchs, strict=True):
        assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    assert fast_distinct == torchs_distinct == [4] * 8  # one tensor per rank, as under torch's loop
    assert len({float(v.sum()) for v in fast[0]}) == 4  # the accumulators really differ between ranks
    assert all(torch.equal(v, a[:, 1:]) for v, a in zip(fast[1], fast[0], strict=True))  # the view saw the writes


def _meta_or_error(meta, local):
    try:
        return repr(meta(local))
    except AssertionError as e:
        return f"AssertionError: {e}"


@pytest.mark.parametrize("case", ["same", "uneven", "strides", "conj", "neg", "dtype", "one rank"])
def test_local_tensor_metadata_is_torchs(case):
    """A new LocalTensor's sizes, strides, dtype... (and torch's errors) are what torch's own function computes:
    equal ranks read once, per-rank sizes and strides as SymInts, mixed dtypes or conj bits refused."""
    z = torch.randn(3, dtype=torch.complex64)
    local = {
        "same": {r: torch.randn(4, 8, 2) for r in range(8)},
        "uneven": {r: torch.randn(4 + r % 2, 8) for r in range(8)},  # an uneven shard on odd ranks
        "strides": {r: torch.randn(8, 4).t() if r == 3 else torch.randn(4, 8) for r in range(8)},
        "conj": {r: z.conj() if r == 5 else z for r in range(8)},
        "neg": {r: z.conj().imag if r == 2 else z.imag for r in range(8)},
        "dtype": {r: torch.randn(3, dtype=torch.float64 if r == 7 else torch.float32) for r in range(8)},
        "one rank": {4: torch.randn(2, 3)},
    }[case]
    assert _meta_or_error(fastlocal._local_meta, local) == _meta_or_error(fastlocal._TORCH_META, local)


def _splits_program():
    """``split`` (and ``chunk``, which is a split) of an uneven LocalTensor into more chunks than some ranks' rows:
    those ranks' lists are padded with empty chunks, as torch's loop pads them; the split dim positional or not."""
    mesh = Mesh(dp=4)
    uneven = shardings.shard(torch.arange(28.0).reshape(7, 4), P("dp"), mesh).to_local()  # 2, 2, 2, 1 rows
    parts = [*uneven.split(1), *torch.ops.aten.split.Tensor(uneven.t(), 1, dim=1), *uneven.chunk(2, dim=1)]
    return [[(r, t.tolist(), t.shape) for r, t in sorted(p._local_tensors.items())] for p in parts], len(parts)


def test_split_pads_ranks_with_fewer_chunks_as_torchs_loop(monkeypatch):
    results = {}
    for fast in ("1", "0"):
        monkeypatch.setenv("SHARDLAB_SIMULATE_FAST", fast)
        with shardings.simulate(4):
            results[fast] = _splits_program()
    assert results["1"] == results["0"]
    parts, count = results["1"]
    assert count == 2 + 2 + 2 and parts[1][3][2] == (0, 4)  # rank 3 (one row) got an empty second chunk
