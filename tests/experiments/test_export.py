"""experiments.export: a sharded checkpoint → a Hugging Face Llama folder that transformers loads, same logits."""

import dataclasses

import pytest
import torch
from transformers import LlamaForCausalLM

import core
import models.gpt as gpt
import shardings
from experiments import export
from shardings import Mesh, checkpoint
from shardings.testing import assert_close


@pytest.mark.parametrize("tie", [False, True])
def test_export_of_a_sharded_checkpoint_loads_in_transformers_with_the_same_logits(tmp_path, tie):
    cfg = gpt.Config(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, mlp=64, seq_len=8, tie_embeddings=tie)
    with shardings.simulate(2):
        params = shardings.init(gpt.init, core.random.key(3), cfg, axes=gpt.axes(cfg), layout="zero3+tp",
                                mesh=Mesh(dp=1, tp=2))
        experiment = {"model": {"name": "gpt", "config": dataclasses.asdict(cfg)}, "layout": {"name": "zero3+tp"}}
        checkpoint.save(tmp_path / "ckpt", {"params": params, "config": experiment}, step=9)

    assert export.main([str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    tokens = gpt.example_batch(cfg, 2, seed=1)["tokens"]
    want = gpt.apply(gpt.init(core.random.key(3), cfg), tokens, cfg)
    with torch.no_grad():
        got = hf(tokens).logits
    assert_close(got, want)

    params_back, cfg_back = export.from_hf_dir(tmp_path / "hf")  # and back: training can start from it
    assert cfg_back == dataclasses.replace(cfg, head_dim=cfg.d_head)  # the same model, head_dim made explicit
    torch.testing.assert_close(gpt.apply(params_back, tokens, cfg_back), want, rtol=0, atol=0)


def test_a_checkpoint_without_a_model_config_exits_2_with_a_fix(tmp_path, capsys):
    checkpoint.save(tmp_path, {"params": {"w": torch.zeros(2)}}, step=1)
    assert export.main([str(tmp_path), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "records no model config" in err and "Fix:" in err


def test_params_that_do_not_match_the_config_name_the_key_path(tmp_path, capsys):
    cfg = gpt.Config(vocab=64, dim=32, layers=1, heads=4, mlp=64, seq_len=8)
    params = gpt.init(core.random.key(0), dataclasses.replace(cfg, mlp=96))
    checkpoint.save(tmp_path, {"params": params, "config": dataclasses.asdict(cfg)}, step=1)
    assert export.main([str(tmp_path), str(tmp_path / "hf")]) == 2
    assert "['params']['blocks'][0]['w_" in capsys.readouterr().err


def test_no_checkpoint_exits_2(tmp_path, capsys):
    assert export.main([str(tmp_path / "nothing"), str(tmp_path / "hf")]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err
