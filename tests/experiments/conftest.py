"""Composing the experiment apps' configs in tests (Hydra's compose API, no run directory)."""

from collections.abc import Sequence

import pytest
from hydra import compose, initialize
from omegaconf import DictConfig

from experiments.config import app_overrides, own_model, register


def compose_config(name: str, overrides: Sequence[str] = ()) -> DictConfig:
    """The ``train`` or ``equivalence`` config with Hydra overrides, as the apps would compose it."""
    register()
    overrides = app_overrides(overrides)
    with initialize(version_base="1.3", config_path=None):
        return own_model(compose(name, overrides=overrides), overrides)


@pytest.fixture(scope="module")
def compose_train():
    """``compose_train(*overrides)`` inside one Hydra context for the whole module (composing is ~0.2 s)."""
    register()
    with initialize(version_base="1.3", config_path=None):
        yield lambda *overrides: compose("train", overrides=list(overrides))
