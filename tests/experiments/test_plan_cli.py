"""``python -m experiments.plan``'s one-candidate questions, as docs/planner.md writes them: ``fits=true`` and
``explain=true`` with ``layout=... mesh=... precision=...`` (``mesh`` and ``precision`` are also the train app's
config groups, which Hydra took them for), and a bad candidate's error."""

import json
import math
import re
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from experiments import plan


def test_fits_answers_yes_or_no_for_the_candidate_the_command_line_names(capsys):
    assert plan.main(["model=gpt_tiny", "fits=true", "layout=zero3", "mesh=dp4", "precision=bf16"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("fits: yes — zero3 dp4 bf16:") and "opt_state" in out


def test_explain_names_a_pipelined_candidates_schedule(capsys):
    assert plan.main(["model=gpt_tiny", "explain=true", "layout=zero1+pp", "mesh=pp2_dp2", "schedule=zb_h1",
                      "microbatches=4"]) == 0
    assert "zero1+pp pp2_dp2 zb_h1 m4" in capsys.readouterr().out


def test_a_bad_candidate_is_an_error_naming_the_key(capsys):
    assert plan.main(["model=gpt_tiny", "fits=true", "layout=zero3", "mesh=dp3"]) == 2
    assert "mesh=dp3 has 3 ranks but cluster this has 4" in capsys.readouterr().err
    assert plan.main(["model=gpt_tiny", "fits=true", "layout=zero3", "mesh=dp4", "microbatches=many"]) == 2
    assert "microbatches" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_layout_auto_trains_the_winner_as_the_docs_command_runs_it(tmp_path):
    """docs/planner.md's ``python -m experiments.train layout=auto mesh=dp4 model=gpt_small``, tiny and 2 steps, on
    real processes from the command line (Hydra's app already initialized when the planner loads its cluster)."""
    proc = subprocess.run([sys.executable, "-m", "experiments.train", "layout=auto", "mesh=dp4", "model=gpt_tiny",
                           "steps=2", "data.source=random", "progress=false", f"hydra.run.dir={tmp_path}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    winner = re.search(r"^winner: layout=(\S+) mesh=(\S+)", proc.stdout, re.M)
    assert winner, proc.stdout
    conf = OmegaConf.load(tmp_path / "config.yaml")
    assert conf.layout == winner[1] != "auto" and math.prod(conf.mesh.sizes.values()) == 4
    assert json.loads((tmp_path / "status.json").read_text())["status"] == "ran"
    assert json.loads((tmp_path / "summary.json").read_text())["layout"] == winner[1]
