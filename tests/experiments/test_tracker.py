"""The tracker: a run's scalars per step and its config as hparams, read back from its TensorBoard event files."""

import json

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

from experiments.train import run
from tests.experiments.conftest import compose_config

RUN = ["model=mlp", "layout=zero3", "mesh=dp2", "runtime=simulate", "steps=3", "progress=false",
       "data.max_bytes=200000", "optim.warmup_steps=1"]


def test_a_run_logs_its_scalars_and_its_config_as_hparams(tmp_path):
    run(compose_config("train", RUN), str(tmp_path))
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "comm/dp", "memory/held_per_rank"} <= tags
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for tag, key in (("loss", "loss"), ("tokens_per_s", "tokens_per_s"), ("memory/held_per_rank", "memory_per_rank")):
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        assert got == [(r["step"], float(r[key])) for r in records] or all(  # float32 in the event file
            s == r["step"] and abs(v - r[key]) <= 1e-6 * abs(r[key]) for (s, v), r in zip(got, records, strict=True))
    # warmup over 1 step to 3e-3, then cosine to 10%: half-way at the last step, (3e-3 + 3e-4) / 2
    assert [round(e.value, 6) for e in events.Scalars("lr")] == [0.0, 0.003, 0.00165]
    comm = [sum(row["bytes"] for row in r["comm"] if row["axis"] == "dp") for r in records]
    assert [e.value for e in events.Scalars("comm/dp")] == comm

    content = events.PluginTagToContent("hparams")
    session = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info
    assert session.hparams["layout"].string_value == "zero3" and session.hparams["steps"].number_value == 3
    assert session.hparams["optim.lr"].number_value == 0.003 and session.hparams["mesh.sizes.dp"].number_value == 2


def test_tracker_false_writes_no_event_file(tmp_path):
    run(compose_config("train", [*RUN, "steps=1", "tracker=false"]), str(tmp_path))
    assert not list(tmp_path.glob("events.out.tfevents.*"))
