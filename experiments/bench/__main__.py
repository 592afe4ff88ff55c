"""``python -m experiments.bench``: our layouts against torch's wrappers (:mod:`experiments.bench.wrappers`)."""

from experiments.bench.wrappers import main

if __name__ == "__main__":
    main()
