"""shardings.pipeline.run on real gloo processes: the same results as simulated ranks, bitwise; P2P per rank as
the formula; every rank's timeline gathered (the bubble is measured from it). One launch checks everything."""

import torch
from torch.utils import _pytree as pytree

import models
from shardings import Mesh, comms, launch, pipeline
from tests.shardings.pipeline.cases import real_rank_inputs

CFG = models.gpt.Config(vocab=64, dim=32, layers=5, heads=4, kv_heads=2, seq_len=8, mlp=64)  # 5 layers, 4 stages
PP, M = 4, 4


def _rank(schedule: str) -> dict:
    params, mbs, weights = real_rank_inputs()
    mesh = Mesh(pp=PP)
    assert mesh.device_mesh is not None
    with comms() as c:
        result = pipeline.run(pipeline.build(schedule, PP, M), models.gpt.stages(CFG), pipeline.split(params, PP),
                              params, mbs, weights, mesh=mesh)
    return {"loss": result.loss, "grads": result.grads, "comm": c.rows(), "timeline": len(result.timeline),
            "bubble": result.bubble(), "peaks": result.saved_peak}


def _both() -> dict:  # one launch for both schedules (a launch costs seconds)
    return {name: _rank(name) for name in ("gpipe", "1f1b")}


def test_real_ranks_equal_simulated_bitwise_and_count_their_sends():
    per_rank = launch(_both, PP)
    params, mbs, weights = real_rank_inputs()
    split = pipeline.split(params, PP)
    one = (2 * M // M) * CFG.seq_len * CFG.dim * 4  # b/m · s · h float32
    for name in ("gpipe", "1f1b"):
        want = pipeline.run(pipeline.build(name, PP, M), models.gpt.stages(CFG), split, params, mbs, weights)
        ranks = [r[name] for r in per_rank]
        for r in ranks:
            assert torch.equal(r["loss"], want.loss)
        # each leaf is used by one stage (untied embedding): the sum over ranks is its owner's gradient, exactly
        summed = pytree.tree_map(lambda *g: sum(g[1:], g[0]), *[r["grads"] for r in ranks])
        for got, w in zip(pytree.tree_leaves(summed), pytree.tree_leaves(want.grads)):
            assert torch.equal(got, w)
        # stage 0 sends m activations, the last stage m gradients, the others both
        for stage, r in enumerate(ranks):
            sends = M * ((stage < PP - 1) + (stage > 0))
            assert [c for c in r["comm"] if c["kind"] == "send"] == [
                {"kind": "send", "axis": "pp", "count": sends, "bytes": sends * one}]
            # besides: one object gather of every rank's timeline, peak and loss (its sizes, then its bytes)
            assert {(c["kind"], c["count"]) for c in r["comm"] if c["kind"] != "send"} == {("all_gather", 2)}
            assert r["timeline"] == sum(len(a) for a in pipeline.build(name, PP, M).ranks)
            assert len(r["bubble"]) == PP and all(0 < b < 1 for b in r["bubble"])
        assert ranks[0]["peaks"] == ranks[-1]["peaks"]  # gathered: every rank sees all
