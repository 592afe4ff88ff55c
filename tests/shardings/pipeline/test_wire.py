"""The message layouts of real-rank pipelines: computed once per stages, split and input shapes (cached)."""

import core
import models.gpt
from shardings import pipeline
from shardings.pipeline.wire import cached_templates

CFG = models.gpt.Config(vocab=64, dim=32, layers=4, heads=4, kv_heads=2, seq_len=8, mlp=64)


def test_templates_are_cached_per_stages_split_and_shapes():
    params, stages = models.gpt.init(core.random.key(0), CFG), models.gpt.stages(CFG)
    split, batch = pipeline.split(params, 2), models.gpt.example_batch(CFG, 2)
    first = cached_templates(stages, split, params, batch)
    assert [t.global_shapes for t in first] == [[(2, CFG.seq_len, CFG.dim)]]
    assert cached_templates(stages, split, params, models.gpt.example_batch(CFG, 2, seed=1)) is first  # same shapes
    wider = cached_templates(stages, split, params, models.gpt.example_batch(CFG, 3))
    assert [t.global_shapes for t in wider] == [[(3, CFG.seq_len, CFG.dim)]]
    assert cached_templates(stages, pipeline.split(params, 4), params, batch) is not first  # another split
    assert cached_templates(models.gpt.stages(CFG), split, params, batch) is not first  # other stage functions


def test_templates_run_constants_the_stages_make_and_blocks_held_by_other_ranks():
    """The issue's crash: rotary tables from ``torch.arange`` inside the stages met meta tensors (``Tensor on device
    cpu is not on the expected device meta``). Templates run on fake tensors of the real device, and a block another
    rank holds (a meta placeholder on this rank) is faked on that device too."""
    from tests.zoo import llama_gqa

    cfg = llama_gqa.Config(layers=4)
    params, stages = llama_gqa.init(core.random.key(0), cfg), llama_gqa.stages(cfg)
    params["blocks"][3] = {k: v.to("meta") for k, v in params["blocks"][3].items()}  # another rank's block
    out = cached_templates(stages, pipeline.split(params, 4), params, llama_gqa.example_batch(cfg, 2))
    assert [t.global_shapes for t in out] == [[(2, cfg.seq_len, cfg.dim)]] * 3
    assert all(t.nbytes == 2 * cfg.seq_len * cfg.dim * 4 for t in out)
