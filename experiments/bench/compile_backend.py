"""The benches' compile backend (``--jit-backend``): one option for every compiled row, ours and torch's.

``inductor``, the default, is what ``train_step(jit=True)`` compiles with unless told otherwise: fused, generated
kernels (C++ on the CPU), what a benchmark measures. ``aot_eager`` traces the same dynamo graphs and
AOTAutograd's forward/backward split but runs them with eager kernels: no code generation, so seconds to compile
and no C++ compiler — what the tests use, checking losses, graph counts and columns. Its step times are not a
speed claim, and the output says so (:func:`caveat`).
"""

from __future__ import annotations

import argparse

import shardings

# train_step's own default: the benches measure what train_step(jit=True) runs when not told otherwise.
DEFAULT: str = shardings.DEFAULT_JIT_BACKEND
CHOICES = ("inductor", "aot_eager")


def add_option(parser: argparse.ArgumentParser) -> None:
    """Add ``--jit-backend`` (parsed as ``jit_backend``) to a bench's ``parser``."""
    parser.add_argument(
        "--jit-backend", default=DEFAULT, choices=CHOICES,
        help=f"torch.compile backend of every compiled row, both sides (default {DEFAULT}: what a benchmark "
             "measures; aot_eager: the same graphs without code generation, quick to compile, no speed claim)",
    )  # fmt: skip


def caveat(jit_backend: str) -> str:
    """The line a table's header carries about its compiled rows' backend (a warning unless it is the default).

    >>> caveat("aot_eager")[:45]
    'compiled rows: aot_eager (no code generation)'
    """
    if jit_backend == DEFAULT:
        return f"compiled rows: {jit_backend}"
    return (f"compiled rows: {jit_backend} (no code generation): their step times and ratios are not a speed claim; "
            f"rerun with --jit-backend {DEFAULT} to measure")
