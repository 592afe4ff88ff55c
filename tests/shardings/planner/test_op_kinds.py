"""The fake step counts each op by kind, the three a cluster prices apart (``Cluster.op_overhead``,
``dtensor_overhead``, ``data_dtensor_overhead``): on plain tensors, on DTensors laid out over a model-parallel axis,
and on DTensors laid out over data axes only (a pipeline stage's)."""

import models
from experiments.plan import load_cluster
from shardings.planner import Candidate, plan

CFG = models.gpt.Config(vocab=64, dim=16, layers=2, heads=4, kv_heads=4, mlp=32, seq_len=16)


def test_ops_are_counted_by_the_kind_of_tensor_they_run_on():
    cands = [Candidate("dp", (("dp", 2),)), Candidate("tp", (("tp", 2),)),
             Candidate("dp+pp", (("pp", 2), ("dp", 2)), 2, "1f1b")]
    ranking = plan(models.gpt, CFG, (8, CFG.seq_len), load_cluster("this"), candidates=cands, top_k=3, budget_s=1e9)
    dp, tp, pp = (ranking.row(c).prediction for c in cands)
    assert dp.ops["local"] > 0 and dp.ops["dtensor"] == dp.ops["dtensor_data"] == 0  # the local path
    assert tp.ops["dtensor"] > 0  # weights sharded over tp
    assert pp.ops["dtensor_data"] > 0 and pp.ops["dtensor"] == 0  # the stage's DTensors: over dp only
    # a replica's two stages together: more than the busiest rank's work, less than twice it (the head on one)
    assert pp.ops["local"] < pp.replica.ops["local"] < 2 * pp.ops["local"]
