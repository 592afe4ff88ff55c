"""The experiment apps with ``pp``: configs compose and build, a simulated train records the pipeline, bad pipeline
settings fail at build with a fix, and the equivalence app checks a pipelined layout."""

import json
import math
import subprocess
import sys

import pytest
import torch

from experiments.build import ConfigError, build, loss
from experiments.equivalence import main as equivalence
from experiments.train import run
from shardings.pipeline import Stages
from tests.experiments.conftest import compose_config

TINY = ["model=gpt_tiny", "model.config.dim=32", "model.config.mlp=64", "model.config.seq_len=16"]  # 2 blocks
FAST = [*TINY, "data.max_bytes=200000", "data.batch_size=8", "progress=false", "optim.warmup_steps=0",
        "optim.lr=1e-2"]
PP = ["layout=dp+pp", "mesh=dp2_pp2", "runtime=simulate"]


def train(*overrides):
    return compose_config("train", overrides)


@pytest.mark.parametrize(("overrides", "want"), [
    ([], (2, "1f1b")),  # microbatches default to the pp size
    (["pipeline.schedule=gpipe", "pipeline.microbatches=4"], (4, "gpipe")),
    (["accum_steps=4"], (4, "1f1b")),  # train_step's default: accum_steps when > 1
])
def test_pp_configs_build_with_the_stages_as_the_loss(overrides, want):
    setup = build(train(*PP, *overrides))
    assert (setup.microbatches, setup.plan.schedule.name) == want and setup.mesh.shape == {"dp": 2, "pp": 2}
    assert setup.plan.microbatches == setup.microbatches and setup.plan.pp == 2
    assert isinstance(loss(setup), Stages)
    setup = build(train("layout=tp+sp+pp", "mesh=dp2_pp2_tp2", "runtime=simulate", "model=gpt_small"))
    assert setup.layout.name == "tp+sp+pp" and setup.mesh.shape == {"dp": 2, "pp": 2, "tp": 2}
    setup = build(train(*PP, "pipeline.seq_chunks=2", "pipeline.chunk_sizes=equal"))  # TeraPipe's chunks
    assert setup.plan.seq_chunks == 2 and setup.plan.chunk_sizes(16) == (8, 8)
    setup = build(train("layout=dp", "mesh=dp4", "pipeline.schedule=gpipe"))  # pipeline: ignored without pp
    assert (setup.microbatches, setup.plan) == (1, None) and not isinstance(loss(setup), Stages)


IMPOSSIBLE = [
    (["pipeline.microbatches=3"], r"batch size=16 is not divisible by 6 \(2 data-parallel ranks × 3 pipeline micro"),
    (["data.batch_size=6"], r"batch size=6 is not divisible by 4"),
    (["model.config.layers=1"], r"the model has 1 blocks \(layers\), too few for pp=2 .*model.config.layers to 2"),
    (["pipeline.schedule=interleaved"], r"pipeline.schedule=interleaved .*unknown pipeline schedule 'interleaved'.*"
                                        r"'gpipe', 'interleaved_1f1b'"),
    (["pipeline.schedule=interleaved_1f1b", "pipeline.microbatches=3", "data.batch_size=12", "model.config.layers=4"],
     r"pipeline.schedule=interleaved_1f1b .*microbatches"),
    (["pipeline.schedule=zb_v", "model.config.layers=3"],
     r"the model has 3 blocks .*too few for pp=2 × 2 stage\(s\) per rank = 4"),
    (["pipeline.microbatches=0"], r"pipeline.microbatches=0 is not a positive int"),
    (["accum_steps=2", "pipeline.microbatches=4"], r"accum_steps=2 and pipeline.microbatches=4 both set"),
    (["model=mlp", "model.name=tests.experiments.rank_skew"], r"rank_skew declares no pipeline stages"),
]


@pytest.mark.parametrize(("overrides", "message"), IMPOSSIBLE)
def test_bad_pipeline_settings_fail_at_build(overrides, message):
    with pytest.raises(ConfigError, match=message) as info:
        build(train(*PP, *overrides))
    assert "Fix:" in str(info.value)


def test_pp_on_real_processes_trains_and_measures_the_bubble(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "experiments.train", *FAST, "layout=dp+pp", "mesh=dp2_pp2",
                           "steps=2", f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and all(map(math.isfinite, (r["loss"] for r in records)))
    bubble = records[-1]["pipeline"]["bubble"]  # each of the 2 stages' measured idle fraction
    assert len(bubble) == 2 and all(0 <= b < 1 for b in bubble)


@pytest.mark.skipif(torch.__version__ < (2, 13), reason="zero-bubble W on real processes needs torch >= 2.13 "
                    "(2.11's autograd cannot restart backward from a custom Function's node: compat.grad_from_edges)")
def test_zb_v_on_real_processes_leaves_a_measured_gantt_chart(tmp_path):
    """Two stages per rank (ZB-V: rank r runs stages r and 3-r) on 2 gloo processes; the run directory holds the
    last step's timeline, and experiments.report draws it as planned and as measured."""
    from experiments import gantt
    from experiments.report import main as report

    proc = subprocess.run([sys.executable, "-m", "experiments.train", *FAST, "model.config.layers=4", "layout=pp",
                           "mesh=pp2", "pipeline.schedule=zb_v", "pipeline.microbatches=4", "steps=2",
                           f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads((tmp_path / gantt.TIMELINE).read_text())
    assert found["name"] == "zb_v" and {b[0] for b in found["measured"]} == {0, 1}  # both ranks' actions
    kinds = {b[3] for b in found["measured"]}
    assert {"F", "B", "W"} <= kinds
    assert report([str(tmp_path)]) == 0
    assert (tmp_path / "gantt_planned_0.png").stat().st_size > 0 and (tmp_path / "gantt_measured_0.png").exists()


def test_simulated_pp_train_records_the_pipeline_and_resumes_under_dp(tmp_path):
    ckpt = f"checkpoint.dir={tmp_path / 'ckpt'}"
    cfg = compose_config("train", [*FAST, *PP, "pipeline.schedule=gpipe", "pipeline.microbatches=4", "steps=3",
                                   "checkpoint.every=3", ckpt])
    summary = run(cfg, str(tmp_path / "pp"))
    records = [json.loads(line) for line in (tmp_path / "pp" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        pipe = r["pipeline"]
        assert (pipe["schedule"], pipe["microbatches"]) == ("gpipe", 4)
        assert pipe["bubble_planned"] == pytest.approx(1 / 5)  # (pp - 1) / (m + pp - 1)
        assert len(pipe["saved_peak"]) == 2 and min(pipe["saved_peak"]) > 0
        assert any(row["kind"] == "send" and row["axis"] == "pp" for row in r["comm"])
    losses = [r["loss"] for r in records]
    assert all(map(math.isfinite, losses)) and losses[-1] < losses[0], losses
    assert summary["layout"] == "dp+pp" and summary["final_loss"] == losses[-1]

    # the pp checkpoint (params on the stage mesh) resumes under another layout and mesh
    cfg = compose_config("train", [*FAST, "layout=dp", "mesh=dp4", "runtime=simulate", "steps=4",
                                   "checkpoint.every=4", ckpt, "checkpoint.allow_changes=true"])  # steps: 3 -> 4
    resumed = run(cfg, str(tmp_path / "dp"))
    assert resumed["resumed_from"] == 3 and resumed["steps"] == 1
    assert math.isfinite(resumed["final_loss"])


def test_equivalence_app_checks_a_pp_layout(capsys):
    assert equivalence([*TINY, "layout=dp+pp", "mesh=dp2_pp2", "pipeline.schedule=gpipe", "steps=2"]) == 0
    out = capsys.readouterr().out
    assert "under 'dp+pp' on Mesh(dp=2, pp=2), gpipe over 2 microbatches, 2 steps" in out and "OK:" in out
    assert equivalence([*TINY, "layout=dp+pp", "mesh=dp2_pp2", "model.config.layers=1"]) == 2
    assert "too few for pp=2" in capsys.readouterr().err


def test_stage_sizes_reach_the_step_and_are_checked():
    setup = build(train(*PP, "model.config.layers=3", "pipeline.stage_sizes=[2,1]"))
    assert [len(r) for r in setup.plan.split.ranges] == [2, 1]
    with pytest.raises(ConfigError, match=r"pipeline.stage_sizes=\[3, 1\] must be 2 positive counts adding up to the "
                                          r"model's 3 blocks.*Fix:"):
        build(train(*PP, "model.config.layers=3", "pipeline.stage_sizes=[3,1]"))
