"""Interleaved 1F1B, ZB-H1 and ZB-V on real gloo processes: the same loss and gradients as simulated ranks,
bitwise (W after B across processes, ZB-V's turn handed over in process), and the messages each rank sends."""

import torch
from torch.utils import _pytree as pytree

import core
import models
from shardings import Mesh, comms, launch, pipeline
from tests.shardings.pipeline.cases import real_rank_inputs as _inputs4

CFG = models.gpt.Config(vocab=64, dim=32, layers=4, heads=4, kv_heads=2, seq_len=8, mlp=64)  # 4 stages of 1 block
PP, M = 2, 4
NAMES = ("interleaved_1f1b", "zb_h1", "zb_v")


def _inputs():
    params = models.gpt.init(core.random.key(0), CFG)
    _, mbs, weights = _inputs4()  # the same batch shapes: seq_len and vocab agree
    return params, mbs, weights


def _rank() -> dict:
    params, mbs, weights = _inputs()
    out = {}
    for name in NAMES:
        schedule = pipeline.build(name, PP, M)
        with comms() as c:
            result = pipeline.run(schedule, models.gpt.stages(CFG), pipeline.split(params, schedule.stages), params,
                                  mbs, weights, mesh=Mesh(pp=PP))
        out[name] = {"loss": result.loss, "grads": result.grads, "sends": [r for r in c.rows() if r["kind"] == "send"],
                     "bubble": result.bubble()}
    return out


def test_new_schedules_on_real_ranks_equal_simulated_bitwise():
    per_rank = launch(_rank, PP)
    params, mbs, weights = _inputs()
    one = (2 * M // M) * CFG.seq_len * CFG.dim * 4  # b/m · s · h float32
    for name in NAMES:
        schedule = pipeline.build(name, PP, M)
        want = pipeline.run(schedule, models.gpt.stages(CFG), pipeline.split(params, schedule.stages), params, mbs,
                            weights)
        ranks = [r[name] for r in per_rank]
        for r in ranks:
            assert torch.equal(r["loss"], want.loss), name
            assert len(r["bubble"]) == PP
        summed = pytree.tree_map(lambda *g: sum(g[1:], g[0]), *[r["grads"] for r in ranks])
        for got, w in zip(pytree.tree_leaves(summed), pytree.tree_leaves(want.grads)):
            assert torch.equal(got, w), name
        # a message per boundary crossing ranks, microbatch and direction; ZB-V's turn (stage 1 -> 2) stays on rank 1
        crossing = sum(schedule.rank_of(s) != schedule.rank_of(s + 1) for s in range(schedule.stages - 1))
        sent = sum(row["count"] for r in ranks for row in r["sends"])
        assert sent == 2 * M * crossing == len(want.p2p), name
        assert {row["bytes"] // row["count"] for r in ranks for row in r["sends"]} == {one}
