"""Resume: ``experiments.train`` with ``checkpoint.every`` picks up a killed run exactly, under any layout.

The failover drill runs the real app on real processes (``runtime=multiprocess``): rank 1 SIGKILLs
itself mid-run, the job fails within a bounded time naming rank 1, and the restarted job resumes from
the last checkpoint by itself and ends bitwise equal to an uninterrupted run. The rank kills itself
from inside the model: this module doubles as a model module for ``model.name=tests.experiments.test_resume``
(``models.mlp`` whose ``loss`` SIGKILLs rank ``kill_rank`` at its ``kill_at``-th call, one call per step).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import time

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

import shardings
from experiments import resume
from experiments.build import ConfigError
from experiments.train import run
from models import mlp
from models.mlp import axes, example_batch, init
from shardings import checkpoint
from shardings.testing import assert_close
from tests.experiments.conftest import compose_config

__all__ = ["Config", "axes", "example_batch", "init", "loss"]

FAST = ["data.max_bytes=200000", "progress=false", "optim.warmup_steps=0", "optim.lr=1e-2", "checkpoint.every=2"]
MLP = ["model=mlp", "layout=zero3", "mesh=dp4", "runtime=simulate", "steps=4", *FAST]
_CALLS = [0]


@dataclasses.dataclass(frozen=True)
class Config(mlp.Config):
    """``mlp.Config`` plus when to die: rank ``kill_rank`` (-1: none) at ``loss`` call ``kill_at``."""

    kill_rank: int = -1
    kill_at: int = 0


def loss(params: dict, batch: dict, cfg: Config) -> torch.Tensor:
    """mlp's loss; SIGKILLs this process when it is rank ``cfg.kill_rank`` and this is call ``cfg.kill_at``."""
    _CALLS[0] += 1
    if cfg.kill_rank >= 0 and _CALLS[0] == cfg.kill_at and dist.get_rank() == cfg.kill_rank:
        os.kill(os.getpid(), signal.SIGKILL)
    return mlp.loss(params, batch, cfg)


def _losses(out_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (out_dir / "metrics.jsonl").read_text().splitlines())}


def _params(ckpt_dir, step: int) -> dict[str, torch.Tensor]:
    saved, at = checkpoint.load(ckpt_dir / f"step_{step}")
    assert at == step
    return {k: v for k, v in saved.items() if k.startswith("['params']")}


def _restart_from(reference, out_dir, step: int) -> None:
    """``out_dir`` as a run killed after ``step``'s checkpoint: only that checkpoint is there."""
    shutil.copytree(reference / "checkpoints" / f"step_{step}", out_dir / "checkpoints" / f"step_{step}")


def test_a_restarted_run_resumes_bitwise_under_its_layout_and_within_tolerance_under_another(tmp_path):
    ref, same, other = tmp_path / "uninterrupted", tmp_path / "same", tmp_path / "other"
    summary = run(compose_config("train", MLP), str(ref))
    assert summary["resumed_from"] == 0 and sorted(os.listdir(ref / "checkpoints")) == ["step_2", "step_4"]
    saved, _ = checkpoint.load(ref / "checkpoints")
    assert saved["['data']['position']"] == 4 and saved["['rng']"].tolist() == [0, 0]
    assert json.loads(saved["['config']['resolved']"])["layout"] == "zero3"  # a plain string (#28)

    _restart_from(ref, same, 2)
    assert run(compose_config("train", MLP), str(same))["resumed_from"] == 2
    assert _losses(same) == {s: _losses(ref)[s] for s in (3, 4)}  # bitwise: same layout, same reductions
    want = _params(ref / "checkpoints", 4)
    assert all(torch.equal(v, want[k]) for k, v in _params(same / "checkpoints", 4).items())

    _restart_from(ref, other, 2)  # resharded on load: zero3 on dp=4 -> zero3+tp on dp=2 x tp=2
    run(compose_config("train", [*MLP, "layout=zero3+tp", "mesh=dp2_tp2"]), str(other))
    log = (other / "train.log").read_text().splitlines()  # what the console said, one line per event
    assert log[0] == (f"resumed from step 2 ({other / 'checkpoints' / 'step_2'}), saved under zero3 on dp4, "
                      "now zero3+tp on dp2_tp2")
    assert log[1] == "data: stdlib, 200,000 bytes"
    assert log[2].startswith(f"checkpoint saved: step 4 -> {other / 'checkpoints' / 'step_4'} (")
    got, ref_losses = _losses(other), _losses(ref)
    assert sorted(got) == [3, 4]
    for s in got:
        assert_close(torch.tensor(got[s]), torch.tensor(ref_losses[s]))


def test_a_resume_that_changes_the_experiment_is_refused_with_the_keys_and_the_flag(tmp_path):
    run(compose_config("train", [*MLP, "steps=2"]), str(tmp_path))
    with pytest.raises(ConfigError) as e:  # a longer schedule and another lr: not the experiment saved
        run(compose_config("train", [*MLP, "optim.lr=0.02", "layout=dp", "mesh=dp2_fsdp2"]), str(tmp_path))
    msg = str(e.value)
    assert "optim.lr: saved 0.01, now 0.02; steps: saved 2, now 4." in msg and "layout" not in msg.split(". A")[0]
    assert msg.endswith("or pass checkpoint.allow_changes=true to continue with the changed keys.")
    assert sorted(_losses(tmp_path)) == [1, 2]  # refused before anything ran
    accepted = run(compose_config("train", [*MLP, "checkpoint.allow_changes=true"]), str(tmp_path))
    assert accepted["resumed_from"] == 2 and sorted(_losses(tmp_path)) == [1, 2, 3, 4]


def test_a_checkpoint_dir_named_without_every_resumes_from_it_and_saves_nothing_more(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run(compose_config("train", [*MLP, "steps=2", f"checkpoint.dir={ckpt}"]), str(tmp_path / "a"))
    later = [*MLP, "checkpoint.every=0", f"checkpoint.dir={ckpt}"]  # another run dir, the same checkpoints
    with pytest.raises(ConfigError, match="steps: saved 2, now 4"):  # not a silent fresh start beside them
        run(compose_config("train", later), str(tmp_path / "b"))
    resumed = run(compose_config("train", [*later, "checkpoint.allow_changes=true"]), str(tmp_path / "c"))
    assert resumed["resumed_from"] == 2 and sorted(_losses(tmp_path / "c")) == [3, 4]
    assert os.path.basename(checkpoint.latest(ckpt)) == "step_2"  # every=0: nothing saved after the resume


@pytest.mark.parametrize("override", ["data.batch_size=8", "model.config.mlp=128", "precision=bf16",
                                      "optim=sgd", "seed=1", "optim.warmup_steps=2"])
def test_each_training_defining_key_is_one_a_resume_may_not_change(override):
    saved = compose_config("train", MLP)
    now = compose_config("train", [*MLP, override])
    as_dict = lambda c: OmegaConf.to_container(c, resolve=True)
    assert resume.changed_keys(as_dict(saved), as_dict(now))
    moved = compose_config("train", [*MLP, "layout=zero3+tp+sp", "mesh=dp2_tp2", "runtime=multiprocess", "jit=true",
                                     "accum_steps=2", "pipeline.microbatches=4", "checkpoint.every=3"])
    assert resume.changed_keys(as_dict(saved), as_dict(moved)) == {}  # how it runs, not what it trains


def test_a_finished_run_restarted_in_its_run_dir_keeps_its_metrics(tmp_path):
    cfg = compose_config("train", [*MLP, "steps=2", "checkpoint.keep=1"])
    first = run(cfg, str(tmp_path))
    again = run(cfg, str(tmp_path))  # the checkpoint is at the last step: nothing to train
    assert again["resumed_from"] == 2 and again["final_loss"] == first["final_loss"]
    assert sorted(_losses(tmp_path)) == [1, 2] and os.listdir(tmp_path / "checkpoints") == ["step_2"]


@pytest.mark.multiprocess
def test_failover_drill_sigkill_a_rank_restart_and_end_bitwise_equal(tmp_path):
    app = ["model=mlp", "model.name=tests.experiments.test_resume", "layout=zero3", "mesh=dp2",
           "runtime=multiprocess", "runtime.timeout_s=30", "steps=6", "+model.config.kill_rank=-1",
           "+model.config.kill_at=5", *FAST]  # the same model config in every run: it is saved and checked
    ref, killed = tmp_path / "uninterrupted", tmp_path / "killed"
    run(compose_config("train", app), str(ref))

    started = time.monotonic()
    with pytest.raises(shardings.LaunchError) as e:
        run(compose_config("train", [*app, "model.config.kill_rank=1"]), str(killed))
    assert e.value.rank == 1 and "rank 1 of 2 failed without a Python exception" in str(e.value)
    assert "SIGKILL" in str(e.value)  # the dead rank is named, not its peer's broken connection
    assert time.monotonic() - started < 60  # the surviving rank was stopped, not left hanging in a collective
    assert checkpoint.latest(killed / "checkpoints") == str(killed / "checkpoints" / "step_4")

    restart = [*app, "checkpoint.allow_changes=true"]  # saved with kill_rank=1 (the fault), resumed without it
    assert run(compose_config("train", restart), str(killed))["resumed_from"] == 4  # finds step_4 by itself
    assert _losses(killed) == _losses(ref)  # steps 1-4 kept from the killed run, 5-6 resumed: bitwise
    want = _params(ref / "checkpoints", 6)
    assert all(torch.equal(v, want[k]) for k, v in _params(killed / "checkpoints", 6).items())
