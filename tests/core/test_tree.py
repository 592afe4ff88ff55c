from typing import NamedTuple

import torch
from hypothesis import given
from hypothesis import strategies as st

from core import tree


class State(NamedTuple):
    mu: object
    count: object


leaf = st.one_of(st.integers(), st.floats(allow_nan=False), st.builds(torch.zeros, st.integers(0, 3)))
trees = st.recursive(
    leaf,
    lambda kids: st.one_of(
        st.lists(kids, max_size=3),
        st.tuples(kids, kids),
        st.dictionaries(st.text("abcxyz", min_size=1, max_size=3), kids, max_size=3),
        st.builds(State, kids, kids),
    ),
    max_leaves=12,
)


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


@given(trees)
def test_flatten_unflatten_is_identity(t):
    leaves, treedef = tree.flatten(t)
    back = tree.unflatten(treedef, leaves)
    assert tree.structure(back) == treedef
    assert all(_same(a, b) for a, b in zip(tree.leaves(back), leaves, strict=True))
    assert type(back) is type(t)


@given(trees)
def test_map_with_path_sees_every_leaf_once_with_stable_paths(t):
    seen = []
    tree.map_with_path(lambda p, x: seen.append(tree.keystr(p)), t)
    assert seen == [tree.keystr(p) for p, _ in tree.leaves_with_path(t)]
    assert len(set(seen)) == len(seen)


def test_keystr_is_readable_for_nested_params_and_namedtuples():
    params = {"blocks": [{"attn": {"wq": 0}}], "state": State(mu={"w": 1}, count=2)}
    paths = [tree.keystr(p) for p, _ in tree.leaves_with_path(params)]
    assert paths == ["['blocks'][0]['attn']['wq']", "['state'].mu['w']", "['state'].count"]


def test_registered_dataclass_is_a_node():
    import dataclasses

    @tree.register_dataclass
    @dataclasses.dataclass
    class Pair:
        a: object
        b: object

    assert tree.leaves(Pair(1, [2, 3])) == [1, 2, 3]
    assert tree.map(lambda x: x * 10, Pair(1, 2)) == Pair(10, 20)
