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
