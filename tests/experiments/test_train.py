"""The train app: short runs in simulate and in real processes learn and leave the documented files."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import core
import models.gpt as gpt
from experiments import export
from experiments.build import ConfigError, build
from experiments.data import DataState, Packed, load_corpus
from experiments.train import run
from shardings import checkpoint
from shardings.testing import assert_close
from tests.experiments.conftest import compose_config

FAST = ["model=mlp", "data.max_bytes=200000", "progress=false", "optim.warmup_steps=0", "optim.lr=1e-2", "steps=6"]
RECORD_KEYS = {"step", "loss", "grad_norm", "tokens", "seconds", "tokens_per_s", "comm_bytes", "comm", "memory",
               "memory_per_rank", "data_position"}


def _check_run_dir(out: Path, cfg, summary: dict) -> None:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, cfg.steps + 1))
    assert all(set(r) >= RECORD_KEYS for r in records)
    assert [r["data_position"] for r in records] == list(range(1, cfg.steps + 1))
    assert records[-1]["loss"] < records[0]["loss"] - 0.3, [r["loss"] for r in records]
    assert records[0]["tokens"] == cfg.data.batch_size * 64 and records[0]["comm_bytes"] > 0
    assert set(records[0]["memory"]) >= {"params", "grads", "opt_state"}
    assert OmegaConf.load(out / "config.yaml") == OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    assert json.loads((out / "summary.json").read_text()) == summary
    assert summary["final_loss"] == records[-1]["loss"] and summary["layout"] == cfg.layout


def test_simulate_run(tmp_path):
    cfg = compose_config("train", [*FAST, "runtime=simulate", "layout=zero3", "mesh=dp4"])
    _check_run_dir(tmp_path, cfg, run(cfg, str(tmp_path)))


def test_random_bytes_train_on_simulated_ranks_as_one_corpus(tmp_path):
    """data.source=random under simulate: torch's RNG under simulated ranks draws one stream per rank, so a corpus
    drawn with it differed by rank and the loss could not be read ("rank results must be equal")."""
    assert torch.equal(load_corpus("random", 1000, seed=3), load_corpus("random", 1000, seed=3))
    cfg = compose_config("train", [*FAST, "steps=2", "runtime=simulate", "layout=dp", "mesh=dp2",
                                   "data.source=random"])
    records = run(cfg, str(tmp_path)) and [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    assert [r["step"] for r in records] == [1, 2] and abs(records[0]["loss"] - torch.log(torch.tensor(256.0))) < 0.5


@pytest.mark.multiprocess
def test_multiprocess_run(tmp_path):
    cfg = compose_config("train", [*FAST, "runtime=multiprocess", "layout=zero3", "mesh=dp2"])
    summary = run(cfg, str(tmp_path))
    _check_run_dir(tmp_path, cfg, summary)
    assert {r["kind"] for r in json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["comm"]} >= {
        "all_gather", "reduce_scatter"}


def test_impossible_combination_fails_before_any_process(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.train", "layout=tp", "mesh=dp4", f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    run_dir, error = proc.stderr.splitlines()
    assert run_dir == f"run directory: {tmp_path}" and error.startswith("Error: layout=tp mesh={'dp': 4}: ")
    assert "needs a mesh axis tp" in error and "Fix:" in error and "Traceback" not in proc.stderr
    assert (tmp_path / "train.log").read_text() == proc.stderr  # the log holds what the console showed
    assert not (tmp_path / "metrics.jsonl").exists()


def test_torchrun_runtime_outside_torchrun_says_how_to_start_it(tmp_path, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match=r"not started by torchrun.*Fix: start it as `torchrun"):
        run(compose_config("train", [*FAST, "runtime=torchrun"]), str(tmp_path))


GPT = ["model=gpt_tiny", "model.config.dim=32", "model.config.layers=1", "model.config.mlp=64",
       "model.config.seq_len=16", "data.batch_size=4", "layout=zero3", "mesh=dp2", "runtime=simulate"]


def test_init_from_a_hugging_face_folder_starts_from_its_params(tmp_path):
    cfg = compose_config("train", [*FAST, *GPT, "steps=1"])
    mcfg = build(cfg).model_cfg
    params = gpt.init(core.random.key(7), mcfg)
    checkpoint.save(tmp_path / "ckpt", {"params": params, "config": dataclasses.asdict(mcfg)}, step=0)
    hf = export.export(tmp_path / "ckpt", tmp_path / "hf")

    summary = run(compose_config("train", [*FAST, *GPT, "steps=1", f"model.init_from={hf}"]), str(tmp_path / "run"))
    data = Packed(load_corpus("stdlib", cfg.data.max_bytes), 16, 4)
    want = gpt.loss(params, data.next(DataState(0))[0], mcfg)
    assert_close(torch.tensor(summary["first_loss"]), want)

    with pytest.raises(ConfigError, match=r"params\['blocks'\]\[0\]\['w_\w+'\] has shape .* needs .*Fix:"):
        run(compose_config("train", [*FAST, *GPT, "model.config.mlp=96", f"model.init_from={hf}"]), str(tmp_path))
    with pytest.raises(ConfigError, match=r"holds a gpt, not models.mlp"):
        run(compose_config("train", [*FAST, "runtime=simulate", f"model.init_from={hf}"]), str(tmp_path))


def test_layout_auto_plans_prints_the_table_and_runs_the_winner(tmp_path, monkeypatch, capsys):
    """``layout=auto``: build (the one place it is resolved) plans the configured model on this machine's cluster,
    prints the ranked table, and the run trains the winner, whose layout and mesh the run directory records. The
    search is cut to its estimates here, no fake steps (its ranking is tests/shardings/planner/'s)."""
    import shardings as sh

    planned = []

    def small_search(*args, **kwargs):
        planned.append(sh.planner.plan(*args, **{**kwargs, "budget_s": 0.0}))
        return planned[-1]

    monkeypatch.setattr(sh, "plan", small_search)
    cfg = compose_config("train", [*GPT[:-3], "layout=auto", "mesh=dp2", "runtime=simulate", "steps=2",
                                   "progress=false", "data.max_bytes=200000"])
    summary = run(cfg, str(tmp_path))
    out = capsys.readouterr().out
    winner = planned[0].winner.candidate
    assert len(planned) == 1 and "candidates on this (2 ranks" in out and "winner: layout=" in out
    assert summary["layout"] == winner.layout and summary["mesh"] == dict(winner.sizes)
    resolved = OmegaConf.load(tmp_path / "config.yaml")
    assert resolved.layout == winner.layout and dict(resolved.mesh.sizes) == dict(winner.sizes)
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
