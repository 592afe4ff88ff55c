"""``python -m experiments.drill [--quick | --per-family N] [--out DIR] [--seed N] [--only F ...] [--faults F ...]``.

Runs the drill matrix (faults x layout families, :mod:`experiments.drill.families`) on real gloo ranks, prints
the table and writes it (``drills.csv``, ``drills.md``) to ``--out``. ``--quick``: one drill per family.
Exits 1 when any drill lost data, hung past its timeout or resumed unequal.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

from experiments.build import ConfigError
from experiments.drill.families import FAMILIES
from experiments.drill.faults import IN_MODEL, IN_OPTIMIZER, IN_SAVE
from experiments.drill.harness import EXTERNAL, RESIZE, Drill, Result, pick, run_drill
from experiments.drill.table import markdown, write
from shardings import LaunchError
from shardings.checkpoint import CheckpointError

FAULTS = (*EXTERNAL, *IN_SAVE, *IN_MODEL, *IN_OPTIMIZER)
_PER_FAMILY = 10  # the full matrix: this many drills per family (random faults, ranks and moments)


def matrix(quick: bool, seed: int, families: list[str], faults: list[str],
           per_family: int = _PER_FAMILY) -> list[Drill]:
    """The drills to run: per family, one (``quick``) or ``per_family``, cycling through ``faults``."""
    rng = random.Random(seed)
    drills = []
    for i, name in enumerate(families):
        family = FAMILIES[name]
        fits = [f for f in faults if f not in RESIZE or family.smaller]  # a 2-rank family has no smaller world
        drills += [pick(family, fits[(i + j) % len(fits)], rng) for j in range(1 if quick else per_family)]
    return drills


def main(argv: list[str] | None = None) -> int:
    """Run the matrix; return the exit status (0: every drill ok)."""
    parser = argparse.ArgumentParser(prog="python -m experiments.drill", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one drill per layout family")
    parser.add_argument("--out", default="outputs/drill", help="folder for the runs and the table")
    parser.add_argument("--seed", type=int, default=0, help="picks the ranks and moments")
    parser.add_argument("--only", nargs="+", choices=sorted(FAMILIES), default=list(FAMILIES), metavar="FAMILY")
    parser.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS))
    parser.add_argument("--per-family", type=int, default=_PER_FAMILY, help="drills per family (without --quick)")
    args = parser.parse_args(argv)
    out, results, started = Path(args.out), [], time.monotonic()
    for i, drill in enumerate(matrix(args.quick, args.seed, args.only, args.faults, args.per_family)):
        try:
            results.append(run_drill(drill, out, f"drill_{i:03d}"))
        except (ConfigError, LaunchError, CheckpointError) as e:  # a job that cannot start, a restart that fails
            results.append(Result(drill.fault, drill.family.name, drill.rank, drill.when, None, "", None, None, "-",
                                  False, f"the drill failed: {type(e).__name__}: {e}".splitlines()[0]))
        write(results, out)  # so far: a long matrix stopped part-way keeps its table
        r = results[-1]
        print(f"[{i + 1}] {r.fault} on {r.layout}, rank {r.rank}, {r.when}: "
              f"{'ok' if r.ok else 'FAILED: ' + r.problem} ({r.exit_s} s to exit)", flush=True)
    csv_file, md_file = write(results, out)
    print(markdown(results))
    failed = [r for r in results if not r.ok]
    print(f"{len(results) - len(failed)}/{len(results)} drills ok in {time.monotonic() - started:.0f} s; "
          f"table: {csv_file}, {md_file}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
