"""checkpoint on real ranks: a load verifies every file's SHA-256 before reading, the ranks splitting the files
between them (each hashes its own share, together all of them), so a byte flipped in any one file is named,
whichever rank's share it is in (issue #43.5). One launch of 4 gloo ranks serves both tests."""

import hashlib
import os

import pytest
import torch.distributed as dist

import core
import models.gpt as gpt
import shardings
from shardings import Mesh, checkpoint
from shardings.checkpoint import files as checkpoint_files

CFG = gpt.Config(vocab=32, dim=16, layers=1, heads=2, kv_heads=2, mlp=32, seq_len=8)
WORLD = 4


# -- what each rank runs (module level: launched ranks import it) -----------------------------------------------------


def _state():
    params = shardings.init(gpt.init, core.random.key(0), CFG, axes=gpt.axes(CFG), layout="zero3",
                            mesh=Mesh(dp=WORLD))
    return {"params": params}


def _load(folder):
    """Load ``folder`` into the zero3 state: ``None``, or the CheckpointError's message."""
    try:
        checkpoint.load(folder, _state())
    except checkpoint.CheckpointError as e:
        return str(e)
    return None


def _flip_one_byte(file):
    with open(file, "r+b") as f:
        f.seek(os.path.getsize(file) // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0xFF]))


def _ranks(root):
    """Save a zero3 state from every rank; load it, recording the files this rank hashed; then, for each file in
    turn, flip one byte of it (rank 0), load on every rank, and flip it back. Returns this rank's hashed files,
    the honest load's error (``None``) and, per file, the error of the load with that file flipped."""
    checkpoint.save(root, _state(), step=1)
    folder = os.path.join(root, "step_1")
    hashed = []
    sha256 = checkpoint_files._sha256
    checkpoint_files._sha256 = lambda file: hashed.append(os.path.basename(file)) or sha256(file)
    try:
        honest = _load(folder)
    finally:
        checkpoint_files._sha256 = sha256
    errors = {}
    for name in sorted(n for n in os.listdir(folder) if n != checkpoint.MANIFEST):
        file = os.path.join(folder, name)
        for flip in ("flip", "load", "flip back"):
            if flip == "load":
                errors[name] = _load(folder)
            elif dist.get_rank() == 0:
                _flip_one_byte(file)
            dist.barrier()
    return {"honest": honest, "hashed": hashed, "errors": errors}


# -- the tests ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    per_rank = shardings.launch(_ranks, WORLD, str(root))
    return root / "step_1", per_rank


@pytest.mark.multiprocess
def test_each_rank_hashes_its_own_share_and_together_every_file(ranks):
    folder, per_rank = ranks
    listed = sorted(checkpoint_files._read_manifest(str(folder))["files"])
    assert sorted(os.listdir(folder)) == sorted([*listed, checkpoint.MANIFEST])  # the manifest lists every file
    assert len(listed) > WORLD  # some rank hashes two: the split is exercised
    shares = [r["hashed"] for r in per_rank]
    assert all(r["honest"] is None for r in per_rank)
    assert sorted(name for share in shares for name in share) == listed, shares  # each file once, by one rank
    assert all(len(share) in (len(listed) // WORLD, -(-len(listed) // WORLD)) for share in shares), shares
    for name in listed:  # and what the manifest holds is each file's SHA-256 (the hash each rank compares)
        want = checkpoint_files._read_manifest(str(folder))["files"][name]["sha256"]
        assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == want, name


@pytest.mark.multiprocess
def test_a_byte_flipped_in_any_one_file_is_named_on_every_rank(ranks):
    folder, per_rank = ranks
    listed = sorted(checkpoint_files._read_manifest(str(folder))["files"])
    for r, got in enumerate(per_rank):
        assert sorted(got["errors"]) == listed
        for name, error in got["errors"].items():
            assert error is not None, f"rank {r} loaded the checkpoint with one byte of {name} flipped"
            assert f"{name} is corrupted" in error and "Fix:" in error, (r, name, error)
