"""Resume skips a damaged checkpoint: the newest that verifies is loaded, saying which was skipped and why."""

import os

import pytest
import torch

from experiments.train import run
from shardings import checkpoint
from tests.experiments.conftest import compose_config

FAST = ["data.max_bytes=200000", "progress=false", "optim.warmup_steps=0", "optim.lr=1e-2", "checkpoint.every=2"]
MLP = ["model=mlp", "layout=zero3", "mesh=dp4", "runtime=simulate", "steps=4", *FAST]


def _corrupt_a_shard(folder) -> str:
    """Flip one byte in the middle of a tensor file of ``folder`` (same size: only the SHA-256 can tell)."""
    name = sorted(n for n in os.listdir(folder) if n.endswith(".distcp"))[0]
    with open(os.path.join(folder, name), "r+b") as f:
        f.seek(os.path.getsize(f.name) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    return name


def _save_steps_2_and_4(root):
    for step in (2, 4):
        checkpoint.save(root, {"w": torch.full((4, 3), float(step)), "position": step}, step=step)
    return _corrupt_a_shard(root / "step_4")


def test_resume_falls_back_to_the_newest_checkpoint_that_verifies(tmp_path):
    shard = _save_steps_2_and_4(tmp_path)
    like = {"w": torch.zeros(4, 3), "position": 0}
    with pytest.warns(checkpoint.CheckpointWarning, match=rf"skipping the damaged checkpoint .*step_4: .*{shard} is "
                                                          "corrupted"):
        state, step = checkpoint.resume(tmp_path, like)
    assert step == 2 and state["position"] == 2 and torch.equal(state["w"], torch.full((4, 3), 2.0))


def test_an_explicit_load_of_the_damaged_step_still_raises(tmp_path):
    _save_steps_2_and_4(tmp_path)
    for where in (tmp_path / "step_4", tmp_path):  # the named step, and the root (whose latest is step 4)
        with pytest.raises(checkpoint.CheckpointError, match="corrupted"):
            checkpoint.load(where)


def test_resume_with_every_checkpoint_damaged_names_them_all(tmp_path):
    _save_steps_2_and_4(tmp_path)
    _corrupt_a_shard(tmp_path / "step_2")
    with pytest.warns(checkpoint.CheckpointWarning), pytest.raises(
            checkpoint.CheckpointError, match=r"no checkpoint under .* verifies: .*step_4: .*step_2: "):
        checkpoint.resume(tmp_path)


def test_a_restarted_run_skips_a_corrupted_checkpoint_and_resumes_from_the_one_before(tmp_path):
    ref, restarted = tmp_path / "uninterrupted", tmp_path / "restarted"
    first = run(compose_config("train", MLP), str(ref))
    (restarted / "checkpoints").mkdir(parents=True)
    for step in (2, 4):
        os.rename(ref / "checkpoints" / f"step_{step}", restarted / "checkpoints" / f"step_{step}")
    _corrupt_a_shard(restarted / "checkpoints" / "step_4")

    with pytest.warns(checkpoint.CheckpointWarning, match=r"step_4: .* is corrupted"):
        again = run(compose_config("train", MLP), str(restarted))
    assert again["resumed_from"] == 2 and again["final_loss"] == first["final_loss"]  # steps 3-4 retrained
    assert checkpoint.load(restarted / "checkpoints")[1] == 4  # and step 4 saved anew, whole
