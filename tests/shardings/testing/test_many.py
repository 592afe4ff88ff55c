"""``check_equivalences``: several checks, each its own model, mesh and options, judged as ``check_equivalence``
judges them, by name (their runs grouped by world size: on real ranks one launch each, tests/shardings/step/
test_jit_equivalence.py)."""

import functools

import pytest

import core
from models import mlp
from shardings import Mesh
from shardings.testing import EquivalenceError, check_equivalence, check_equivalences
from tests.experiments import rank_skew

CFG = mlp.Config(vocab=32, dim=16, mlp=32, layers=1, seq_len=4)
BATCH = mlp.example_batch(CFG, 8)
SGD = functools.partial(core.optim.sgd, 0.1)


def _check(model, layout: str, mesh: Mesh, **kw) -> dict:
    return dict(init=model.init, loss=model.loss, axes=model.axes, cfg=CFG, batch=BATCH, layouts=[layout], mesh=mesh,
                steps=1, optimizer=SGD, **kw)


def test_each_check_is_judged_as_check_equivalence_judges_it_and_a_failure_is_named():
    checks = {"dp2": _check(mlp, "dp", Mesh(dp=2)), "zero3 dp4": _check(mlp, "zero3", Mesh(dp=4), accum_steps=2)}
    reports = check_equivalences(checks, runtime="simulate")
    assert list(reports) == ["dp2", "zero3 dp4"] and all(r.ok for r in reports.values())
    alone = check_equivalence(**checks["zero3 dp4"])
    assert [(r.layout, r.quantity, r.ok) for r in reports["zero3 dp4"].rows] == [
        (r.layout, r.quantity, r.ok) for r in alone.rows]
    assert reports["zero3 dp4"].limits == alone.limits
    # rank 1's unembed gradient 1.1x: that check fails, named, after every check was judged
    checks["skewed"] = _check(rank_skew, "dp", Mesh(dp=2), local=False)
    with pytest.raises(EquivalenceError, match=r"(?s)layout 'dp' on Mesh\(.*\) \(check 'skewed'\).*unembed"):
        check_equivalences(checks, runtime="simulate")
