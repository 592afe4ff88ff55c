"""The equivalence CLI: exit 0 on a correct layout, 1 naming the key path of a rank-dependent model, 2 on bad config."""

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
