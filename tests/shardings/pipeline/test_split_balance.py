"""shardings.pipeline.split balances the stages: for random block costs, an embedding/head of random size and
pp in {3, 4, 8} with layer counts that do not divide evenly, its most expensive stage costs what the best
contiguous split costs, found by an independent brute force over every split — with the embedding and head
charged as the docs say (the rest of the params counted half on the first stage, half on the last)."""

import itertools

import torch
from hypothesis import example, given
from hypothesis import strategies as st

from shardings import pipeline


def _params(rest: int, n: int) -> dict:
    """Params whose non-block part (embedding, norms, head) has ``rest`` elements, with ``n`` blocks."""
    return {"embed": torch.zeros(rest), "blocks": [{"w": torch.zeros(1)} for _ in range(n)]}


def _stage_costs(sizes: tuple[int, ...], costs: list[int], rest: int) -> list[float]:
    """What each stage pays for contiguous blocks of ``sizes``: its blocks, and half of the rest on the first and
    on the last stage (the first runs the embedding, the last the head: either may use what is outside blocks)."""
    starts = list(itertools.accumulate((0, *sizes)))
    out = [float(sum(costs[a:b])) for a, b in itertools.pairwise(starts)]
    out[0] += rest / 2
    out[-1] += rest / 2
    return out


def _best(costs: list[int], rest: int, stages: int) -> float:
    """The lowest most-expensive-stage cost over every way to cut the blocks into ``stages`` contiguous parts."""
    n = len(costs)
    cuts = itertools.combinations(range(1, n), stages - 1)
    return min(max(_stage_costs(tuple(b - a for a, b in zip((0, *c), (*c, n))), costs, rest)) for c in cuts)


@st.composite
def cases(draw):
    stages = draw(st.sampled_from([3, 4, 8]))
    n = draw(st.integers(stages + 1, 12).filter(lambda n: n % stages))  # uneven: some stage has more blocks
    costs = draw(st.lists(st.integers(1, 100), min_size=n, max_size=n))
    return stages, costs, draw(st.integers(0, 400))


@given(cases())
@example((3, [10, 10, 10, 10, 10, 10, 10], 60))  # the head's 30 on the wrong stage moves one block
@example((4, [5, 50, 5, 5, 5, 5, 50, 5, 5], 200))
def test_the_most_expensive_stage_is_the_balanced_optimum(case):
    stages, costs, rest = case
    split = pipeline.split(_params(rest, len(costs)), stages, costs=costs)
    sizes = tuple(len(r) for r in split.ranges)
    assert sum(sizes) == len(costs) and min(sizes) >= 1 and split.ranges[0].start == 0
    assert all(a.stop == b.start for a, b in itertools.pairwise(split.ranges))  # contiguous, in order
    assert list(split.costs) == _stage_costs(sizes, costs, rest)  # what it reports is what each stage pays
    assert max(split.costs) == _best(costs, rest, stages)
