"""The command line takes a layout as a string: a composition in any order, as Python does (``layout=sp+tp`` is
``tp+sp``), checked at build with the nearest name for a typo; nothing is registered when the app is imported."""

import subprocess
import sys

from experiments.build import build
from experiments.equivalence import main as equivalence
from tests.experiments.conftest import compose_config


def test_a_composition_in_any_order_composes_and_builds():
    cfg = compose_config("train", ["layout=sp+tp", "mesh=tp2", "model=mlp", "runtime=simulate"])
    assert cfg.layout == "sp+tp" and build(cfg).layout.name == "tp+sp"
    assert build(compose_config("train", ["layout=tp+zero3+sp", "mesh=dp2_tp2"])).layout.name == "zero3+tp+sp"


def test_the_equivalence_cli_takes_any_order(capsys):
    assert equivalence(["layout=sp+tp", "mesh=tp2", "steps=1"]) == 0
    assert "under 'tp+sp'" in capsys.readouterr().out


def test_a_misspelled_layout_is_refused_with_the_nearest_preset(capsys):
    assert equivalence(["layout=sp+tpp", "mesh=tp2"]) == 2
    err = capsys.readouterr().err
    assert "unknown layout preset 'tpp'" in err and "did you mean 'tp'?" in err and "Fix: use presets from" in err


def test_importing_the_apps_registers_nothing():
    code = ("import experiments.train, experiments.equivalence\n"
            "from hydra.core.config_store import ConfigStore\n"
            "print(sorted(ConfigStore.instance().repo))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert "train" not in out and "model" not in out, out
