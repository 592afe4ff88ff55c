"""The ``precision`` and ``offload`` groups: members compose into the policy the step gets; bad values fail
with a fix; mixed-precision runs write their policy and (fp16) loss scale to summary.json and metrics.jsonl."""

import json

import pytest
import torch
from hydra.errors import ConfigCompositionException

from core.precision import DynamicLossScale, Policy
from experiments.build import ConfigError, build
from experiments.config import OFFLOADS, PRECISIONS
from experiments.train import run

TINY = ["model=gpt_tiny", "model.config.dim=32", "model.config.layers=1", "model.config.mlp=64",
        "model.config.seq_len=16", "data.batch_size=4", "data.max_bytes=200000", "progress=false", "steps=3",
        "layout=zero3", "mesh=dp2", "runtime=simulate"]


def test_members_are_the_documented_ones(compose_train):
    assert sorted(PRECISIONS) == ["bf16", "fp16", "fp32"]
    assert sorted(OFFLOADS) == ["activations", "none", "optimizer", "params"]
    cfg = compose_train()
    assert (cfg.precision.compute, cfg.offload.optimizer, cfg.offload.params, cfg.offload.activations) == (
        "float32", False, False, False)


@pytest.mark.parametrize(("member", "policy"), [("fp32", None), ("bf16", Policy.bf16_mixed()),
                                                ("fp16", Policy.fp16_mixed())])
def test_precision_members_build_their_policy(compose_train, member, policy):
    setup = build(compose_train(f"precision={member}", "runtime=simulate"))
    assert setup.precision == policy
    if member == "fp16":
        assert setup.precision.scaler == DynamicLossScale()  # initial scale 2^16, as DeepSpeed's loss_scale: 0


def test_make_train_default_stays_fp32(compose_train):
    """``make train`` runs the default config: no policy at all, so the step is the fp32 reference's."""
    cfg = compose_train()
    assert build(cfg).precision is None and build(cfg).layout.name == "zero3+tp"
    assert not build(cfg).model_cfg.remat


def test_precision_fields_override_and_force_the_loss_scale(compose_train):
    setup = build(compose_train("precision=bf16", "precision.reduce=bf16", "runtime=simulate"))
    assert setup.precision == Policy(compute_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    assert build(compose_train("precision=fp16", "precision.loss_scale=false")).precision.scaler is None
    assert build(compose_train("precision=bf16", "precision.loss_scale=true")).precision.scaler == DynamicLossScale()


def test_unknown_member_or_dtype_says_what_exists(compose_train):
    with pytest.raises(ConfigCompositionException, match=r"(?s)precision/fp8.*bf16\n\tfp16\n\tfp32"):
        compose_train("precision=fp8")
    offloads = r"(?s)offload/disk.*activations\n\tnone\n\toptimizer\n\tparams"
    with pytest.raises(ConfigCompositionException, match=offloads):
        compose_train("offload=disk")
    with pytest.raises(ConfigError, match=r"precision: .*unknown dtype 'fp8'.*Fix: use one of"):
        build(compose_train("precision.compute=fp8"))


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_bf16_run_records_its_policy_and_no_loss_scale(compose_train, tmp_path):
    summary = run(compose_train(*TINY, "precision=bf16"), str(tmp_path))
    assert summary["precision"] == "params=float32,compute=bfloat16,reduce=float32"
    records = _records(tmp_path)
    assert len(records) == 3 and not {"loss_scale", "skipped_steps"} & set(records[0])
    assert records[0]["memory"]["compute"] > 0  # the compute-dtype copies are counted


def test_fp16_run_records_loss_scale_and_skipped_steps_each_step(compose_train, tmp_path):
    run(compose_train(*TINY, "precision=fp16"), str(tmp_path))
    records = _records(tmp_path)
    assert len(records) == 3
    for r in records:
        # the scale the next step uses: 2^16 halved once per skipped step (3 steps: no growth yet)
        assert r["loss_scale"] == 2.0**16 / 2 ** r["skipped_steps"]
    assert [r["skipped_steps"] for r in records] == sorted(r["skipped_steps"] for r in records)
