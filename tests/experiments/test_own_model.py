"""Your model from the CLI (#29 item 3): ``model.name=pkg.module`` builds that module's ``Config`` from its own
fields and the ``model.config.*`` given with it — never the default model's — in both apps; an unknown name says
module paths are accepted. The model lives in a temporary folder, not in the repo."""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from experiments import equivalence
from experiments.build import ConfigError, build, optimizer
from tests.experiments.conftest import compose_config

# A bigram model whose Config shares no field name with gpt_tiny's but vocab/seq_len, and has none of norm_eps, dim.
_MODEL = '''
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import core
from shardings import constrain


@dataclass
class Config:
    vocab: int = 256
    width: int = 16
    seq_len: int = 8
    scale: float = 0.5


def init(key, cfg):
    k1, k2 = core.random.split(key)
    return {"table": core.random.normal(k1, (cfg.vocab, cfg.width)) * cfg.scale,
            "out": core.random.normal(k2, (cfg.width, cfg.vocab)) * 0.02}


def axes(cfg):
    return {"table": ("vocab", "embed"), "out": ("embed", "vocab")}


def loss(params, batch, cfg):
    x = constrain(F.embedding(constrain(batch["tokens"], ("batch", "seq")), params["table"]),
                  ("batch", "seq", "embed"))
    logits = constrain(torch.tanh(x) @ params["out"], ("batch", "seq", "vocab"))
    labels = constrain(batch["labels"], ("batch", "seq"))
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))


def example_batch(cfg, batch_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab, (batch_size, cfg.seq_len + 1), generator=g)
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
'''


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """``scratch.enc``: a package in a temporary folder on ``sys.path``."""
    package = tmp_path / "pkgs" / "scratch"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "enc.py").write_text(textwrap.dedent(_MODEL))
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    yield "scratch.enc"
    for name in ("scratch.enc", "scratch"):
        sys.modules.pop(name, None)


def test_the_config_is_the_modules_own_with_the_given_fields_only(scratch):
    setup = build(compose_config("train", ["model=gpt_tiny", f"model.name={scratch}", "model.config.width=8",
                                           "layout=dp", "mesh=dp2"]))
    assert type(setup.model_cfg).__module__ == scratch
    assert (setup.model_cfg.width, setup.model_cfg.scale, setup.model_cfg.seq_len) == (8, 0.5, 8)  # not gpt_tiny's 64
    with pytest.raises(ConfigError, match=r"set only fields of scratch.enc.Config: \['vocab', 'width'"):
        build(compose_config("train", [f"model.name={scratch}", "model.config.norm_eps=1e-6", "layout=dp",
                                       "mesh=dp2"]))


def test_the_equivalence_cli_checks_it(scratch, capsys):
    assert equivalence.main([f"model.name={scratch}", "model.config.width=8", "layout=zero3+tp", "mesh=dp2_tp2",
                             "steps=2"]) == 0, capsys.readouterr()
    assert "OK:" in capsys.readouterr().out


def test_the_train_app_trains_it(scratch, tmp_path):
    # The app itself (Hydra's entry point finds its config folder only as a script): a child process with the
    # temporary folder on its PYTHONPATH.
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "pkgs"), *sys.path])}
    proc = subprocess.run([sys.executable, "-m", "experiments.train", f"model.name={scratch}", "model.config.width=8",
                           "layout=zero3", "mesh=dp2", "runtime=simulate", "steps=2", "data.max_bytes=20000",
                           "data.batch_size=4", "progress=false", f"hydra.run.dir={run_dir}"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((run_dir / "status.json").read_text())["status"] == "ran"
    records = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(records) == 2 and json.loads(records[0])["tokens"] == 4 * 8  # the module's own seq_len
    assert "width: 8" in (run_dir / "config.yaml").read_text() and "heads" not in (run_dir / "config.yaml").read_text()


@pytest.mark.parametrize(("name", "says"), [
    ("enc", "model.name=enc: cannot import it (No module named 'enc'). Fix: use one of ['gpt', 'mlp', 'moe'] or a "
            "module path like `mypkg.my_model` (or a top-level `my_model`) whose module has "
            "Config/init/axes/loss/example_batch, importable from sys.path (PYTHONPATH)."),
    ("no_such_pkg.enc", "model.name=no_such_pkg.enc: cannot import it"),
    ("json.decoder", "model.name=json.decoder: the module has no ['Config', 'init', 'axes', 'loss', 'example_batch']"),
])
def test_a_name_that_is_not_a_model_says_what_is(name, says, capsys):
    assert equivalence.main([f"model.name={name}", "layout=dp", "mesh=dp2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says in err and "module path like `mypkg.my_model`" in err


def test_a_top_level_module_without_a_dot_is_accepted_when_importable(scratch, tmp_path, monkeypatch):
    (tmp_path / "mods").mkdir()  # ~/scratch/enc.py run as PYTHONPATH=~/scratch model.name=enc
    (tmp_path / "mods" / "enc_top.py").write_text(textwrap.dedent(_MODEL))
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    setup = build(compose_config("train", ["model.name=enc_top", "model.config.width=8", "layout=dp", "mesh=dp2"]))
    assert type(setup.model_cfg).__module__ == "enc_top" and setup.model_cfg.width == 8
    sys.modules.pop("enc_top", None)


def test_your_own_optimizer_from_a_module_path():
    mine, adamw = (optimizer(compose_config("train", [f"optim.name={name}"]).optim, steps=4)
                   for name in ("experiments.drill.optim", "adamw"))
    params, grads = {"w": torch.ones(3)}, {"w": torch.tensor([0.5, -1.0, 2.0])}
    got, want = mine.update(grads, mine.init(params), params), adamw.update(grads, adamw.init(params), params)
    assert torch.equal(got[0]["w"], want[0]["w"])  # the drill's adamw: adamw, until a drill arms its fault
    assert mine.elementwise and mine.fused_step is not None


@pytest.mark.parametrize(("name", "says"), [
    ("adam", "optim.name='adam' is unknown. Fix: use one of ['adamw', 'sgd'] or a module path like `mypkg.my_optim`"),
    ("json.decoder", "optim.name=json.decoder: the module has no ['optimizer']. Fix: use one of ['adamw', 'sgd']"),
])
def test_an_optimizer_name_that_is_not_one_says_what_is(name, says):
    conf = compose_config("train", [f"optim.name={name}"]).optim
    with pytest.raises(ConfigError, match=re.escape(says)):
        optimizer(conf, steps=4)
