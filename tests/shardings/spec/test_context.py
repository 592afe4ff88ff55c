import itertools
import threading
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

import core
from shardings import Mesh, P, Rules, ShardingError, constrain, current, per_rank, simulate, use
from shardings.runtime.compat import LocalTensor, maybe_disable_local_tensor_mode
from shardings.testing import assert_close

MESH = Mesh(dp=2, tp=2)
RULES = Rules(batch="dp", seq="tp", embed="tp", mlp=None)


def _same_on_every_rank(x, expected):
    for v in per_rank(x):
        assert_close(v, expected)
    return True


def test_use_nests_and_restores():
    assert current() is None
    layout = SimpleNamespace(activation_rules=Rules(batch="dp"))  # any object with `activation_rules`
    with use(MESH, RULES) as outer:
        assert current() == outer == (MESH, RULES)
        with use(Mesh(tp=4), layout):
            assert current() == (Mesh(tp=4), Rules(batch="dp"))
        assert current() == outer
        with use(MESH):
            assert current().rules == Rules()
    assert current() is None


def test_use_is_per_thread():
    seen = []
    with use(MESH, RULES):
        worker = threading.Thread(target=lambda: seen.append(current()))
        worker.start()
        worker.join()
    assert seen == [None]


@pytest.mark.parametrize(("mesh", "rules"), [(MESH, {"batch": "dp"}), (MESH, SimpleNamespace()), ({"dp": 2}, None)])
def test_use_rejects_bad_arguments(mesh, rules):
    with pytest.raises(TypeError, match="Fix:"), use(mesh, rules):
        pass


def test_constrain_without_mesh_is_identity():
    x = torch.randn(3, 4)
    assert constrain(x, ("batch", "embed")) is x
    assert constrain(x, ("no", "rule", "needed")) is x  # nothing is resolved without a mesh
    assert constrain(x, P("dp")) is x


def test_constrain_plain_tensor_to_names_and_spec():
    x = torch.randn(4, 6)
    with simulate(4), use(MESH, RULES):
        y = constrain(x, ("batch", "embed"))
        assert isinstance(y, DTensor) and y.placements == (Shard(0), Shard(1))
        assert _same_on_every_rank(y.full_tensor(), x)
        z = constrain(y, P(None, ("dp", "tp")))
        assert z.placements == (Shard(1), Shard(1))
        assert _same_on_every_rank(z.full_tensor(), x)
        r = constrain(z, ("mlp", None))
        assert r.placements == (Replicate(), Replicate())
        assert _same_on_every_rank(r.to_local(), x)


ENTRIES = [None, "dp", "tp", ("dp", "tp")]
SPECS = [P(a, b) for a, b in itertools.product(ENTRIES, ENTRIES) if not set(P(a).axes) & set(P(b).axes)]


@pytest.mark.parametrize("spec", SPECS, ids=repr)
def test_constrain_to_every_spec_keeps_the_value(spec):
    x = torch.randn(4, 6)
    with simulate(4), use(MESH):
        y = constrain(constrain(x, P("dp")), spec)
        # Per mesh axis: Shard(d) for the dim it shards, else Replicate().
        expected = [
            next((Shard(d) for d, axes in enumerate(spec.dim_axes()) if a in axes), Replicate())
            for a in MESH.axis_names
        ]
        assert y.placements == tuple(expected)
        assert _same_on_every_rank(y.full_tensor(), x)


def _loss(x, w):
    h = constrain(x, ("batch", "embed"))  # [batch, embed] sharded over (dp, tp)
    h = constrain(torch.tanh(h) * constrain(w, ("batch", "embed")), ("batch", None))
    return (constrain(h, ("mlp", "embed")) ** 2).sum()


def test_gradient_flows_through_constrain():
    x, w = torch.randn(4, 6), torch.randn(4, 6)
    ref_value, ref_grad = core.value_and_grad(_loss)(x, w)  # no mesh: the single-device reference
    with simulate(4), use(MESH, RULES):
        value, g = core.value_and_grad(_loss)(x, w)
        assert isinstance(value, DTensor)
        assert _same_on_every_rank(value.full_tensor(), ref_value)
        assert not isinstance(g, DTensor) and _same_on_every_rank(g, ref_grad)


def test_partial_to_shard_is_a_reduce_scatter():
    # Per tp rank a partial sum, as after a row-parallel matmul; constraining the sequence dim to tp is
    # then a reduce-scatter (sequence parallelism), not an all-reduce.
    parts = {r: torch.randn(4, 6) for r in range(4)}
    with simulate(4), use(MESH, RULES):
        with maybe_disable_local_tensor_mode():
            local = LocalTensor(parts)
        x = DTensor.from_local(local, MESH.device_mesh, [Replicate(), Partial()], run_check=False)
        with CommDebugMode() as comms:
            y = constrain(x, ("seq", "mlp"))
        counts = {str(op).split(".")[-1]: n for op, n in comms.get_comm_counts().items()}
        assert counts == {"reduce_scatter_tensor": 1}
        assert y.placements == (Replicate(), Shard(0))
        # tp ranks r and r ^ 1 share a dp coordinate: their parts are summed.
        for rank, got in enumerate(per_rank(y.full_tensor())):
            assert_close(got, parts[rank] + parts[rank ^ 1])


def test_wrong_number_of_names():
    with simulate(4), use(MESH, RULES), pytest.raises(ShardingError) as e:
        constrain(torch.zeros(4, 6), ("batch",))
    msg = str(e.value)
    assert "('batch',)" in msg and "(4, 6)" in msg and "Mesh(dp=2, tp=2)" in msg and "Fix:" in msg


def test_errors_from_rules_and_specs():
    with simulate(4), use(MESH, RULES):
        with pytest.raises(ShardingError, match=r"'vocab'.*no rule"):
            constrain(torch.zeros(4, 6), ("batch", "vocab"))
        with pytest.raises(ShardingError, match="unknown mesh axis 'fsdp'"):
            constrain(torch.zeros(4, 6), P("fsdp"))
        with pytest.raises(ShardingError, match=r"shape \(4, 6\).*3 entries"):
            constrain(torch.zeros(4, 6), P("dp", None, None))
        with pytest.raises(ShardingError, match=r"shape \(3, 6\).*divisible"):  # the full shape reaches lowering
            constrain(torch.zeros(3, 6), P(("tp", "dp")))


def test_dtensor_on_another_mesh():
    with simulate(4):
        other = DTensor.from_local(torch.zeros(2), Mesh(x=4).device_mesh, [Replicate()])
        with use(MESH, RULES), pytest.raises(ShardingError, match="active mesh"):
            constrain(other, P("dp"))
