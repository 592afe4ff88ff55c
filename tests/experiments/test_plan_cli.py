"""``python -m experiments.plan``'s one-candidate questions, as docs/planner.md writes them: ``fits=true`` and
``explain=true`` with ``layout=... mesh=... precision=...`` (``mesh`` and ``precision`` are also the train app's
config groups, which Hydra took them for), and a bad candidate's error."""

import functools
import json
import math
import re
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

import core
import shardings
from core import deferred, tree
from experiments import plan
from experiments.train import run
from tests.experiments.conftest import compose_config
from tests.zoo import llama_gqa


def test_a_candidate_s_train_overrides_run_it_in_experiments_train():
    from experiments.auto import train_overrides
    from shardings.planner import Candidate

    c = Candidate("zero1+tp+pp", (("pp", 2), ("dp", 2), ("tp", 2)), 8, "interleaved_1f1b", 2, True, "bf16")
    assert train_overrides(c) == ["layout=zero1+tp+pp", "mesh=pp2_dp2_tp2", "precision=bf16",
                                  "pipeline.schedule=interleaved_1f1b", "pipeline.microbatches=8",
                                  "pipeline.virtual_stages=2", "model.config.remat=true"]
    chunked = Candidate("pp", (("pp", 4),), 4, "1f1b", seq_chunks=4)
    assert "pipeline.seq_chunks=4" in train_overrides(chunked)
    assert train_overrides(Candidate("dp", (("dp", 4),), 2, None))[-1] == "accum_steps=2"


def test_fits_answers_yes_or_no_for_the_candidate_the_command_line_names(capsys):
    assert plan.main(["model=gpt_tiny", "fits=true", "layout=zero3", "mesh=dp4", "precision=bf16"]) == 0
    head, out = capsys.readouterr().out.split("\n", 1)
    assert head.startswith("planning gpt Config(") and out.startswith("fits: yes — zero3 dp4 bf16:")
    assert "opt_state" in out


def test_explain_names_a_pipelined_candidates_schedule(capsys):
    assert plan.main(["model=gpt_tiny", "explain=true", "layout=zero1+pp", "mesh=pp2_dp2", "schedule=zb_h1",
                      "microbatches=4"]) == 0
    assert "zero1+pp pp2_dp2 zb_h1 m4" in capsys.readouterr().out


def test_a_bad_candidate_is_an_error_naming_the_key(capsys):
    assert plan.main(["model=gpt_tiny", "fits=true", "layout=zero3", "mesh=dp3"]) == 2
    assert "mesh=dp3 has 3 ranks but cluster this has 4" in capsys.readouterr().err
    assert plan.main(["model=gpt_tiny", "fits=true", "layout=zero3", "mesh=dp4", "microbatches=many"]) == 2
    assert "microbatches" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_layout_auto_trains_the_winner_as_the_docs_command_runs_it(tmp_path):
    """docs/planner.md's ``python -m experiments.train layout=auto mesh=dp4 model=gpt_small``, tiny and 2 steps, on
    real processes from the command line (Hydra's app already initialized when the planner loads its cluster)."""
    proc = subprocess.run([sys.executable, "-m", "experiments.train", "layout=auto", "mesh=dp4", "model=gpt_tiny",
                           "steps=2", "data.source=random", "progress=false", f"hydra.run.dir={tmp_path}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    winner = re.search(r"^winner: layout=(\S+) mesh=(\S+)", proc.stdout, re.M)
    assert winner, proc.stdout
    conf = OmegaConf.load(tmp_path / "config.yaml")
    assert conf.layout == winner[1] != "auto" and math.prod(conf.mesh.sizes.values()) == 4
    assert json.loads((tmp_path / "status.json").read_text())["status"] == "ran"
    assert json.loads((tmp_path / "summary.json").read_text())["layout"] == winner[1]


LLAMA = "tests.zoo.llama_gqa"  # a researcher's model: no remat field, F.cross_entropy, RoPE from arange


def test_the_planner_takes_a_researchers_model_as_written(capsys, monkeypatch):
    """``model.name=`` plans the module's own Config (its defaults, not gpt's head_dim), names it and its
    parameter count, plans without remat (its Config has none), counts the dropped by reason, and on this CPU
    cluster (no separate host memory) tries no offload."""
    rankings = []
    search = shardings.plan
    monkeypatch.setattr(shardings, "plan", lambda *a, **k: rankings.append(search(*a, **k)) or rankings[-1])
    assert plan.main([f"model.name={LLAMA}", "model.config.layers=4", "top_k=2", "max_pp=2", "max_microbatches=2",
                      "budget_s=5"]) == 0
    out = capsys.readouterr().out
    cfg = llama_gqa.Config(layers=4)
    with deferred.deferred():
        count = sum(x.numel() for x in tree.leaves(llama_gqa.init(core.random.key(0), cfg)))
    assert out.startswith(f"planning {LLAMA} {cfg!r}: {count:,} parameters, batch 16 × {cfg.seq_len} tokens; its "
                          "Config has no remat field: planned without remat\n")
    (ranking,) = rankings
    seen = [r.candidate for r in ranking.rows] + list(ranking.dropped)
    assert len(seen) == ranking.searched and not any(c.remat or "offload" in c.layout for c in seen)
    assert any(c.pipelined for c in seen) and any("tp" in c.layout for c in seen)
    counts = [int(n) for n in re.findall(r"^ +(\d+) ", out.split(f"dropped {len(ranking.dropped)}:\n")[1], re.M)]
    assert sum(counts) == len(ranking.dropped) > 0  # tp4 cannot split 2 kv heads
    assert "cannot run (e.g. " in out and "kv_heads" in out


def test_explain_runs_a_researchers_loss_under_tp_on_fake_tensors(capsys, monkeypatch):
    """A tp candidate of the researcher's model (heads split in an einsum, vocab-sharded logits into
    F.cross_entropy) runs on fake tensors (was: DataDependentOutputException aten._local_scalar_dense), and its
    predicted bytes per collective equal a simulated step's; remat on a Config without it is a one-line error."""
    rankings = []
    search = shardings.plan
    monkeypatch.setattr(shardings, "plan", lambda *a, **k: rankings.append(search(*a, **k)) or rankings[-1])
    args = [f"model.name={LLAMA}", "explain=true", "layout=dp+tp+sp", "mesh=dp2_tp2", "batch_size=8"]
    assert plan.main(args) == 0
    assert "all_gather     tp" in capsys.readouterr().out
    (ranking,) = rankings
    (row,) = ranking.rows
    assert row.prediction.exact
    predicted = {k: round(b) for k, (_, b) in row.prediction.simulated.items() if round(b)}
    assert predicted == _simulated_bytes(row.candidate, llama_gqa.Config(), 8)
    assert plan.main([*args, "fits=true", "remat=true"]) == 2
    assert "has no remat field" in capsys.readouterr().err


def _simulated_bytes(cand, cfg, rows: int) -> dict:
    layout = shardings.layouts.get(cand.layout)
    batch = llama_gqa.example_batch(cfg, rows)
    with shardings.simulate(math.prod(cand.sizes.values())):
        mesh = shardings.Mesh(cand.sizes)
        params = shardings.init(llama_gqa.init, core.random.key(0), cfg, axes=llama_gqa.axes(cfg), layout=layout,
                                mesh=mesh)
        step = shardings.train_step(functools.partial(llama_gqa.loss, cfg=cfg), core.optim.adamw(1e-3),
                                    layout=layout, mesh=mesh)
        _, _, metrics = step(params, step.init(params), batch)
    return {(r["kind"], r["axis"]): r["bytes"] for r in metrics["comm"]}


def test_layout_auto_trains_a_researchers_model(tmp_path, capsys):
    """``layout=auto model.name=<module>``: the planner plans the module's own Config (no remat field; bytes for
    vocab) and the winner trains (simulated ranks, 2 steps)."""
    cfg = compose_config("train", [f"model.name={LLAMA}", "model.config.vocab=256", "layout=auto", "mesh=dp4",
                                   "runtime=simulate", "steps=2", "data.max_bytes=200000", "data.batch_size=8",
                                   "progress=false"])
    summary = run(cfg, str(tmp_path))
    winner = re.search(r"^winner: layout=(\S+) mesh=(\S+)", capsys.readouterr().out, re.M)
    assert winner and summary["layout"] == winner[1] != "auto"
    assert summary["steps"] == 2 and math.isfinite(summary["final_loss"])
    assert OmegaConf.load(tmp_path / "config.yaml").model.config == {"vocab": 256}  # the rest: the module's defaults


_MASKED = '''
import torch.nn.functional as F
from tests.zoo.llama_gqa import Config, init, axes, example_batch, embed, block, rms_norm


def loss(params, batch, cfg):
    x = embed(params, batch)
    for p in params["blocks"]:
        x = block(p, x, cfg)
    logits, labels = rms_norm(x, params["norm"], cfg.eps) @ params["head"], batch["labels"]
    keep = labels != 0  # a boolean mask indexed with: its size is data
    return F.cross_entropy(logits[keep], labels[keep])
'''


def test_a_loss_that_needs_data_is_one_line_naming_the_op(tmp_path, monkeypatch, capsys):
    (tmp_path / "scratch_models").mkdir()
    (tmp_path / "scratch_models" / "__init__.py").write_text("")
    (tmp_path / "scratch_models" / "masked_loss.py").write_text(_MASKED)
    monkeypatch.syspath_prepend(str(tmp_path))
    args = ["model.name=scratch_models.masked_loss", "explain=true", "layout=dp", "mesh=dp4", "batch_size=4"]
    assert plan.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: dp dp4 fp32: the step cannot run on fake tensors")
    assert "aten.nonzero.default needs the values of a tensor" in err and "Fix: " in err


def test_explain_runs_a_terapipe_candidate_exactly(capsys):
    """``seq_chunks=2`` names a TeraPipe candidate; its explanation is its exact run (the chunked schedule on fake
    tensors), with its carries as ``k`` messages per microbatch (``seq_chunks_tried=[1,2]`` adds such candidates to a
    search, where they run exactly as the others do)."""
    assert plan.main(["model=gpt_tiny", "explain=true", "layout=dp+pp", "mesh=pp2_dp2", "schedule=1f1b",
                      "microbatches=2", "seq_chunks=2"]) == 0
    out = capsys.readouterr().out
    assert "dp+pp pp2_dp2 1f1b m2 k2 fp32" in out and "run on fake tensors" in out
    assert re.search(r"send +pp +4 ×", out)  # 2 microbatches' carries forward and back, 2 chunks each
