"""The zoo's planner column (``tests.zoo.PLANNER``): ``python -m experiments.plan model.name=tests.zoo.<m>`` plans
each model as written (its own Config, no remat field, the ViT with no seq_len: its rows' tokens measured from its
example batch), ``explain=true fits=true`` answers for the winner from its own fake step, and ``experiments.train
layout=auto`` trains the winner. The cells run are ``tests.zoo.planner_selected()`` (every cell under
``SHARDLAB_ZOO=full``, ``make test-zoo``); the declared ones (layout=auto on a model experiments.train cannot feed)
are tested for their error."""

from __future__ import annotations

import math
import re

import pytest
from omegaconf import OmegaConf

import core
import shardings
import tests.zoo as zoo
from core import deferred, tree
from experiments import plan
from experiments.auto import train_overrides
from experiments.train import run
from shardings.planner import row_tokens
from tests.experiments.conftest import compose_config

# 2 ranks of this machine's cluster; a small global batch; one exact winner wanted (the search stops once the
# fastest candidate run on fake tensors is faster than every estimate left), the budget a cap it never reaches here
SEARCH = ["cluster.per_node=2", "batch_size=8", "max_microbatches=2", "top_k=1", "budget_s=60"]
PLAN = [c for c in zoo.planner_selected() if c[1] == "plan"]
AUTO = [c for c in zoo.planner_selected() if c[1] == "auto"]


def _id(cell: tuple[str, str]) -> str:
    return " ".join(cell)


@pytest.fixture
def rankings(monkeypatch):
    """Every Ranking ``shardings.plan`` returns in the test (the command line prints only its text)."""
    return _recorded(monkeypatch, {})


def _recorded(monkeypatch, changed: dict) -> list:
    seen = []
    search = shardings.plan
    monkeypatch.setattr(shardings, "plan", lambda *a, **k: seen.append(search(*a, **{**k, **changed})) or seen[-1])
    return seen


def _tokens(cfg) -> int:
    """The rows' tokens the planner must plan: the config's seq_len, or the ViT's patches and class token."""
    return cfg.seq_len if hasattr(cfg, "seq_len") else (cfg.image // cfg.patch) ** 2 + 1


@pytest.mark.parametrize("cell", PLAN, ids=_id)
def test_zoo_model_is_planned_explained_and_checked_for_fit(cell, rankings, capsys):
    model = cell[0]
    m, name = zoo.module(model), f"tests.zoo.{model}"
    cfg = m.Config()
    with deferred.deferred():
        count = sum(x.numel() for x in tree.leaves(m.init(core.random.key(0), cfg)))
    assert plan.main([f"model.name={name}", *SEARCH]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"planning {name} {cfg!r}: {count:,} parameters, batch 8 × {_tokens(cfg)} tokens")
    (ranking,) = rankings
    winner = ranking.winner
    assert winner.prediction.exact, out  # run on fake tensors, not an estimate
    assert 0 < winner.prediction.peak <= ranking.cluster.memory
    assert f"winner: {' '.join(train_overrides(winner.candidate))}  (run on fake tensors" in out
    seen = [r.candidate for r in ranking.rows] + list(ranking.dropped)
    assert any(c.pipelined for c in seen) and len(seen) == ranking.searched  # its stages planned too

    cand = winner.candidate
    args = [f"model.name={name}", *SEARCH[:2], "explain=true", "fits=true", f"layout={cand.layout}",
            f"mesh={cand.mesh_name}", f"microbatches={cand.microbatches}"]
    assert plan.main(args + ([f"schedule={cand.schedule}"] if cand.pipelined else [])) == 0
    out = capsys.readouterr().out
    assert f"fits: yes — {cand}:" in out and f"{cand}: rank 1 of 1" in out
    fit = rankings[1].fits(cand)
    assert fit.exact and fit.peak == winner.prediction.peak  # the same fake step as the table's
    whole = count * 4  # fp32 bytes of every parameter
    assert 0 < fit.breakdown["params"] <= whole
    if cand.layout == "dp":  # replicated: every rank holds the whole model
        assert fit.breakdown["params"] == whole


def test_the_planner_measures_the_tokens_of_a_model_without_seq_len(capsys):
    """The ViT's Config has no seq_len: its rows are its patches and the class token (measured from its first
    stage's output on fake tensors); a seq_len the model cannot take is refused naming the one it has."""
    vit = zoo.module("vit")
    assert not hasattr(vit.Config(), "seq_len") and row_tokens(vit, vit.Config()) == 10
    assert row_tokens(vit, vit.Config(image=16)) == 17
    assert plan.main(["model.name=tests.zoo.vit", *SEARCH, "seq_len=12"]) == 2
    err = capsys.readouterr().err
    assert "has no seq_len field to set, and its rows are 10 tokens" in err and "Fix: pass seq_len=10" in err


@pytest.mark.parametrize("cell", AUTO, ids=_id)
def test_zoo_model_trains_the_planners_winner_under_layout_auto(cell, monkeypatch, tmp_path, capsys):
    """layout=auto's search asks for 1 exact candidate here, not 5 (the search itself is the plan cells')."""
    rankings = _recorded(monkeypatch, {"top_k": 1})
    model = cell[0]
    cfg = compose_config("train", [f"model.name=tests.zoo.{model}", "layout=auto", "mesh=dp2", "runtime=simulate",
                                   "steps=1", "progress=false", "data.max_bytes=200000", "data.batch_size=8",
                                   "optim.warmup_steps=0"])
    summary = run(cfg, str(tmp_path))
    (ranking,) = rankings
    winner = ranking.winner.candidate
    assert f"winner: {' '.join(train_overrides(winner))}" in capsys.readouterr().out
    assert summary["layout"] == winner.layout and summary["mesh"] == dict(winner.sizes)
    resolved = OmegaConf.load(tmp_path / "config.yaml")
    assert resolved.layout == winner.layout and dict(resolved.mesh.sizes) == dict(winner.sizes)
    assert summary["steps"] == 1 and abs(summary["final_loss"] - math.log(256)) < 1.0  # untrained: ~uniform bytes


@pytest.mark.parametrize("cell", sorted(zoo.PLANNER_DECLARED), ids=_id)
def test_layout_auto_on_a_model_the_data_cannot_feed_gives_its_declared_error(cell, rankings, tmp_path):
    """Refused before the planner runs (nothing planned), naming the model, what the data gives and the fix."""
    want = zoo.PLANNER_DECLARED[cell]
    cfg = compose_config("train", [f"model.name=tests.zoo.{cell[0]}", "layout=auto", "mesh=dp2", "runtime=simulate"])
    with pytest.raises(want.error, match=re.escape(want.match)) as raised:
        run(cfg, str(tmp_path))
    assert not rankings
    assert f"model.name=tests.zoo.{cell[0]}" in str(raised.value) and "Fix: train it through the API" in \
        str(raised.value)
