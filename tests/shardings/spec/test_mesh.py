"""Mesh, P and NamedSharding: eager validation with errors that name the spec, the mesh and the fix."""

import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardings import Mesh, NamedSharding, P, ShardingError, simulate
from shardings.spec.mesh import validate_spec


def test_mesh_basics():
    mesh = Mesh(dp=2, tp=4)
    assert mesh.axis_names == ("dp", "tp") and mesh.shape == {"dp": 2, "tp": 4} and mesh.size == 8
    assert Mesh({"dp": 2, "tp": 4}) == mesh == Mesh([("dp", 2)], tp=4)
    assert Mesh(tp=4, dp=2) != mesh  # axis order is part of the mesh
    assert hash(Mesh(dp=2, tp=4)) == hash(mesh) and repr(mesh) == "Mesh(dp=2, tp=4)"
    assert mesh.axis_size(("dp", "tp")) == 8 and mesh.axis_size(None) == 1 and mesh.axis_size("tp") == 4
    assert Mesh(dp=1, tp=1).size == 1  # size-1 axes are allowed


@pytest.mark.parametrize(
    ("make", "cls", "words"),
    [
        (lambda: Mesh(), ShardingError, "at least one axis"),
        (lambda: Mesh([("dp", 2), ("dp", 2)]), ShardingError, "'dp' appears twice"),
        (lambda: Mesh({"": 2}), ShardingError, "not a non-empty identifier"),
        (lambda: Mesh({"d p": 2}), ShardingError, "not a non-empty identifier"),
        (lambda: Mesh({3: 2}), TypeError, "not a non-empty identifier"),
        (lambda: Mesh(dp=0), ShardingError, "size 0"),
        (lambda: Mesh(dp=2.0), TypeError, "size 2.0"),
        (lambda: Mesh(dp=True), TypeError, "size True"),
    ],
)
def test_bad_meshes(make, cls, words):
    with pytest.raises(cls, match="Fix: ") as e:
        make()
    assert words in str(e.value)


def test_mesh_size_must_match_world_size():
    with pytest.raises(RuntimeError, match=r"no process group.*simulate\(8\)"):
        _ = Mesh(dp=2, tp=4).device_mesh
    with simulate(4):
        with pytest.raises(ValueError, match=r"mesh Mesh\(dp=2, tp=4\): the mesh has 8 ranks but the world size is 4"):
            _ = Mesh(dp=2, tp=4).device_mesh
        assert Mesh(dp=2, tp=2).device_mesh is Mesh(dp=2, tp=2).device_mesh  # cached per group
        assert Mesh(dp=2, tp=2).device_mesh.mesh_dim_names == ("dp", "tp")


def test_p_basics():
    spec = P("dp", None, ("tp", "sp"))
    assert spec.dim_axes() == (("dp",), (), ("tp", "sp")) and spec.axes == ("dp", "tp", "sp")
    assert P(("dp",), None, ()).normalized() == P("dp") and P().normalized() == P()
    assert repr(spec) == "P('dp', None, ('tp', 'sp'))"
    assert pickle.loads(pickle.dumps(spec)) == spec


entries = st.one_of(st.none(), st.sampled_from(["dp", "tp", ("fsdp", "sp")]))
non_str = st.one_of(st.integers(), st.floats(allow_nan=False), st.just(["dp"]), st.tuples(st.just("dp"), st.integers()))


@given(good=st.lists(entries, max_size=3), bad=non_str, where=st.integers(0, 3))
def test_non_string_entries_raise_type_error_naming_the_spec(good, bad, where):
    spec_entries = [*good[:where], bad, *good[where:]]
    with pytest.raises(TypeError) as e:
        P(*spec_entries)
    msg = str(e.value)
    assert f"is {bad!r}" in msg and repr(tuple(spec_entries)) in msg and "Fix: " in msg


@given(axis=st.sampled_from(["dp", "tp", "x"]), dims=st.tuples(st.integers(0, 3), st.integers(0, 3)))
def test_an_axis_used_twice_raises_naming_the_spec(axis, dims):
    per_dim: list[tuple[str, ...]] = [(), (), (), ()]
    for d in dims:  # the same dim twice gives a tuple like ('dp', 'dp')
        per_dim[d] += (axis,)
    spec_entries = [e if len(e) > 1 else (e[0] if e else None) for e in per_dim]
    with pytest.raises(ShardingError) as e:
        P(*spec_entries)
    msg = str(e.value)
    assert f"mesh axis {axis!r} is used twice" in msg and repr(tuple(spec_entries))[1:-1] in msg and "Fix: " in msg


def test_validate_spec():
    mesh = Mesh(dp=2, tp=2)
    assert validate_spec(None, mesh) == P()
    assert validate_spec(P("dp"), mesh, (4, 4)) == P("dp")
    with pytest.raises(ShardingError) as e:
        validate_spec(P("dp", "sp"), mesh, path=(), shape=(4, 4))
    assert str(e.value) == (
        "at <root>, spec P('dp', 'sp'), mesh Mesh(dp=2, tp=2): unknown mesh axis 'sp'; the mesh has axes "
        "('dp', 'tp'). Fix: use one of the mesh's axis names, or add the axis to the Mesh."
    )
    with pytest.raises(ShardingError, match=r"shape \(4,\), mesh Mesh\(dp=2, tp=2\): the spec has 2 entries"):
        validate_spec(P("dp", None), mesh, (4,))
    with pytest.raises(ShardingError, match=r"the spec has 2 entries but the tensor has only 1 dim"):
        validate_spec(P("dp", None), mesh, 1)
    with pytest.raises(TypeError, match=r"expected a P\(...\) spec, got tuple"):
        validate_spec(("dp",), mesh)


def test_named_sharding():
    mesh = Mesh(dp=2, tp=2)
    assert NamedSharding(mesh, P("dp", None)) == NamedSharding(mesh, P(("dp",)))
    assert len({NamedSharding(mesh, P("dp", None)), NamedSharding(mesh, P("dp"))}) == 1
    with pytest.raises(ShardingError, match=r"mesh Mesh\(dp=2, tp=2\): unknown mesh axis 'ep'"):
        NamedSharding(mesh, P("ep"))
    with pytest.raises(TypeError, match=r"expected a shardings\.Mesh"):
        NamedSharding({"dp": 2}, P())
