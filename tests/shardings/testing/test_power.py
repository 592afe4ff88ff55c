"""shardings.testing.power: what a comparison can see (detection limits, the params cap) and the per-leaf
overrides of check_equivalence (``tolerances=``, ``exclude=``), reported in its table."""

import functools
import math

import pytest
import torch

import core
import models.gpt as gpt
from shardings import Mesh, layouts
from shardings.testing import EquivalenceError, check_equivalence, check_runs
from shardings.testing.power import LADDER, Judge, detection_limit
from shardings.testing.sharded_runs import run_layout
from shardings.testing.tolerance import ULPS, UPDATE_FRACTION

GEN = torch.Generator().manual_seed(0)
WANT = {"w": torch.randn(64, generator=GEN), "zero": torch.zeros(4)}


def test_the_limit_is_the_smallest_planted_error_the_rule_rejects():
    judge = Judge(WANT, terms=64)
    limits = detection_limit(judge, WANT)
    # the largest element of w may move by rtol·2·max|w|: the rule's relative part plus its floor-like atol
    rtol = ULPS * torch.finfo(torch.float32).eps * 8
    assert limits["['w']"] == min(e for e in LADDER if e > 2 * rtol)
    assert "['zero']" not in limits  # a relative error of 0 means nothing: not counted
    exact = Judge(WANT, terms=64, ulps=1e6)  # a rule too loose to catch anything on the ladder
    assert detection_limit(exact, WANT)["['w']"] == math.inf


def test_a_planted_update_error_scales_the_update_not_the_value():
    before = {"w": torch.ones(8)}
    after = {"w": torch.ones(8) + 1e-3 * torch.arange(1.0, 9.0)}  # small updates of large values
    judge = Judge(after, terms=1)
    by_update = detection_limit(judge, after, before)["['w']"]
    assert by_update > detection_limit(judge, after)["['w']"]  # 1+ε of a small update is a smaller change


def test_params_may_not_move_by_more_than_a_fraction_of_their_update_whatever_the_slack():
    before = {"w": torch.zeros(16)}
    want = {"w": torch.full((16,), 1e-3)}  # the step's own update: 1e-3 each
    slack = {"['w']": torch.full((16,), 1.0)}  # an allowance that would accept anything element by element
    capped = Judge(want, slack=slack, update={"['w']": want["w"] - before["w"]})
    loose = Judge(want, slack=slack)
    off = {"w": want["w"] * (1 + 1.5 * UPDATE_FRACTION)}
    assert loose.leaf("['w']", off["w"]).ok and not capped.leaf("['w']", off["w"]).ok
    assert capped.leaf("['w']", want["w"] * (1 + 0.5 * UPDATE_FRACTION)).ok
    rounding = Judge(want, update={"['w']": want["w"] - before["w"]}, noise_driven=["['w']"])
    assert rounding.leaf("['w']", off["w"]).ok is False  # not capped, but the rule itself still applies
    assert "['w']" not in rounding.cap


# -- per-leaf overrides in check_equivalence ------------------------------------------------------------------------

CFG = gpt.Config(vocab=32, dim=16, layers=1, heads=2, mlp=32, seq_len=8)
BATCH = gpt.example_batch(CFG, 4)


def _unembed_grad_off(params, batch, cfg):
    """gpt.loss whose unembed gradient is 10% off where ranks run (not on the single-device reference)."""
    if torch.distributed.is_initialized():
        w = params["unembed"]
        params = {**params, "unembed": w * 1.1 - w.detach() * 0.1}
    return gpt.loss(params, batch, cfg)


def _check(**kw):
    return check_equivalence(gpt.init, _unembed_grad_off, gpt.axes, CFG, BATCH, layouts=["tp"], mesh=Mesh(tp=2),
                             steps=1, optimizer=functools.partial(core.optim.sgd, 0.1), **kw)


def test_an_excluded_leaf_is_not_compared_and_the_table_says_so():
    with pytest.raises(EquivalenceError, match=r"worst at \['unembed'\]"):
        _check()
    report = _check(exclude=[r"\['unembed'\]"])
    assert report.ok and report.excluded == ["['unembed']"]
    assert "not compared (excluded): ['unembed']" in report.table()
    assert all(r.worst_path != "['unembed']" for r in report.rows)


def test_an_overridden_tolerance_applies_to_its_leaves_and_the_table_says_so():
    report = _check(tolerances={"unembed": 1e7})
    assert report.ok and report.overridden == {"['unembed']": 1e7}
    assert "tolerance overridden: ['unembed'] (1e+07 ulps)" in report.table()


def test_a_pattern_that_matches_no_leaf_is_an_error_not_a_silent_no_op():
    with pytest.raises(ValueError, match=r"patterns \['unembd'\].*match no leaf.*Fix: "):
        _check(exclude=["unembd"])


# -- the stated limit is what the comparison sees (issue #43.4) --------------------------------------------------------

SGD = functools.partial(core.optim.sgd, 0.1)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``factor`` (a planted bug in one leaf's gradient)."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.factor, None


def _grad_off(params, batch, cfg, leaf, eps):
    """gpt.loss whose gradient of the leaf at key path ``leaf`` is (1 + eps)x where ranks run (not on the reference)."""
    if torch.distributed.is_initialized():
        params = core.tree.map_with_path(
            lambda p, x: _ScaleGrad.apply(x, 1 + eps) if core.tree.keystr(p) == leaf else x, params)
    return gpt.loss(params, batch, cfg)


def _tp_run(leaf=None, eps=0.0):
    """The tp=2 run of CFG on simulated ranks (its gradient of ``leaf`` planted (1 + eps)x), for check_runs."""
    loss = functools.partial(_grad_off, cfg=CFG, leaf=leaf, eps=eps)
    return functools.partial(run_layout, "simulate", gpt.init, loss, gpt.axes(CFG), CFG, BATCH, SGD, 1,
                             core.random.key(0), layouts.get("tp"), Mesh(tp=2), {})


def _scaled(steps, leaf, eps):
    """A run's per-step, per-rank values with the gradient of ``leaf`` scaled by 1 + eps after the fact."""
    scale = lambda p, g: g * (1 + eps) if core.tree.keystr(p) == leaf else g
    return [[{**r, "grads": core.tree.map_with_path(scale, r["grads"])} for r in ranks] for ranks in steps]


def _judge_runs(runs):
    return check_runs(runs, gpt.init, gpt.loss, CFG, BATCH, steps=1, optimizer=SGD, raise_on_failure=False)


def _grads_ok(report, name):
    return next(r for r in report.rows if (r.layout, r.quantity) == (name, "grads")).ok


def test_an_error_at_the_stated_limit_is_caught_in_every_leaf_and_a_rung_below_passes_in_the_worst():
    """The report's grads limit is its worst leaf's: an error of that size is caught in *any* one leaf (a limit
    taken from the best-caught leaf would be missed in the worst), and the next rung of the ladder (a factor
    2-2.5 smaller) passes in the leaf the report names. Planted through autograd (the gradient of the sharded
    run itself) and, for every leaf, by scaling the run's gradient after the fact."""
    honest = _tp_run()()
    stated = next(x for x in _judge_runs({"tp": lambda: honest}).limits if x.quantity == "grads")
    assert stated.uncounted == 0 and math.isfinite(stated.limit)  # every leaf counts; something is caught
    below = LADDER[LADDER.index(stated.limit) + 1]
    leaves = [core.tree.keystr(p) for p, _ in core.tree.leaves_with_path(honest[0][0]["grads"])]
    runs = {f"at the limit in {leaf}": functools.partial(_scaled, honest, leaf, stated.limit) for leaf in leaves}
    runs["worst leaf at the limit, through autograd"] = _tp_run(stated.worst_path, stated.limit)
    runs["worst leaf a rung below, through autograd"] = _tp_run(stated.worst_path, below)
    runs["worst leaf a rung below"] = functools.partial(_scaled, honest, stated.worst_path, below)
    report = _judge_runs(runs)
    missed = [name for name in runs if "at the limit" in name and _grads_ok(report, name)]
    assert not missed, f"the stated limit {stated.limit:g} (set by {stated.worst_path}) is not caught: {missed}"
    assert _grads_ok(report, "worst leaf a rung below, through autograd"), report.table()
    assert _grads_ok(report, "worst leaf a rung below"), report.table()
