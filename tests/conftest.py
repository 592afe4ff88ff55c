"""Strict, deterministic test configuration shared by the whole suite."""

import os

import torch
from hypothesis import HealthCheck, settings

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
settings.register_profile("explore", deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

torch.set_default_dtype(torch.float32)
# Two cores shared by pytest-xdist workers (and simulated ranks): one intra-op thread per worker
# avoids oversubscription, which made DTensor-heavy tests several times slower.
torch.set_num_threads(1)
