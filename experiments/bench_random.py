"""Deprecated alias of :mod:`experiments.bench.random_normal` for one release (see experiments/bench/old_names.py)."""

from experiments.bench.old_names import forward

forward(__spec__.name, run=__name__ == "__main__")
