"""The zoo's decoders opt in to TeraPipe (``Stages.prefix_block``): llama_gqa (RoPE at the chunk's offset, the fused
kernel's causal mask over the prefix) and gpt2 (learned positions at the chunk's offset, which the executor passes to
its ``Stages.prefix_first``; its own mask: query ``i`` of a chunk sees keys ``0..offset+i``), each equal to one device
on simulated ranks under pp on Mesh(pp=2), uneven chunks, accumulation 2, clipping, 2 AdamW steps."""

import dataclasses

import pytest
import torch

import core
import tests.zoo as zoo
from shardings import Mesh, pipeline
from shardings.testing import check_equivalence


@pytest.mark.parametrize("model", ["llama_gqa", "gpt2"])
def test_decoder_with_uneven_chunks_equals_one_device(model):
    m = zoo.module(model)
    cfg = m.Config(layers=3)  # 3 blocks on 2 stages
    batch = m.example_batch(cfg, 8)
    assert set(batch) == {"tokens", "labels"}  # gpt2's chunks need no positions in the batch: prefix_first has them
    report = check_equivalence(m.init, m.loss, m.axes, cfg, batch, layouts=["pp"], mesh=Mesh(pp=2), stages=m.stages,
                               schedule="1f1b", accum_steps=2, clip_norm=0.5, steps=2, seq_chunks=2,
                               chunk_sizes=(5, 3))  # optimizer: AdamW (the default)
    assert report.ok


def test_gpt2_chunks_take_their_learned_positions_at_their_offset_with_no_batch_key():
    """A batch of tokens and labels only, cut in chunks: the chunked loss (``prefix_first`` at each chunk's offset)
    equals the whole sequences' loss; the same chunks through ``first`` alone (every chunk's positions from 0, what
    gpt2 did without a ``positions`` key) give another loss, so the offset is what the equality rests on."""
    m = zoo.module("gpt2")
    cfg = m.Config()
    params, batch, stages = m.init(core.random.key(0), cfg), m.example_batch(cfg, 2), m.stages(cfg)
    chunks, weights = pipeline.cut(batch, (5, 3)), [5 / 8, 3 / 8]
    whole = stages.loss(params, batch)
    torch.testing.assert_close(stages.chunked_loss(params, chunks, weights), whole)
    blind = dataclasses.replace(stages, prefix_first=None)
    assert (blind.chunked_loss(params, chunks, weights) - whole).abs() > 1e-4 * whole.abs()
