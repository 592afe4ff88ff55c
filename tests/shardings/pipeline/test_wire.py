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


def test_a_message_is_laid_out_as_its_template_says_whatever_layout_the_carry_came_in():
    """A carry leaf laid out otherwise than its carry_names (an aux loss made from ``torch.zeros(b)`` is replicated
    where the names say ``("batch",)``; an input gradient comes out ``Partial``) is redistributed before it is
    packed: sent as it was, its bytes disagreed with the receiver's (gloo: "Received data size doesn't match") or,
    of equal size, were read as another layout (the zoo's gpt2 under zero3+tp+pp got garbage gradients)."""
    import torch
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    import shardings
    from shardings import Mesh
    from shardings.pipeline.wire import Template

    x, aux = torch.arange(24.0).reshape(4, 3, 2), torch.arange(4.0)
    with shardings.simulate(2):
        dm = Mesh(dp=2).device_mesh
        as_named = [[Shard(0)], [Shard(0)]]
        template = Template((x, aux), as_named, dm)
        assert template.nbytes == (12 + 2) * 4
        for came_in in ([Shard(0)], [Replicate()]):
            payload = [DTensor.from_local(x, dm, [Replicate()]).redistribute(dm, came_in),
                       DTensor.from_local(aux, dm, [Replicate()])]
            got = template.conform(payload)
            assert [g.placements for g in got] == [(Shard(0),), (Shard(0),)]
            assert torch.equal(shardings.unwrap(got[0].full_tensor()), x)
            assert torch.equal(shardings.unwrap(got[1].full_tensor()), aux)
            assert template.pack(tuple(payload)).numel() == template.nbytes  # what the receiver posts for
        halves = DTensor.from_local(torch.stack([aux / 2, aux / 2], 1), dm, [Replicate()]).redistribute(dm, [Shard(1)])
        partial = halves.sum(1)  # each rank's half of the sum
        assert partial.placements == (Partial(),)
        got = template.conform([DTensor.from_local(x, dm, [Replicate()]), partial])
        assert got[1].placements == (Shard(0),) and torch.equal(shardings.unwrap(got[1].full_tensor()), aux)
        plain = template.conform([x, aux])  # a plain leaf counts as replicated
        assert torch.equal(shardings.unwrap(plain[1].full_tensor()), aux)
