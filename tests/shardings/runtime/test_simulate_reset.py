"""A runtime that ended leaves nothing behind: the next simulate() sees only its own meshes."""

import torch

import shardings
from shardings import Mesh, P


def test_a_second_simulate_gets_outputs_on_its_own_mesh():
    """DTensor's propagation caches key on equal meshes: without clearing them at exit, an op in the second session
    returned a spec holding the first session's DeviceMesh (and bucket plans keyed on it split the ep grads)."""
    for _ in range(2):
        with shardings.simulate(4):
            mesh = Mesh(dp=4)
            y = (shardings.shard(torch.randn(8, 4), P("dp"), mesh) * 2).sum(0)
            assert y.device_mesh is mesh.device_mesh


def test_simulated_ranks_get_a_real_ranks_threads_and_give_them_back(monkeypatch):
    """Inside simulate(n) torch's intra-op threads are what one of n real ranks gets (cores // n, at least one),
    never more than the caller had; on exit the caller's count again."""
    from shardings.runtime import simulate as sim

    monkeypatch.setattr(sim.os, "cpu_count", lambda: 8)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        seen = {}
        for n in (2, 4, 16):
            with shardings.simulate(n):
                seen[n] = torch.get_num_threads()
            assert torch.get_num_threads() == 4
        assert seen == {2: 4, 4: 2, 16: 1}
    finally:
        torch.set_num_threads(before)
