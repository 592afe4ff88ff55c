"""``python -m experiments.plan validate``'s score: Kendall's τ between predicted and measured step times."""

import pytest

from experiments.bench.plan import kendall_tau


def test_kendall_tau_counts_concordant_minus_discordant_pairs_over_all_pairs():
    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1
    assert kendall_tau([1, 2, 3, 4], [40, 30, 20, 10]) == -1
    assert kendall_tau([1, 2, 3, 4], [10, 30, 20, 40]) == pytest.approx((5 - 1) / 6)  # one pair swapped
    assert kendall_tau([1, 1, 3], [1, 2, 3]) == pytest.approx(2 / 3)  # a tie counts neither way
