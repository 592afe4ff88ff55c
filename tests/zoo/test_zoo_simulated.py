"""The zoo's matrix, simulated features: check_equivalence on simulated ranks (fp32; bf16 with its fp32 twin), a
checkpoint resumed under another layout, the declared errors, and the table in docs/models.md. The cells run are
``tests.zoo.selected()``: a deterministic sample covering every model, family and feature (every cell under
``SHARDLAB_ZOO=full``, ``make test-zoo``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import tests.zoo as zoo
from experiments.train import run
from tests.experiments.conftest import compose_config
from tests.zoo import features

ROOT = Path(__file__).resolve().parents[2]
SIMULATED = [c for c in zoo.selected() if c[2] in ("simulated", "bf16", "resume") and not zoo.declared(*c)]


def _id(cell: tuple[str, str, str]) -> str:
    return " ".join(cell)


def test_the_sample_covers_every_model_family_and_feature():
    sample = zoo.sample()
    assert {c[0] for c in sample} == set(zoo.MODELS)
    assert {c[1] for c in sample} == set(zoo.LAYOUTS)
    assert {c[2] for c in sample} == set(zoo.FEATURES)
    assert set(sample) <= set(zoo.cells()) and zoo.sample() == sample  # deterministic


def test_every_zoo_model_has_the_model_contract_and_no_import_of_models():
    for name in zoo.MODELS:
        m = zoo.module(name)
        assert all(hasattr(m, f) for f in ("Config", "init", "axes", "loss", "stages", "example_batch")), name
        source = Path(m.__file__).read_text()
        assert not re.search(r"^\s*(from|import) models\b", source, re.M), f"{name} imports models/"


@pytest.mark.parametrize("cell", SIMULATED, ids=_id)
def test_zoo_cell_on_simulated_ranks(cell, tmp_path):
    model, family, feature = cell
    if feature == "resume":
        features.assert_resumed_equal(model, family, tmp_path)
    else:
        assert features.check_simulated(model, family, feature).ok


# each error declared for every family of a model's row, once (its cheapest family); a declared equivalence cell on
# real processes is tested in test_zoo_real.py, in the shared launch
DECLARED_TRAIN = [(m, min(zoo.families(m), key=lambda f: zoo._cost((m, f, x))), x)
                  for (m, f, x) in zoo.DECLARED if f == "*"]


@pytest.mark.parametrize("cell", DECLARED_TRAIN, ids=_id)
def test_a_declared_combination_gives_its_declared_error(cell, tmp_path):
    """experiments.train's loop on simulated ranks (the error is the model's and the data's, not the runtime's: on
    real processes a LaunchError names the same one)."""
    model, family, feature = cell
    want = zoo.declared(*cell)
    assert feature == "train", "a declared error of another feature needs its runner here"
    with pytest.raises(want.error, match=re.escape(want.match)):
        run(compose_config("train", features.train_overrides(model, family, runtime="simulate")), str(tmp_path))


# a declared cell of a simulated feature: run by its own runner, where the full matrix runs it
DECLARED_SIMULATED = sorted(c for c in zoo.DECLARED if c[1] != "*" and c[2] in ("simulated", "bf16"))


@pytest.mark.skipif(not zoo._full(), reason="minutes on 8 simulated ranks: the full matrix (make test-zoo) runs it")
@pytest.mark.parametrize("cell", DECLARED_SIMULATED, ids=_id)
def test_a_declared_simulated_cell_gives_its_declared_error(cell):
    """When this fails, the gap is closed: drop its entry from tests/zoo/__init__.py's DECLARED."""
    want = zoo.declared(*cell)
    with pytest.raises(want.error, match=re.escape(want.match)):
        features.check_simulated(*cell)


def test_docs_models_md_shows_the_zoo_table():
    text = (ROOT / "docs" / "models.md").read_text()
    found = re.search(r"<!-- zoo-table:begin -->\n(.*?)\n<!-- zoo-table:end -->", text, re.S)
    assert found, "docs/models.md lost its zoo table markers"
    assert found.group(1) == zoo.zoo_table(), (
        "docs/models.md's zoo table is out of date. Fix: replace it with the output of "
        "`python -c 'import tests.zoo as z; print(z.zoo_table())'`")
