"""Strict, deterministic test configuration shared by the whole suite."""

import os

import torch
from hypothesis import HealthCheck, register_random, settings

# Deterministic by default (CI and local runs see the same examples); HYPOTHESIS_PROFILE=explore
# searches with fresh randomness and more examples when hunting bugs.
settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=25,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "explore", deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

torch.set_default_dtype(torch.float32)
# Two cores shared by pytest-xdist workers (and simulated ranks): one intra-op thread per worker
# avoids oversubscription, which made DTensor-heavy tests several times slower.
torch.set_num_threads(1)


class _TorchGlobalRandom:
    """torch's global RNG in the shape hypothesis manages (seed/getstate/setstate). Registered, every example
    starts from the same torch state, so a failing example replays with the same tensors; unregistered, a
    test drawing tensors with ``torch.randn`` saw new values on the replay and failed as ``FlakyFailure``."""

    def seed(self, n: int) -> None:
        torch.manual_seed(n)

    def getstate(self) -> torch.Tensor:
        return torch.get_rng_state()

    def setstate(self, state: torch.Tensor) -> None:
        torch.set_rng_state(state)


_TORCH_RANDOM = _TorchGlobalRandom()  # hypothesis keeps a weak reference only
register_random(_TORCH_RANDOM)
