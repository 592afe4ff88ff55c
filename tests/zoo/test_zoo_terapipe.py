"""The zoo's decoders opt in to TeraPipe (``Stages.prefix_block``): llama_gqa (RoPE at the chunk's offset, the fused
kernel's causal mask over the prefix) and gpt2 (learned positions from the batch's ``positions``, its own mask: query
``i`` of a chunk sees keys ``0..offset+i``), each equal to one device on simulated ranks under pp on Mesh(pp=2),
uneven chunks, accumulation 2, clipping, 2 AdamW steps."""

import pytest
import torch

import tests.zoo as zoo
from shardings import Mesh
from shardings.testing import check_equivalence


@pytest.mark.parametrize("model", ["llama_gqa", "gpt2"])
def test_decoder_with_uneven_chunks_equals_one_device(model):
    m = zoo.module(model)
    cfg = m.Config(layers=3)  # 3 blocks on 2 stages
    batch = m.example_batch(cfg, 8)
    if model == "gpt2":  # learned positions: each chunk brings its own (pipeline.cut slices them with the tokens)
        batch["positions"] = torch.arange(cfg.seq_len).expand_as(batch["tokens"]).contiguous()
    report = check_equivalence(m.init, m.loss, m.axes, cfg, batch, layouts=["pp"], mesh=Mesh(pp=2), stages=m.stages,
                               schedule="1f1b", accum_steps=2, clip_norm=0.5, steps=2, seq_chunks=2,
                               chunk_sizes=(5, 3))  # optimizer: AdamW (the default)
    assert report.ok
