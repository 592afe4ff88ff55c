"""The command line takes a layout composition in any order, as Python does (``layout=sp+tp`` is ``tp+sp``)."""

import pytest
from hydra import compose, initialize

from experiments.build import build
from experiments.config import register
from experiments.equivalence import main as equivalence


@pytest.fixture(autouse=True)
def _forget_the_spellings():
    """The ConfigStore is process-wide: leave it holding only the canonical members for the other tests."""
    members = register().repo["layout"]
    before = dict(members)
    yield
    members.clear()
    members.update(before)


def test_a_composition_in_any_order_composes_and_builds():
    overrides = ["layout=sp+tp", "mesh=tp2", "model=mlp", "runtime=simulate"]
    register(overrides)
    with initialize(version_base="1.3", config_path=None):
        cfg = compose("train", overrides=overrides)
        assert build(cfg).layout.name == "tp+sp"
        # a sweep's values too (Hydra composes every job of a multirun before the first runs)
        register(["layout=dp,tp+zero3+sp"])
        assert compose("train", overrides=["layout=tp+zero3+sp"]).layout.name == "zero3+tp+sp"


def test_the_equivalence_cli_takes_any_order(capsys):
    assert equivalence(["layout=sp+tp", "mesh=tp2", "steps=1"]) == 0
    assert "under 'tp+sp'" in capsys.readouterr().out


def test_a_misspelled_layout_is_still_refused(capsys):
    assert equivalence(["layout=sp+tpp", "mesh=tp2"]) == 2
    assert "layout" in capsys.readouterr().err
