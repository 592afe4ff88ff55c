"""experiments.gantt: the planned chart is the schedule's unit-time timeline (its idle area is the bubble), the
measured one the executor's timestamps; both become PNGs, through experiments.report too."""

import json

import matplotlib.image
import numpy as np
import pytest
from torch.utils import _pytree as pytree

import core
import models
from experiments import gantt
from experiments.report import write_report
from shardings import pipeline

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name", sorted(pipeline.SCHEDULES))
def test_the_planned_chart_is_the_schedule(name):
    schedule = pipeline.build(name, 4, 8)
    bars = gantt.planned(schedule)
    assert gantt.idle_fraction(bars, 4) == pytest.approx(schedule.bubble(), abs=1e-12)
    per_kind = {k: sum(b.kind == k for b in bars) for k in "FBW"}
    computes = sum(1 for actions in schedule.ranks for a in actions if a.kind in "FBW")
    assert sum(per_kind.values()) == computes and per_kind["F"] == schedule.stages * 8


def test_a_png_per_chart_and_its_colours_come_from_the_schedule(tmp_path):
    path = gantt.draw(gantt.planned(pipeline.build("zb_h1", 2, 4)), 2, tmp_path / "zb.png", "zb_h1")
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    image = matplotlib.image.imread(path)[..., :3]
    w = np.array(matplotlib.colors.to_rgb(gantt.COLORS["W"]))
    assert np.isclose(image, w, atol=0.02).all(-1).sum() > 100  # W bars are drawn
    gpipe = gantt.draw(gantt.planned(pipeline.build("gpipe", 2, 4)), 2, tmp_path / "gpipe.png", "gpipe")
    assert np.isclose(matplotlib.image.imread(gpipe)[..., :3], w, atol=0.02).all(-1).sum() == 0  # GPipe has no W


def test_a_run_with_a_timeline_gets_planned_and_measured_charts_in_its_report(tmp_path):
    cfg = models.gpt.Config(vocab=64, dim=32, layers=4, heads=4, kv_heads=2, seq_len=8, mlp=64)
    params = models.gpt.init(core.random.key(0), cfg)
    batch = models.gpt.example_batch(cfg, 4)
    mbs = [pytree.tree_map(lambda x, i=i: x.chunk(4)[i], batch) for i in range(4)]
    schedule = pipeline.build("zb_v", 2, 4)
    result = pipeline.run(schedule, models.gpt.stages(cfg), pipeline.split(params, 4), params, mbs, [0.25] * 4)
    run = tmp_path / "run"
    run.mkdir()
    gantt.save(run / gantt.TIMELINE, schedule, result)
    saved = json.loads((run / gantt.TIMELINE).read_text())
    assert len(saved["measured"]) == len(result.timeline) and {b[3] for b in saved["measured"]} >= {"F", "B", "W",
                                                                                                  "send", "recv"}
    summary = {"layout": "pp", "mesh": {"pp": 2}, "steps": 1, "final_loss": 1.0, "tokens_per_s": 1.0,
               "comm_bytes_by_kind": {}, "comm_bytes_per_step": 0, "memory": {"params": 1, "grads": 1, "opt_state": 1},
               "memory_per_rank": 3}
    runs = [{"dir": str(run), "label": "zb_v", "records": [{"step": 1, "loss": 1.0}], "summary": summary}]
    written = write_report(runs, tmp_path / "report")
    for name in ("gantt_planned_0.png", "gantt_measured_0.png"):
        assert tmp_path / "report" / name in written
        assert (tmp_path / "report" / name).read_bytes()[:8] == PNG_SIGNATURE


def test_terapipes_chunks_are_labelled_microbatch_dot_chunk():
    schedule = pipeline.build("gpipe", 2, 2, seq_chunks=2)
    labels = [b.label for b in gantt.planned(schedule) if b.rank == 0]
    assert labels == ["F0.0", "F0.1", "F1.0", "F1.1", "B0.1", "B0.0", "B1.1", "B1.0"]
    assert gantt.idle_fraction(gantt.planned(schedule), 2) == pytest.approx(schedule.bubble())
