"""Schedules at known points, against optax's formulas written out in plain Python."""

import math

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from core import optim
from shardings.testing import assert_close


def optax_warmup_cosine(step, peak, warmup, decay, end, init):
    """optax.warmup_cosine_decay_schedule, transcribed (join of a linear and a cosine schedule)."""
    if step < warmup:
        return init + (peak - init) * step / warmup
    t = min(step - warmup, decay - warmup)
    return end + (peak - end) * 0.5 * (1 + math.cos(math.pi * t / (decay - warmup)))


def test_warmup_cosine_known_points():
    lr = optim.warmup_cosine(1.0, warmup_steps=10, decay_steps=110, end=0.1, init=0.2)
    expected = {0: 0.2, 5: 0.6, 10: 1.0, 60: 0.55, 110: 0.1, 111: 0.1, 10_000: 0.1}
    for step, value in expected.items():
        assert_close(lr(step), torch.tensor(value), msg=f"step {step}")


def test_warmup_cosine_without_warmup_starts_at_peak():
    lr = optim.warmup_cosine(2.0, warmup_steps=0, decay_steps=4)
    assert [round(float(lr(s)), 6) for s in range(6)] == [2.0, 1.707107, 1.0, 0.292893, 0.0, 0.0]


@given(
    st.floats(1e-5, 1.0),
    st.integers(0, 50),
    st.integers(1, 200),
    st.floats(0.0, 1e-4),
    st.floats(0.0, 1e-5),
    st.integers(0, 300),
)
@example(peak=1.0, warmup=0, decay_len=196, end=0.0, init=0.0, step=190)  # found by make test-explore: lr ≈ 2e-3
def test_warmup_cosine_matches_optax_formula(peak, warmup, decay_len, end, init, step):
    lr = optim.warmup_cosine(peak, warmup, warmup + decay_len, end=end, init=init)
    value = lr(torch.tensor(step, dtype=torch.int32))
    assert value.dtype == torch.float32 and value.ndim == 0
    expected = optax_warmup_cosine(step, peak, warmup, warmup + decay_len, end, init)
    assert_close(value, torch.tensor(expected), magnitude=max(peak, init, end))  # the cosine's terms are ~peak


def test_linear_and_constant_known_points():
    lr = optim.linear(1.0, 0.2, steps=8)
    got = [float(lr(s)) for s in (0, 2, 8, 9, 100)]
    assert got == pytest.approx([1.0, 0.8, 0.2, 0.2, 0.2], rel=1e-6)
    assert float(optim.constant(0.3)(torch.tensor(5))) == pytest.approx(0.3)


@pytest.mark.parametrize(
    "make",
    [
        lambda: optim.warmup_cosine(1.0, warmup_steps=10, decay_steps=10),
        lambda: optim.warmup_cosine(1.0, warmup_steps=-1, decay_steps=10),
        lambda: optim.warmup_cosine(1.0, warmup_steps=1.5, decay_steps=10),
        lambda: optim.linear(1.0, 0.0, steps=0),
    ],
)
def test_bad_step_counts_raise_with_fix(make):
    with pytest.raises(ValueError, match=r"steps must be an int >= .*Fix: "):
        make()
