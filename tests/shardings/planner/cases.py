"""Cases the planner tests share (a module of cases, not a test file): a small gpt and a one-node cluster."""

import models
from shardings.planner import Cluster, Link

CFG = models.gpt.Config(vocab=64, dim=32, layers=4, heads=4, kv_heads=2, mlp=64, seq_len=16)


def cluster(world: int) -> Cluster:
    """One node of ``world`` ranks with round numbers (1e11 FLOP/s float32, 1e9 B/s links)."""
    return Cluster("test", 1, world, 1e12, {"float32": 1e11}, 1.0, 1e10, 1e-5, 1e-4, False, Link(1e-4, 1e9),
                   Link(1e-4, 1e9), 1e10)
