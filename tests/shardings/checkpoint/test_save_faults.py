"""A save that fails part-way (``checkpoint.add_save_hook`` plants the fault): a full or read-only disk is a
``CheckpointError`` that says so and names the intact previous checkpoint; a save stopped after the manifest but
before the rename is never taken for a complete checkpoint. (SIGKILL at those moments on real ranks: the drills.)"""

import errno
import os

import pytest
import torch

from shardings import checkpoint

STATE = {"params": {"w": torch.arange(6.0).reshape(2, 3)}, "data": {"position": 3}}


def _failing_at(moment, error):
    def hook(at, folder):
        if at == moment and folder.endswith("step_2.tmp"):
            raise error

    return checkpoint.add_save_hook(hook)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_a_full_or_read_only_disk_is_a_clear_error_and_the_previous_checkpoint_stays(tmp_path, code):
    checkpoint.save(tmp_path, STATE, step=1)
    remove = _failing_at("written", OSError(code, os.strerror(code)))
    try:
        with pytest.raises(checkpoint.CheckpointError, match=os.strerror(code)) as e:
            checkpoint.save(tmp_path, STATE, step=2)
    finally:
        remove()
    assert "the newest complete one, step_1, is intact" in str(e.value) and "Fix:" in str(e.value)
    assert checkpoint.latest(tmp_path) == str(tmp_path / "step_1")
    assert checkpoint.resume(tmp_path, like=STATE)[1] == 1
    checkpoint.save(tmp_path, STATE, step=2)  # the hook is gone: the next save commits
    assert checkpoint.latest(tmp_path) == str(tmp_path / "step_2")


def test_a_save_stopped_after_its_manifest_but_before_the_rename_is_not_complete(tmp_path):
    checkpoint.save(tmp_path, STATE, step=1)
    remove = _failing_at("manifest", KeyboardInterrupt())  # as a kill there would: nothing after it runs
    try:
        with pytest.raises(KeyboardInterrupt):
            checkpoint.save(tmp_path, STATE, step=2)
    finally:
        remove()
    assert os.path.isfile(tmp_path / "step_2.tmp" / "manifest.json")
    assert checkpoint.latest(tmp_path) == str(tmp_path / "step_1")
