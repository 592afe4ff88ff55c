"""``Policy``: casts touch only floating leaves; the string form parses and round-trips."""

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from core import tree
from core.precision import Policy

FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
policies = st.builds(Policy, *(st.sampled_from(FLOATS) for _ in range(3)))


def _mixed_tree():
    return {
        "w": torch.randn(3, 2),
        "half": torch.randn(2, dtype=torch.float16),
        "ids": torch.arange(4),
        "mask": torch.tensor([True, False]),
        "blocks": [torch.randn(2, dtype=torch.float64), 3, None, "name"],
    }


@given(policies, st.sampled_from(["param", "compute", "reduce"]))
def test_casts_only_floating_leaves(policy, role):
    x = _mixed_tree()
    out = getattr(policy, f"cast_to_{role}")(x)
    target = getattr(policy, f"{role}_dtype")
    assert tree.structure(out) == tree.structure(x)
    for before, after in zip(tree.leaves(x), tree.leaves(out)):
        if isinstance(before, torch.Tensor) and before.is_floating_point():
            assert after.dtype == target
            torch.testing.assert_close(after, before.to(target), rtol=0, atol=0)
        else:
            assert after is before  # ints, bools and non-tensors untouched
    assert x["w"].dtype == torch.float32  # the input is not mutated


@given(policies)
def test_string_form_round_trips(policy):
    assert Policy.from_string(str(policy)) == policy


def test_from_string_spellings_and_presets():
    assert Policy.from_string("params=float32,compute=bfloat16,reduce=float32") == Policy.bf16_mixed()
    assert Policy.from_string(" p=f32, c=bf16 ") == Policy.bf16_mixed()
    assert Policy.from_string("fp16") == Policy(torch.float16, torch.float16, torch.float16)
    assert Policy.fp32() == Policy() == Policy.from_string("reduce=fp32")
    assert str(Policy.bf16_mixed()) == "params=float32,compute=bfloat16,reduce=float32"


def test_policy_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Policy().compute_dtype = torch.bfloat16


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("params=float32,compute=int8", r"unknown dtype 'int8'.*Fix: "),
        ("params=float32,output=bf16", r"cannot read entry 'output=bf16'.*Fix: "),
        ("params float32", r"unknown dtype 'params float32'.*Fix: "),
    ],
)
def test_from_string_errors_say_how_to_fix(text, match):
    with pytest.raises(ValueError, match=match):
        Policy.from_string(text)


def test_non_floating_dtype_rejected():
    with pytest.raises(TypeError, match=r"compute_dtype must be a floating torch.dtype.*Fix: "):
        Policy(compute_dtype=torch.int32)


def test_casts_dtensor_leaves_keeping_placements():
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    import shardings
    from shardings import Mesh

    with shardings.simulate(2):
        x = distribute_tensor(torch.randn(4, 2), Mesh(dp=2).device_mesh, [Shard(0)])
        out = Policy.bf16_mixed().cast_to_compute({"w": x})["w"]
        assert isinstance(out, DTensor) and out.placements == (Shard(0),) and out.dtype == torch.bfloat16
        for got, want in zip(shardings.per_rank(out.full_tensor()), shardings.per_rank(x.full_tensor())):
            torch.testing.assert_close(got, want.to(torch.bfloat16), rtol=0, atol=0)
