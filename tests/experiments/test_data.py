"""The data pipeline: packed rows, per-rank blocks that are disjoint and cover the batch, exact resume."""

import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from experiments.data import DataState, FromIterator, Packed, batch_spec, load_corpus, read_files, source, stdlib_files
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


# -- your own data: a text file, a token file, your own iterator (each made here) -------------------------------


def _conf(**fields):
    base = {"source": "stdlib", "max_bytes": 1_000_000, "batch_size": 4, "seed": 0, "path": None, "dtype": None,
            "name": None}
    return OmegaConf.create(base | fields)


def test_a_text_file_is_read_as_bytes(tmp_path):
    text = ("the quick brown fox jumps over the lazy dog. " * 40).encode()
    (tmp_path / "corpus.txt").write_bytes(text)
    data, what = source(_conf(path=str(tmp_path / "corpus.txt")), seq_len=16, vocab=256)
    assert what == f"data: {tmp_path / 'corpus.txt'}, {len(text):,} bytes of text (data.max_bytes=1,000,000)"
    batch, _ = data.next(DataState(0))
    for row, tokens in zip(data.global_rows(DataState(0)).tolist(), batch["tokens"], strict=True):
        assert bytes(tokens.tolist()) == text[row * 16 : row * 16 + 16]


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_a_token_file_is_memory_mapped_and_its_ids_checked_against_the_vocab(tmp_path, dtype):
    ids = (np.arange(2000, dtype=np.int64) * 7919) % (70_000 if dtype == "uint32" else 50_257)  # gpt-2's vocab
    file = tmp_path / ("train.bin" if dtype == "uint16" else "train.u32")
    ids.astype(dtype).tofile(file)  # nanoGPT's prepare.py: np.array(ids, dtype=np.uint16).tofile("train.bin")
    conf = _conf(path=str(file), dtype=None if dtype == "uint16" else dtype)  # .bin: uint16 by its suffix
    data, what = source(conf, seq_len=16, vocab=int(ids.max()) + 1)
    assert what.endswith(f"2,000 {dtype} tokens, memory-mapped")
    batch, _ = data.next(DataState(3))
    for row, tokens, labels in zip(data.global_rows(DataState(3)).tolist(), batch["tokens"], batch["labels"],
                                   strict=True):
        assert tokens.tolist() == ids[row * 16 : row * 16 + 16].tolist() and labels[-1] == ids[row * 16 + 16]
    with pytest.raises(ValueError, match=rf"holds token id {ids.max()}, but the model's vocab is 256\. Fix: set "
                                         rf"model.config.vocab={ids.max() + 1} or more"):
        source(conf, seq_len=16, vocab=256)


_ITERATOR = '''
import torch


def batches(conf, batch_size, seq_len):
    """Counting sequences: batch i's row r starts at i * 1000 + r * seq_len (mod 256)."""
    i = 0
    while True:
        start = i * 1000 + torch.arange(batch_size)[:, None] * seq_len + torch.arange(seq_len + 1)
        yield {"tokens": (start[:, :-1] % 256).long(), "labels": (start[:, 1:] % 256).long()}
        i += 1
'''


def test_your_own_batch_iterator_by_module_name(tmp_path, monkeypatch):
    (tmp_path / "my_batches.py").write_text(_ITERATOR)
    monkeypatch.syspath_prepend(str(tmp_path))
    data, what = source(_conf(name="my_batches"), seq_len=8, vocab=256)
    assert what == "data: my_batches.batches (your iterator)"
    resumed, _ = source(_conf(name="my_batches"), seq_len=8, vocab=256)
    first, state = data.next(DataState(0))
    assert first["tokens"][1].tolist() == list(range(8, 16)) and state == DataState(1)
    third, _ = data.next(DataState(2))  # skips batch 1, as a resume at position 2 does
    assert torch.equal(resumed.next(DataState(2))[0]["tokens"], third["tokens"]) and third["tokens"][0, 0] == 2000 % 256
    with simulate(2):
        placed, _ = data.next_sharded(DataState(3), "dp", Mesh(dp=2))
        assert [t.shape for t in per_rank(placed["tokens"].to_local())] == [(2, 8), (2, 8)]
    short = FromIterator(iter([first]), batch_size=4, seq_len=16, where="data.name=my_batches")
    with pytest.raises(ValueError, match=r"data.name=my_batches: batch 0\['tokens'\] is torch.int64 \(4, 8\), the run "
                                         r"needs int64 \(4, 16\)"):
        short.next(DataState(0))
    with pytest.raises(ValueError, match=r"the iterator ended after 1 batches"):
        FromIterator(iter([first]), batch_size=4, seq_len=8, where="data.name=my_batches").next(DataState(1))
    sys.modules.pop("my_batches", None)


def test_the_train_app_trains_on_a_token_file(tmp_path):
    from experiments.train import run
    from tests.experiments.conftest import compose_config

    (np.arange(5000) % 300).astype(np.uint16).tofile(tmp_path / "train.bin")  # ids up to 299: vocab 300
    cfg = compose_config("train", ["model=mlp", "model.config.vocab=300", "layout=dp", "mesh=dp2", "runtime=simulate",
                                   "steps=2", "progress=false", "tracker=false", f"data.path={tmp_path / 'train.bin'}"])
    assert run(cfg, str(tmp_path / "run"))["steps"] == 2
    assert (tmp_path / "run" / "train.log").read_text().splitlines()[0] == (
        f"data: {tmp_path / 'train.bin'}, 5,000 uint16 tokens, memory-mapped")
