"""The equivalence CLI: exit 0 on a correct layout, 1 naming the key path of a rank-dependent model, 2 on bad config."""

import re

import pytest
import torch

from experiments import equivalence
from experiments.equivalence import main


def test_correct_layout_exits_0(capsys):
    assert main(["model=mlp", "layout=zero3+tp", "mesh=dp2_tp2", "steps=2"]) == 0
    out = capsys.readouterr().out
    assert "OK:" in out
    for step in (1, 2):
        for quantity in ("loss", "grads", "params"):
            assert f"zero3+tp              {step} {quantity}" in out  # one table row per step and quantity


def test_rank_dependent_model_exits_1_naming_the_key_path(capsys):
    # tests/experiments/rank_skew.py: mlp whose ['unembed'] gradient is scaled by (1 + rank/10) on each rank
    # dp+tp: a layout with a model axis runs on DTensors, where the skew can read the mesh (the local
    # path of pure data-parallel layouts runs the loss with no active mesh).
    assert main(["model=mlp", "model.name=tests.experiments.rank_skew", "layout=dp+tp", "mesh=dp2_tp2", "steps=1"]) == 1
    out = capsys.readouterr().out
    assert "FAIL: first at step 1, grads ['unembed']" in out
    assert "FAIL ['unembed']" in out and "ok   <scalar>" in out  # the loss itself still matches


def test_impossible_config_exits_2(capsys):
    assert main(["layout=tp", "mesh=dp2"]) == 2
    assert "needs a mesh axis tp" in capsys.readouterr().err
    assert main(["layout=no_such_layout"]) == 2


def test_a_misspelled_logical_name_exits_2_with_that_message_alone(capsys):
    # tests/experiments/axes_typo.py: mlp whose block 0 names a dim "mpl"
    assert main(["model.name=tests.experiments.axes_typo", "layout=dp+tp", "mesh=dp2_tp2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: layout=dp+tp mesh={'dp': 2, 'tp': 2}: at ['blocks'][0]")
    assert "unknown logical name 'mpl' (of the names ('embed', 'mpl')): did you mean 'mlp'?" in err


def _spy(monkeypatch) -> list[dict]:
    """Record each check_equivalence call's keywords (and still run it)."""
    calls = []
    real = equivalence.check_equivalence

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(equivalence, "check_equivalence", spy)
    return calls


def test_several_layouts_in_one_call_against_one_reference_under_bf16_and_its_twin(capsys, monkeypatch):
    """``-m layout=dp,zero3`` (the sweep spelling) and ``layouts=[...]`` check every layout in one call, one
    reference run; ``precision=bf16`` checks each under bf16 and its fp32 twin, as check_equivalence does."""
    calls = _spy(monkeypatch)
    assert main(["-m", "model=mlp", "layout=dp,zero3", "mesh=dp2", "steps=1", "precision=bf16"]) == 0
    out = capsys.readouterr().out
    (call,) = calls
    assert [x.name for x in call["layouts"]] == ["dp", "zero3"] and call["precision"].compute_dtype == torch.bfloat16
    assert out.startswith("mlp under 'dp', 'zero3' on Mesh(dp=2), torch.bfloat16 compute (and its fp32 twin), 1 steps")
    for name in ("dp", "zero3", "dp@fp32", "zero3@fp32"):
        assert re.search(rf"^{re.escape(name)} +1 grads ", out, re.M), name
    assert main(["model=mlp", "layouts=[dp,zero3+tp]", "mesh=dp2"]) == 2  # each layout built and checked
    assert "layout=zero3+tp" in capsys.readouterr().err and len(calls) == 1


def test_run_options_that_cannot_go_together_exit_2_naming_the_fix(capsys):
    assert main(["model=mlp", "layout=dp", "mesh=dp2", "jit=true"]) == 2
    assert "Fix: add runtime=multiprocess" in capsys.readouterr().err
    assert main(["model=mlp", "layouts=[dp,dp+pp]", "mesh=dp2_pp2", "pipeline.microbatches=2"]) == 2
    assert "microbatches a step" in capsys.readouterr().err
    assert main(["model=mlp", "layout=dp", "mesh=dp2", "runtime=torchrun"]) == 2


@pytest.mark.multiprocess
def test_real_processes_and_the_compiled_step_from_the_command_line(capsys, monkeypatch):
    """``runtime=multiprocess jit=true``: check_equivalence on real gloo ranks, compiled (the researcher's model:
    RoPE from arange, F.cross_entropy), both layouts in one launch."""
    calls = _spy(monkeypatch)
    assert main(["model.name=tests.zoo.llama_gqa", "layouts=[dp,zero3]", "mesh=dp2", "steps=1",
                 "runtime=multiprocess", "jit=true", "jit_backend=aot_eager"]) == 0
    (call,) = calls
    assert call["runtime"] == "multiprocess" and call["jit"] is True and call["jit_backend"] == "aot_eager"
    assert "real processes, compiled, 1 steps vs one device" in capsys.readouterr().out
