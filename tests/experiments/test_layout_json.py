"""A run leaves layout.json (``shardings.describe_layout``), and the report draws layout_<i>.png from it."""

import json

from experiments.report import main as report
from experiments.train import run
from tests.experiments.conftest import compose_config

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_a_short_run_writes_layout_json_and_the_report_draws_it(tmp_path, capsys):
    out = tmp_path / "run"
    run(compose_config("train", ["model=mlp", "layout=zero3", "mesh=dp2", "runtime=simulate", "steps=2",
                                 "data.max_bytes=200000", "progress=false"]), str(out))
    view = json.loads((out / "layout.json").read_text())
    assert view["layout"] == "zero3" and view["mesh"] == {"dp": 2}
    rows = {r["group"]: r for r in view["rows"]}
    assert rows["blocks[0,1].w_up"]["count"] == 2 and rows["blocks[0,1].w_up"]["specs"]["params"] == ["dp", None]
    assert rows["blocks[0,1].w_up"]["shares"] == {"params": 0.5, "compute": 1.0, "grads": 0.5, "opt_state": 0.5}
    assert {c["kind"] for c in view["comm"]} >= {"all_gather", "reduce_scatter"}  # the step's collectives

    assert report([str(tmp_path)]) == 0
    assert (tmp_path / "layout_0.png").read_bytes()[:8] == PNG_SIGNATURE
    assert "layout_0.png" in capsys.readouterr().out
