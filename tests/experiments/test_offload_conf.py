"""The ``offload`` group: each member builds the layout (``+offload_optimizer``/``+offload_params``) or the
model config (``remat="offload"``) the step gets; a run with optimizer offload records its host copies."""

import json

import pytest

from experiments.build import ConfigError, build
from experiments.train import run

TINY = ["model=gpt_tiny", "model.config.dim=32", "model.config.layers=1", "model.config.mlp=64",
        "model.config.seq_len=16", "data.batch_size=4", "data.max_bytes=200000", "progress=false", "steps=2",
        "layout=zero3", "mesh=dp2", "runtime=simulate"]


@pytest.mark.parametrize(("member", "layout"), [("none", "zero3+tp"), ("optimizer", "zero3+tp+offload_optimizer"),
                                                ("params", "zero3+tp+offload_params"), ("activations", "zero3+tp")])
def test_offload_members_build_the_layout_and_model(compose_train, member, layout):
    setup = build(compose_train(f"offload={member}", "runtime=simulate"))
    assert setup.layout.name == layout
    assert setup.model_cfg.remat == ("offload" if member == "activations" else False)


def test_offload_composes_with_a_layout_that_already_offloads(compose_train):
    setup = build(compose_train("layout=zero2+offload_optimizer", "offload=optimizer", "offload.params=true",
                                "mesh=dp4", "runtime=simulate"))
    assert setup.layout.name == "zero2+offload_optimizer+offload_params"


def test_offload_activations_needs_a_model_with_remat(compose_train):
    with pytest.raises(ConfigError, match=r"offload=activations: model models.mlp has no remat.*Fix:"):
        build(compose_train("model=mlp", "offload=activations", "layout=zero3", "mesh=dp4"))


def test_optimizer_offload_run_records_host_copies(compose_train, tmp_path):
    summary = run(compose_train(*TINY, "offload=optimizer"), str(tmp_path))
    assert summary["layout"] == "zero3+offload_optimizer"
    first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    host = {r["kind"]: r["bytes"] for r in first["comm"] if r["axis"] == "host"}
    assert set(host) == {"d2h", "h2d"} and min(host.values()) > 0
    # the optimizer state lives on the host: counted once in the rank's total, and named as host memory
    assert first["memory"]["host"] == first["memory"]["opt_state"] > 0
    assert first["memory_per_rank"] == sum(v for k, v in first["memory"].items() if k != "host")
