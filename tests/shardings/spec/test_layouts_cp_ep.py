"""shardings.spec.layouts_cp_ep: the cp, cp_allgather and ep presets resolved to specs, as test_layouts' design table.

Equivalence cannot see these rules go wrong: an ep that stops splitting tokens, or experts left whole, still
trains like one device (ranks repeat each other's work), and so does cp with K/V all-gathered instead of
ringed. The drill's mutants ``ep-ranks-after-data`` and ``cp-kv-seq-replicated`` (tests/mutants.py) are such
rule changes; here they fail in milliseconds, without running a step.
"""

import pytest

from shardings import Mesh, P, logical_to_spec
from shardings.spec import layouts

TOKENS = ("batch", "seq")
EXPERT_W = ("expert", "embed", "mlp")  # models.moe's w_gate / w_up
DENSE_W = ("embed", "mlp")  # a dense block's w_up
KV = ("batch", "kv_seq", "kv_heads", "head_dim")  # K/V as attention consumes them
ROLES = ("params", "compute", "grads", "opt_state")

DP2_EP2 = Mesh(dp=2, ep=2)
EP_TABLE = [
    # (layout, mesh, tokens, expert weights per role, a dense weight's storage)
    ("ep", Mesh(ep=2), P("ep"), dict.fromkeys(ROLES, P("ep")), P()),
    # ep is a data axis for tokens (after dp), never for ZeRO's sharding of dense weights
    ("dp+ep", DP2_EP2, P(("dp", "ep")), dict.fromkeys(ROLES, P("ep")), P()),
    ("zero3+ep", DP2_EP2, P(("dp", "ep")), {**dict.fromkeys(ROLES, P("ep", "dp")), "compute": P("ep")}, P("dp")),
    # ep's expert -> ep beats tp's expert -> None; the experts' hidden dim stays on tp
    ("tp+ep", Mesh(tp=2, ep=2), P("ep"), dict.fromkeys(ROLES, P("ep", None, "tp")), P(None, "tp")),
    ("dp+tp+ep", Mesh(dp=2, tp=2, ep=2), P(("dp", "ep")), dict.fromkeys(ROLES, P("ep", None, "tp")), P(None, "tp")),
]


@pytest.mark.parametrize(("name", "mesh", "tokens", "expert", "dense"), EP_TABLE, ids=[r[0] for r in EP_TABLE])
def test_ep_splits_tokens_over_ep_and_experts_in_every_role(name, mesh, tokens, expert, dense):
    layout = layouts.get(name)
    layouts.validate(layout, mesh)
    assert logical_to_spec(TOKENS, layout.role("batch"), mesh).normalized() == tokens.normalized()
    for role, want in expert.items():
        assert logical_to_spec(EXPERT_W, layout.role(role), mesh).normalized() == want.normalized(), role
    assert logical_to_spec(DENSE_W, layout.role("params"), mesh).normalized() == dense.normalized()


@pytest.mark.parametrize(("name", "kv"), [("cp", P(None, "cp")), ("cp_allgather", P())])
def test_cp_rings_kv_and_cp_allgather_gathers_them(name, kv):
    layout, mesh = layouts.get(name), Mesh(dp=2, cp=2)
    assert logical_to_spec(TOKENS, layout.role("batch"), mesh).normalized() == P(None, "cp")
    assert logical_to_spec(KV, layout.activation_rules, mesh).normalized() == kv.normalized()
