"""shardings.testing.power: what a comparison can see (detection limits, the params cap) and the per-leaf
overrides of check_equivalence (``tolerances=``, ``exclude=``), reported in its table."""

import functools
import math

import pytest
import torch

import core
import models.gpt as gpt
from shardings import Mesh
from shardings.testing import EquivalenceError, check_equivalence
from shardings.testing.power import LADDER, Judge, detection_limit
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
