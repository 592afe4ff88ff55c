"""core.random: blocks equal slices of the full draw bit for bit, keys derive independent streams,
samples have the right distributions (with checks a constant or sequential counter would fail)."""

import functools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from core import deferred
from core import random as rng

MASK = 2**32 - 1
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
N = 2**20  # samples for the statistical checks; 5 standard errors of a mean is then ~5 / 1024
SAMPLERS = {
    "normal": lambda k, shape, dtype, block: rng.normal(k, shape, dtype, block=block),
    "uniform": lambda k, shape, dtype, block: rng.uniform(k, shape, dtype, -3.0, 0.7, block=block),
    "truncated_normal": lambda k, shape, dtype, block: rng.truncated_normal(k, shape, dtype, -1.5, 2.5, block=block),
    "bits": lambda k, shape, dtype, block: rng.bits(k, shape, block=block),
    "randint": lambda k, shape, dtype, block: rng.randint(k, shape, -5, 1000, block=block),
}


def _corr(x: torch.Tensor, y: torch.Tensor) -> float:
    return torch.corrcoef(torch.stack((x.double(), y.double())))[0, 1].item()


@st.composite
def shapes_and_blocks(draw):
    shape = tuple(draw(st.lists(st.integers(0, 5), max_size=4)))
    block = []
    for size in shape:
        start = draw(st.integers(0, size))
        stop = draw(st.integers(start, size))
        block.append(draw(st.sampled_from([slice(start, stop), (start, stop)])))
    return shape, tuple(block)


@settings(max_examples=150)
@given(
    shapes_and_blocks(),
    st.sampled_from(sorted(SAMPLERS)),
    st.sampled_from(FLOATS),
    st.integers(0, 2**64 - 1),
    st.sampled_from([3, 1 << 16]),
)
def test_block_is_bitwise_the_slice_of_the_full_draw(shape_block, sampler, dtype, seed, chunk):
    shape, block = shape_block
    draw = SAMPLERS[sampler]
    k = rng.key(seed)
    full = draw(k, shape, dtype, None)
    with pytest.MonkeyPatch.context() as mp:  # tiny chunks: blocks straddle the chunk boundaries too
        mp.setattr(rng, "_CHUNK", chunk)
        part = draw(k, shape, dtype, block)
    expected = full[tuple(b if isinstance(b, slice) else slice(*b) for b in block)]
    assert part.dtype == full.dtype and part.shape == expected.shape
    assert torch.equal(part, expected)


def test_block_of_a_multi_chunk_draw():
    k = rng.key(11)
    full = rng.normal(k, (257, 513))  # 65,921 counters: more than one chunk of 2**16
    assert torch.equal(rng.normal(k, (257, 513), block=(slice(100, 200), slice(1, 512))), full[100:200, 1:512])
    u = rng.uniform(k, (257, 513), torch.float64)  # float64 uniforms: one counter per element, 3 chunks
    assert torch.equal(rng.uniform(k, (257, 513), torch.float64, block=((0, 257), (300, 513))), u[:, 300:])


def test_every_element_gets_its_own_value():
    # (not uniform: float32 holds only 2**24 values in [0, 1), so 4096 draws collide with odds ~1/2)
    for draw in (rng.normal, rng.bits):
        x = draw(rng.key(5), (64, 64))
        assert torch.unique(x).numel() == x.numel(), draw.__name__


def test_threefry_matches_the_random123_known_answers():
    cases = [
        ((0, 0), (0, 0), (0x6B200159, 0x99BA4EFE)),
        ((MASK, MASK), (MASK, MASK), (0x1CB996FC, 0xBB002BE7)),
        ((0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0)),
    ]
    for (k0, k1), (c0, c1), expected in cases:
        y0, y1 = rng._threefry(torch.tensor(k0), torch.tensor(k1), torch.tensor([c0]), torch.tensor([c1]))
        assert (y0.item(), y1.item()) == expected


def test_key_words():
    assert rng.key(0).tolist() == [0, 0]
    assert rng.key(2**32 + 7).tolist() == [1, 7]
    assert rng.key(-1).tolist() == [MASK, MASK]
    assert rng.key(torch.tensor(9)).tolist() == [0, 9]
    assert rng.key(3).dtype == torch.int64


def test_same_key_same_values_and_the_key_is_untouched():
    k = rng.key(42)
    before = k.clone()
    for name, draw in SAMPLERS.items():
        assert torch.equal(draw(k, (33, 5), torch.float32, None), draw(k, (33, 5), torch.float32, None)), name
    assert torch.equal(k, before)


def test_split():
    k = rng.key(1)
    keys = rng.split(k, 5)
    assert keys.shape == (5, 2) and keys.dtype == torch.int64
    assert torch.equal(keys, rng.split(k, 5)) and torch.equal(keys[:3], rng.split(k, 3))
    assert ((keys >= 0) & (keys <= MASK)).all()
    assert len({tuple(r) for r in keys.tolist()} | {tuple(k.tolist())}) == 6
    k1, k2 = rng.split(k)
    assert not torch.equal(rng.normal(k1, (16,)), rng.normal(k2, (16,)))
    assert rng.split(k, 0).shape == (0, 2)


@given(st.integers(0, MASK), st.integers(0, MASK), st.integers(0, 2**64 - 1))
def test_fold_in_separates_data(i, j, seed):
    k = rng.key(seed)
    assert torch.equal(rng.fold_in(k, i), rng.fold_in(k, torch.tensor(i)))
    assert torch.equal(rng.fold_in(k, i), rng.fold_in(k, j)) == (i == j)


@given(st.integers(0, 2**64 - 1))
def test_split_and_fold_in_never_collide(seed):
    k = rng.key(seed)
    derived = rng.split(k, 16).tolist() + [rng.fold_in(k, i).tolist() for i in range(16)]
    assert len({tuple(d) for d in derived} | {tuple(k.tolist())}) == 33


@functools.cache
def _sample(sampler: str, seed: int, n: int, dtype: torch.dtype = torch.float32, *args: float) -> torch.Tensor:
    """One shared draw per argument tuple: the statistical tests reuse each other's samples."""
    if sampler == "bits":
        return rng.bits(rng.key(seed), (n,))
    return getattr(rng, sampler)(rng.key(seed), (n,), dtype, *args).double()


def test_normal_float32_moments_and_cdf():
    x = _sample("normal", 0, N)
    assert abs(x.mean().item()) < 0.005 and abs(x.std().item() - 1) < 0.005
    for z in (-3.0, -2.0, -1.0, 0.0, 0.5, 1.0, 2.0, 3.0):
        p = 0.5 * (1 + math.erf(z / math.sqrt(2)))
        assert abs((x <= z).double().mean().item() - p) < 5 * math.sqrt(p * (1 - p) / N), z


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_normal_moments_other_dtypes(dtype):
    x = _sample("normal", 0, N // 4, dtype)
    assert abs(x.mean().item()) < 5 / math.sqrt(N // 4) and abs(x.std().item() - 1) < 5 / math.sqrt(N // 2)


@pytest.mark.parametrize(("dtype", "n"), [(torch.float32, N), (torch.float64, N // 4)])
def test_uniform_moments(dtype, n):
    u = _sample("uniform", 1, n, dtype)
    assert u.min().item() >= 0 and u.max().item() < 1
    assert abs(u.mean().item() - 0.5) < 5 * math.sqrt(1 / 12 / n)
    assert abs(u.var().item() - 1 / 12) < 5 * 0.0745 / math.sqrt(n)  # sd of a sample variance of U(0, 1)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize(("lo", "hi"), [(0.1, 0.3), (-1.0, 1.0), (-7.0, 1e-3)])
def test_uniform_stays_in_half_open_range_after_rounding(dtype, lo, hi):
    x = rng.uniform(rng.key(2), (4096,), dtype, lo, hi).double()
    assert lo <= x.min().item() and x.max().item() < hi


@pytest.mark.parametrize(
    ("lo", "hi", "dtype", "n"),
    [(-2.0, 2.0, torch.float32, N), (-1.0, 3.0, torch.float32, N // 4), (-2.0, 2.0, torch.float64, N // 4)],
)
def test_truncated_normal_bounds_and_moments(lo, hi, dtype, n):
    x = _sample("truncated_normal", 3, n, dtype, lo, hi)
    assert lo <= x.min().item() and x.max().item() <= hi
    pdf = lambda z: math.exp(-z * z / 2) / math.sqrt(2 * math.pi)
    mass = 0.5 * (math.erf(hi / math.sqrt(2)) - math.erf(lo / math.sqrt(2)))
    mean = (pdf(lo) - pdf(hi)) / mass
    std = math.sqrt(1 + (lo * pdf(lo) - hi * pdf(hi)) / mass - mean**2)  # std of N(0, 1) truncated to [lo, hi]
    assert abs(x.mean().item() - mean) < 5 * std / math.sqrt(n) and abs(x.std().item() - std) < 5 / math.sqrt(n)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_truncated_normal_in_half_precision_stays_in_bounds(dtype):
    x = rng.truncated_normal(rng.key(4), (4096,), dtype, -0.3, 0.1).double()
    assert x.min().item() >= -0.3 and x.max().item() <= 0.1


def test_neighbouring_samples_are_uncorrelated():
    for x in (_sample("normal", 0, N), _sample("uniform", 1, N)):
        assert abs(_corr(x[:-1], x[1:])) < 5 / math.sqrt(N)
        assert abs(_corr(x[:-2], x[2:])) < 5 / math.sqrt(N)
    z = _sample("normal", 0, N)  # Box–Muller pairs are independent, not just uncorrelated
    assert abs(_corr(z[0::2] ** 2, z[1::2] ** 2)) < 5 / math.sqrt(N / 2)


def test_derived_and_neighbouring_keys_give_independent_streams():
    n = N // 8
    k1, k2 = rng.split(rng.key(6))
    pairs = [(k1, k2), (rng.fold_in(k1, 0), rng.fold_in(k1, 1)), (rng.key(6), rng.key(7)), (rng.key(6), k1)]
    for a, b in pairs:
        assert abs(_corr(rng.normal(a, (n,)), rng.normal(b, (n,)))) < 5 / math.sqrt(n)
        differ = rng.bits(a, (n // 32,)) ^ rng.bits(b, (n // 32,))
        frac = torch.stack([(differ >> i) & 1 for i in range(32)]).double().mean().item()
        assert abs(frac - 0.5) < 5 * 0.5 / math.sqrt(n)  # half of all bits differ


def test_bits_are_uniform():
    w = _sample("bits", 8, N)
    assert w.min().item() >= 0 and w.max().item() <= MASK
    ones = torch.stack([(w >> i) & 1 for i in range(32)]).double().mean(dim=1)
    assert ((ones - 0.5).abs() < 5 * 0.5 / math.sqrt(N)).all(), ones
    # Chi-square over 256 bins of the top and the bottom byte: 255 dof, mean 255, sd √510. Too small
    # is a failure too: a sequential counter fills the bottom-byte bins exactly evenly.
    for byte in (w >> 24, w & 255):
        counts = torch.bincount(byte, minlength=256).double()
        chi2 = ((counts - N / 256) ** 2 / (N / 256)).sum().item()
        assert abs(chi2 - 255) < 6 * math.sqrt(510), chi2


def test_randint_range_and_balance():
    n = N // 4
    x = rng.randint(rng.key(9), (n,), -3, 4, torch.int8)
    assert x.dtype == torch.int8 and x.min().item() == -3 and x.max().item() == 3
    freq = torch.bincount(x.long() + 3).double() / n
    assert ((freq - 1 / 7).abs() < 5 * math.sqrt(1 / 7 * 6 / 7 / n)).all(), freq


def test_works_under_simulated_ranks():
    from torch.distributed._local_tensor import LocalTensor

    import shardings

    block = ((2, 4), (0, 6))
    expected = rng.normal(rng.key(3), (4, 6), block=block)
    folded = [rng.fold_in(rng.key(3), r) for r in range(2)]
    with shardings.simulate(2):
        x = rng.normal(rng.key(3), (4, 6), block=block)
        per_rank_keys = rng.fold_in(rng.key(3), LocalTensor({0: torch.tensor(0), 1: torch.tensor(1)}))
        xs, ks = shardings.per_rank(x), shardings.per_rank(per_rank_keys)
    assert len(xs) == 2 and all(torch.equal(v, expected) for v in xs)
    assert len(ks) == 2 and all(torch.equal(a, b) for a, b in zip(ks, folded, strict=True))


def test_deferred_draws_are_recipes_for_any_block():
    k = rng.key(10)
    with deferred.deferred():
        w = rng.truncated_normal(k, (6, 9)) * 0.02
    assert isinstance(w, deferred.Deferred) and w.shape == (6, 9)
    assert torch.equal(w.block((slice(2, 5), slice(1, 8))), (rng.truncated_normal(k, (6, 9)) * 0.02)[2:5, 1:8])


K = rng.key(0)


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda: rng.normal(torch.tensor([0, 1], dtype=torch.int32), (2,)), TypeError),
        (lambda: rng.normal([0, 1], (2,)), TypeError),
        (lambda: rng.normal(rng.split(K, 3), (2,)), ValueError),
        (lambda: rng.normal(torch.tensor([-1, 0]), (2,)), ValueError),
        (lambda: rng.normal(K, (2,), torch.int64), TypeError),
        (lambda: rng.uniform(K, (2,), torch.complex64), TypeError),
        (lambda: rng.normal(K, (-1, 2)), ValueError),
        (lambda: rng.normal(K, (2.5,)), TypeError),
        (lambda: rng.normal(K, (2, 3), block=((0, 3), (0, 3))), ValueError),
        (lambda: rng.normal(K, (2, 3), block=((0, 2),)), ValueError),
        (lambda: rng.normal(K, (4,), block=(slice(0, 4, 2),)), ValueError),
        (lambda: rng.normal(K, (4,), block=(slice(-2, None),)), ValueError),
        (lambda: rng.uniform(K, (2,), minval=1.0, maxval=1.0), ValueError),
        (lambda: rng.truncated_normal(K, (2,), lower=0.0, upper=math.inf), ValueError),
        (lambda: rng.randint(K, (2,), 0, 10, torch.float32), TypeError),
        (lambda: rng.randint(K, (2,), 5, 5), ValueError),
        (lambda: rng.randint(K, (2,), 0, 2**31 + 1), ValueError),
        (lambda: rng.randint(K, (2,), 0, 300, torch.int8), ValueError),
        (lambda: rng.split(K, -1), ValueError),
        (lambda: rng.fold_in(K, -1), ValueError),
        (lambda: rng.fold_in(K, 2**32), ValueError),
        (lambda: rng.fold_in(K, 1.5), TypeError),
        (lambda: rng.key(1.0), TypeError),
        (lambda: rng.key(True), TypeError),
        (lambda: rng.key(2**64), ValueError),
    ],
)
def test_bad_input_names_the_problem_and_the_fix(call, error):
    with pytest.raises(error, match="Fix: "):
        call()
