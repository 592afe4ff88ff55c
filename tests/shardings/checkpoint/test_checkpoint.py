"""checkpoint: atomic, verified saves of a whole train state that load back under any layout, mesh or one device."""

import dataclasses
import functools
import json
import os
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor

import core
import models.gpt as gpt
import shardings
from core import tree
from shardings import Mesh, checkpoint
from shardings.checkpoint import saving

CFG = gpt.Config(vocab=64, dim=32, layers=1, heads=4, kv_heads=2, mlp=64, seq_len=8)
OPT = core.optim.adamw(1e-2, weight_decay=0.1)


# -- helpers (module level: launched ranks import them) ----------------------------------------------


# Built here, not inside simulate(), where a random op draws one stream per rank (train_step refuses such a batch).
BATCHES = [gpt.example_batch(CFG, 4, seed=i) for i in range(2)]


def train_state(layout=None, mesh=None, steps=0, cfg=CFG):
    """A whole train state after ``steps`` Adam steps: sharded by ``layout`` on ``mesh``, or on one device."""
    key = core.random.key(0)
    if mesh is None:
        params, opt_state = gpt.init(key, cfg), OPT.init(gpt.init(key, cfg))
        for i in range(steps):
            grads = core.grad(gpt.loss)(params, BATCHES[i], cfg)
            updates, opt_state = OPT.update(grads, opt_state, params)
            params = core.optim.apply_updates(params, updates)
    else:
        params = shardings.init(gpt.init, key, cfg, axes=gpt.axes(cfg), layout=layout, mesh=mesh)
        step_fn = shardings.train_step(functools.partial(gpt.loss, cfg=cfg), OPT, layout=layout, mesh=mesh)
        opt_state = step_fn.init(params)
        for i in range(steps):
            params, opt_state, _ = step_fn(params, opt_state, BATCHES[i])
    return {
        "params": params,
        "opt_state": opt_state,
        "rng": core.random.fold_in(core.random.key(1), steps),
        "data": {"position": 32 * steps},
        "config": dataclasses.asdict(cfg),
    }


def full_values(state):
    """``{key path: whole tensor or value}``: what a state holds, whatever its layout."""
    whole = shardings.gather(state)
    return {tree.keystr(p): shardings.unwrap(x) for p, x in tree.leaves_with_path(whole)}


def specs(state):
    return [str(shardings.spec_of(x)) for x in tree.leaves(state["params"])]


def assert_same_values(got, want):
    assert got.keys() == want.keys()
    for path in want:
        if isinstance(want[path], torch.Tensor):
            assert got[path].dtype == want[path].dtype, path
            assert torch.equal(got[path], want[path]), path
        else:
            assert got[path] == want[path], path


TARGETS_4 = {
    "zero3+tp+sp dp2×tp2": ("zero3+tp+sp", {"dp": 2, "tp": 2}),
    "hsdp dp2×fsdp2": ("hsdp", {"dp": 2, "fsdp": 2}),
}


def four_ranks(root):
    """zero3 on dp=4: save; load as zero3+tp+sp on dp=2×tp=2 and as hsdp on dp=2×fsdp=2; save (async) from the first.
    Returns the saved values, the loaded ones, and this rank's blocks of the zero3+tp+sp state."""
    source = train_state("zero3", Mesh(dp=4), steps=1)
    checkpoint.save(os.path.join(root, "zero3"), source, step=1)
    loaded = {}
    for name, (layout, sizes) in TARGETS_4.items():
        like = train_state(layout, Mesh(sizes))
        state, step = checkpoint.load(os.path.join(root, "zero3"), like)
        assert step == 1 and specs(state) == specs(like), name
        loaded[name] = full_values(state)
        if name.startswith("zero3+tp+sp"):
            blocks = blocks_here(state)
            pending = checkpoint.save(os.path.join(root, "zero3_tp_sp"), state, step=2, async_=True)
    pending.wait()
    return full_values(source), loaded, blocks


def two_ranks(root):
    """zero3+tp+sp (4 ranks) → zero3 on dp=2; a single-device checkpoint → tp+sp on tp=2."""
    a, step_a = checkpoint.load(os.path.join(root, "zero3_tp_sp"), train_state("zero3", Mesh(dp=2)))
    b, step_b = checkpoint.load(os.path.join(root, "single"), train_state("tp+sp", Mesh(tp=2)))
    return (full_values(a), step_a), (full_values(b), step_b)


# -- resharding matrix on real ranks ----------------------------------------------------------------


@pytest.mark.multiprocess
def test_resharding_matrix_across_layouts_meshes_world_sizes_and_one_device(tmp_path):
    root = str(tmp_path)
    per_rank = shardings.launch(four_ranks, 4, root)
    reference, loaded, _ = per_rank[0]
    assert reference["['params']['embed']"].abs().sum() > 0
    for name in TARGETS_4:
        assert_same_values(loaded[name], reference)
    # on the 2-D mesh each real rank holds its own block of each tensor (not only the right gathered values)
    blocks = [{p: (pl, b) for p, (pl, (b,)) in r[2].items()} for r in per_rank]  # one block per real rank
    _assert_every_rank_holds_its_block(reference, blocks, [r[1]["zero3+tp+sp dp2×tp2"] for r in per_rank])

    # Each of the 4 ranks wrote its own shards, and no value twice (DCP's metadata lists the chunks).
    saved = os.path.join(root, "zero3", "step_1")
    with open(os.path.join(saved, ".metadata"), "rb") as f:
        meta = checkpoint._MetadataUnpickler(f).load()
    for path, value in reference.items():
        if isinstance(value, torch.Tensor):
            chunks = meta.state_dict_metadata[path].chunks
            assert sum(c.sizes.numel() for c in chunks) == value.numel(), path
    embed = [i for i in meta.storage_data if i.fqn == "['params']['embed']"]
    assert sorted(meta.storage_data[i].relative_path.split("_")[2] for i in embed) == ["0", "1", "2", "3"]

    # zero3+tp+sp on 4 ranks → one device (plain tensors) → saved from one process.
    single, step = checkpoint.load(os.path.join(root, "zero3_tp_sp"), like=train_state())
    assert step == 2 and not isinstance(single["params"]["embed"], DTensor)
    assert_same_values(full_values(single), reference)
    checkpoint.save(os.path.join(root, "single"), single, step=3)

    (a, step_a), (b, step_b) = shardings.launch(two_ranks, 2, root)[0]
    assert (step_a, step_b) == (2, 3)
    assert_same_values(a, reference)
    assert_same_values(b, reference)


def test_simulated_ranks_save_and_load_across_meshes(tmp_path):
    with shardings.simulate(4):
        source = train_state("zero2", Mesh(dp=4), steps=1)
        checkpoint.save(tmp_path, source, step=1)
        reference = full_values(source)
    with shardings.simulate(2):
        like = train_state("zero3+tp+sp", Mesh(dp=1, tp=2))
        state, step = checkpoint.load(tmp_path, like)
        assert step == 1 and specs(state) == specs(like)
        assert_same_values(full_values(state), reference)
    single, _ = checkpoint.load(tmp_path, like=train_state())
    assert_same_values(full_values(single), reference)


def test_zero2_under_bf16_saves_the_sharded_fp32_master_and_resumes_where_it_left_off(tmp_path):
    """ZeRO-2 with bf16 compute keeps the fp32 master in the optimizer state and stores the bf16 copy: a save after
    one step and a resume from it give the uninterrupted run's second step, bit for bit, master and copy alike."""
    mesh, policy = Mesh(dp=2), core.precision.Policy.bf16_mixed()
    with shardings.simulate(2):
        params = shardings.init(gpt.init, core.random.key(0), CFG, axes=gpt.axes(CFG), layout="zero2", mesh=mesh)
        step_fn = shardings.train_step(functools.partial(gpt.loss, cfg=CFG), OPT, layout="zero2", mesh=mesh,
                                       precision=policy)
        like = {"params": step_fn.stored(params), "opt_state": step_fn.init(params)}
        p1, s1, _ = step_fn(params, step_fn.init(params), BATCHES[0])
        checkpoint.save(tmp_path, {"params": p1, "opt_state": s1}, step=1)
        want = full_values({"params": step_fn(p1, s1, BATCHES[1])[:2]})
        state, _ = checkpoint.load(tmp_path, like)
        got = full_values({"params": step_fn(state["params"], state["opt_state"], BATCHES[1])[:2]})
        saved = full_values({"params": p1, "opt_state": s1})
    assert {x.dtype for k, x in saved.items() if k.startswith("['params']")} == {torch.bfloat16}
    master = {k: x for k, x in saved.items() if ".weights" in k}
    assert master and {x.dtype for x in master.values()} == {torch.float32}
    assert_same_values(got, want)


# -- a load onto a 2-D mesh: every rank holds its own block ------------------------------------------------------------


MESH_2D = {"dp": 2, "tp": 2}


def blocks_here(state):
    """``{key path: (placements, this rank's local block)}`` of the state's DTensors, on this rank (or, simulated, a
    list with one block per rank)."""
    out = {}
    for path, x in tree.leaves_with_path(state):
        if isinstance(x, DTensor):
            placements = tuple(("S", p.dim) if p.is_shard() else ("R",) for p in x.placements)
            out[tree.keystr(path)] = placements, shardings.per_rank(x.to_local())
    return out


def _expected_block(full, placements, coords):
    """The block of ``full`` the rank at mesh ``coords`` holds: Shard(d) on mesh dim m splits d as torch.chunk does,
    mesh dims in order (computed here, not by shardings)."""
    block = full
    for axis, placement in zip(MESH_2D, placements):
        if placement[0] == "S":
            chunks = block.chunk(MESH_2D[axis], dim=placement[1])
            block = chunks[coords[axis]] if coords[axis] < len(chunks) else block.narrow(placement[1], 0, 0)
    return block


def _assert_every_rank_holds_its_block(reference, blocks_per_rank, full_per_rank):
    coords = [{"dp": r // MESH_2D["tp"], "tp": r % MESH_2D["tp"]} for r in range(4)]  # row-major: dp major
    both = [p for p, (pl, _) in blocks_per_rank[0].items() if all(kind == "S" for kind, *_ in pl)]
    assert "['params']['blocks'][0]['wq']" in both  # split over dp (embed) and tp (heads): a real 2-D layout
    for rank, blocks in enumerate(blocks_per_rank):
        assert blocks.keys() == blocks_per_rank[0].keys()
        for path, (placements, block) in blocks.items():
            assert torch.equal(block, _expected_block(reference[path], placements, coords[rank])), (rank, path)
        assert_same_values(full_per_rank[rank], reference)  # and gathered back, every rank's copy


def test_a_simulated_load_onto_a_2d_mesh_puts_each_block_on_its_rank(tmp_path):
    """zero3 on dp=4, one step, saved; loaded as zero3+tp on dp=2×tp=2 (the multiprocess matrix does zero3+tp+sp)."""
    with shardings.simulate(4):
        source = train_state("zero3", Mesh(dp=4), steps=1)
        checkpoint.save(tmp_path, source, step=1)
        like = train_state("zero3+tp", Mesh(MESH_2D))
        state, step = checkpoint.load(tmp_path, like)
        assert step == 1 and specs(state) == specs(like)
        reference, blocks, full = full_values(source), blocks_here(state), full_values(state)  # the ranks' copies agree
    per_rank = [{p: (pl, bs[r]) for p, (pl, bs) in blocks.items()} for r in range(4)]
    _assert_every_rank_holds_its_block(reference, per_rank, [full] * 4)


def test_rank_dependent_plain_tensor_is_refused_under_simulate(tmp_path):
    from shardings.runtime.compat import LocalTensor

    with shardings.simulate(2), pytest.raises(checkpoint.CheckpointError, match=r"\['skew'\].*different values"):
        checkpoint.save(tmp_path, {"skew": LocalTensor({0: torch.zeros(2), 1: torch.ones(2)})}, step=0)


# -- single process: format, keep-last-k, atomicity, async ------------------------------------------


@given(
    shapes=st.lists(st.lists(st.integers(0, 5), max_size=3), min_size=1, max_size=4),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.bool]),
    extra=st.one_of(st.none(), st.integers(), st.text(max_size=5), st.floats(allow_nan=False)),
)
@settings(max_examples=10)
def test_any_tree_of_tensors_and_json_values_round_trips(tmp_path_factory, shapes, dtype, extra):
    root = tmp_path_factory.mktemp("ckpt")
    state = {"t": [torch.arange(torch.Size(s).numel()).reshape(s).to(dtype) for s in shapes], "extra": extra}
    checkpoint.save(root, state, step=7)
    like = {"t": [torch.empty(s, dtype=dtype) for s in shapes], "extra": None}
    got, step = checkpoint.load(root, like)
    assert step == 7 and got["extra"] == extra
    assert all(torch.equal(a, b) for a, b in zip(got["t"], state["t"]))
    flat, _ = checkpoint.load(root)  # no `like`: {key path: whole value}
    assert flat["['extra']"] == extra and torch.equal(flat["['t'][0]"], state["t"][0])


def test_keeps_the_last_k_and_latest_is_the_newest(tmp_path):
    assert checkpoint.latest(tmp_path) is None
    for step in (1, 2, 5, 10):
        checkpoint.save(tmp_path, {"w": torch.full((2,), float(step))}, step=step, keep=2)
    assert sorted(os.listdir(tmp_path)) == ["step_10", "step_5"]
    assert checkpoint.latest(tmp_path) == os.path.join(tmp_path, "step_10")
    checkpoint.save(tmp_path, {"w": torch.zeros(2)}, step=10, keep=None)  # same step again: replaced
    assert torch.equal(checkpoint.load(tmp_path)[0]["['w']"], torch.zeros(2))
    assert sorted(os.listdir(tmp_path)) == ["step_10", "step_5"]


def _crash(*args, **kwargs):
    raise RuntimeError("killed mid-save")


@pytest.mark.parametrize("where", ["while writing shards", "before the commit"])
def test_a_crash_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch, where):
    checkpoint.save(tmp_path, {"w": torch.ones(4)}, step=1)
    with monkeypatch.context() as m:
        if where == "before the commit":
            m.setattr(saving, "_commit", _crash)  # where save() looks it up
        else:
            import torch.distributed.checkpoint.filesystem as fs

            m.setattr(fs, "_write_item", _crash)
        with pytest.raises(BaseException, match="killed mid-save"):  # DCP wraps it in its CheckpointException
            checkpoint.save(tmp_path, {"w": torch.full((4,), 2.0)}, step=2)
    assert os.path.isdir(tmp_path / "step_2.tmp")  # the interrupted save, ignored
    assert checkpoint.latest(tmp_path) == os.path.join(tmp_path, "step_1")
    state, step = checkpoint.load(tmp_path, {"w": torch.empty(4)})
    assert step == 1 and torch.equal(state["w"], torch.ones(4))
    checkpoint.save(tmp_path, {"w": torch.full((4,), 2.0)}, step=2)  # a later save of the step succeeds
    assert sorted(os.listdir(tmp_path)) == ["step_1", "step_2"]


def test_async_save_commits_on_wait_or_next_use(tmp_path):
    state = train_state(steps=0)
    pending = checkpoint.save(tmp_path, state, step=4, async_=True)
    assert checkpoint.latest(tmp_path) == os.path.join(tmp_path, "step_4")  # waited for it
    assert pending.wait() == os.path.join(tmp_path, "step_4")
    pending = checkpoint.save(tmp_path, state, step=5, async_=True)
    got, step = checkpoint.load(tmp_path, train_state())
    assert step == 5 and pending.path is not None
    assert_same_values(full_values(got), full_values(state))


# -- bad input: clear errors, nothing loaded partially -----------------------------------------------


@pytest.fixture
def saved(tmp_path):
    checkpoint.save(tmp_path, train_state(), step=3)
    return tmp_path / "step_3"


def _shard(folder):
    return folder / next(n for n in os.listdir(folder) if n.endswith(".distcp"))


def test_truncated_file_is_named(saved):
    shard = _shard(saved)
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(checkpoint.CheckpointError, match=rf"{shard.name} has \d+ bytes.*truncated.*Fix:"):
        checkpoint.load(saved, train_state())


@pytest.mark.parametrize("name", ["shard", ".metadata"])
def test_corrupted_file_is_named(saved, name):
    file = _shard(saved) if name == "shard" else saved / name
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointError, match=rf"{file.name} is corrupted"):
        checkpoint.load(saved, train_state())


def test_missing_shard_is_named(saved):
    shard = _shard(saved)
    shard.unlink()
    with pytest.raises(checkpoint.CheckpointError, match=rf"{shard.name} is missing \(written by rank 0\)"):
        checkpoint.load(saved, train_state())


def test_corrupted_manifest_is_named(saved):
    (saved / checkpoint.MANIFEST).write_text("{not json")
    with pytest.raises(checkpoint.CheckpointError, match=r"cannot read .*manifest.json"):
        checkpoint.load(saved, train_state())


def test_other_model_config_names_the_key_path_and_both_shapes(saved):
    other = train_state(cfg=dataclasses.replace(CFG, mlp=96))
    where = r"\['params'\]\['blocks'\]\[0\]\['w_\w+'\]"
    with pytest.raises(checkpoint.CheckpointError, match=where + r".*\(32, 64\).*\(32, 96\)"):
        checkpoint.load(saved, other)


def test_structure_mismatch_names_the_key_path(saved):
    like = train_state()
    del like["data"]
    with pytest.raises(checkpoint.CheckpointError, match=r"\['data'\]\['position'\] is saved but not in `like`"):
        checkpoint.load(saved, like)
    like = {**train_state(), "ema": torch.zeros(2)}
    with pytest.raises(checkpoint.CheckpointError, match=r"\['ema'\] is not in the checkpoint"):
        checkpoint.load(saved, like)


def test_dtype_mismatch_is_an_error(saved):
    like = train_state()
    like["rng"] = like["rng"].to(torch.int32)
    with pytest.raises(checkpoint.CheckpointError, match=r"\['rng'\].*int64.*int32"):
        checkpoint.load(saved, like)


class _Exploit:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_metadata_pickle_cannot_run_code_even_with_a_matching_manifest(saved):
    meta = saved / ".metadata"
    meta.write_bytes(pickle.dumps(_Exploit()))
    manifest = json.loads((saved / checkpoint.MANIFEST).read_text())
    manifest["files"][".metadata"] = checkpoint._describe_files(str(saved), [".metadata"])[".metadata"]
    (saved / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(checkpoint.CheckpointError, match=r"system is not allowed in checkpoint metadata"):
        checkpoint.load(saved, train_state())


def test_no_checkpoint_and_bad_arguments(tmp_path):
    with pytest.raises(checkpoint.CheckpointError, match=r"no complete checkpoint.*Fix:"):
        checkpoint.load(tmp_path, train_state())
    with pytest.raises(checkpoint.CheckpointError, match=r"\['config'\]: .*Config.*Fix: .*asdict"):
        checkpoint.save(tmp_path, {"config": CFG}, step=1)
    with pytest.raises(checkpoint.CheckpointError, match="step must be a non-negative int"):
        checkpoint.save(tmp_path, {}, step=-1)
    with pytest.raises(checkpoint.CheckpointError, match="keep must be a positive int"):
        checkpoint.save(tmp_path, {}, step=1, keep=0)
