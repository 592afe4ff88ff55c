"""The data pipeline: packed rows, per-rank blocks that are disjoint and cover the batch, exact resume."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments.data import DataState, Packed, batch_spec, load_corpus, read_files, stdlib_files
from shardings import Mesh, per_rank, simulate
from shardings.spec import lower
from shardings.spec.lower import coords_of_rank

STREAM = torch.randint(0, 256, (20_000,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)


def test_stdlib_corpus_is_deterministic_and_bounded():
    files = stdlib_files()
    assert (len(files) > 100 and files == sorted(files, key=lambda p: str(p).lower())) or files == stdlib_files()
    assert not any("site-packages" in p.parts for p in files)
    a, b = load_corpus("stdlib", 50_000), read_files(stdlib_files(), 50_000)
    assert a.dtype == torch.uint8 and a.numel() == 50_000 and torch.equal(a, b)


def test_rows_are_packed_next_token_windows():
    data = Packed(STREAM, seq_len=16, batch_size=8, seed=3)
    batch, state = data.next(DataState(0))
    rows = data.global_rows(DataState(0))
    assert state == DataState(1) and batch["tokens"].shape == (8, 16) and batch["tokens"].dtype == torch.int64
    for i, r in enumerate(rows.tolist()):
        window = STREAM[r * 16 : r * 16 + 17].long()
        assert torch.equal(batch["tokens"][i], window[:-1]) and torch.equal(batch["labels"][i], window[1:])


def test_an_epoch_reads_every_row_once_and_the_next_reshuffles():
    data = Packed(STREAM[:1601], seq_len=16, batch_size=10, seed=0)  # 100 rows, 10 batches per epoch
    epoch = torch.cat([data.global_rows(DataState(p)) for p in range(10)])
    assert sorted(epoch.tolist()) == list(range(100))
    assert not torch.equal(epoch, torch.cat([data.global_rows(DataState(p)) for p in range(10, 20)]))


@settings(max_examples=20)
@given(st.sampled_from([{"dp": 4}, {"dp": 2, "tp": 2}, {"dp": 2, "fsdp": 2}, {"fsdp": 2, "tp": 2}, {"tp": 4},
                        {"dp": 2, "fsdp": 2, "tp": 2}, {"dp": 3}]),
       st.sampled_from(["dp", "zero3", "hsdp"]), st.integers(0, 30))
def test_rank_blocks_are_disjoint_and_cover_the_batch(sizes, layout, position):
    mesh = Mesh(sizes)
    if (layout == "hsdp" and "fsdp" not in sizes) or not {"dp", "fsdp"} & set(sizes):
        layout = "tp" if "tp" in sizes else layout
    data = Packed(STREAM, seq_len=8, batch_size=12, seed=1)
    spec = batch_spec(layout, mesh)
    full = data.block(DataState(position))
    seen: dict[int, torch.Tensor] = {}
    for rank in range(mesh.size):
        block = lower.local_block((12, 8), spec, mesh, coords_of_rank(rank, mesh))
        mine = data.block(DataState(position), block)
        assert torch.equal(mine["tokens"], full["tokens"][block]) and torch.equal(mine["labels"], full["labels"][block])
        seen[block[0].start] = mine["tokens"]  # ranks that share a data coordinate read the same rows
    starts = sorted(seen)
    assert torch.equal(torch.cat([seen[s] for s in starts]), full["tokens"])  # disjoint, in order, covering


def test_resume_continues_the_same_token_stream():
    data = Packed(STREAM[:3001], seq_len=10, batch_size=6, seed=7)  # 300 rows: resume crosses epochs
    state, straight = DataState(0), []
    for _ in range(60):
        batch, state = data.next(state)
        straight.append(batch["tokens"])
    resumed = Packed(STREAM[:3001].clone(), seq_len=10, batch_size=6, seed=7)  # a fresh process's pipeline
    state = DataState(37)
    for expected in straight[37:]:
        batch, state = resumed.next(state)
        assert torch.equal(batch["tokens"], expected)
    assert state == DataState(60)


def test_next_sharded_gives_each_simulated_rank_only_its_rows():
    data = Packed(STREAM, seq_len=8, batch_size=4, seed=0)
    mesh = Mesh(dp=2, tp=2)
    full, _ = data.next(DataState(5))
    with simulate(4):
        batch, state = data.next_sharded(DataState(5), "dp+tp", mesh)
        locals_ = per_rank(batch["tokens"])
        gathered = per_rank(batch["labels"].full_tensor())
    assert state == DataState(6)
    for rank, local in enumerate(locals_):
        dp = coords_of_rank(rank, mesh)["dp"]
        assert torch.equal(local, full["tokens"][2 * dp : 2 * dp + 2])
    assert all(torch.equal(g, full["labels"]) for g in gathered)
