"""The training progress display: a tqdm bar on a terminal, plain lines in a log.

A bar redraws itself with carriage returns, which a file, a CI log or a SLURM ``.out`` keeps as hundreds of
fragments on one line. Written anywhere but a terminal, progress is one plain line every ``every`` steps (and
at the last step) instead::

    zero3+tp step 20/60 (33%) | loss 3.412 | 41,233 tok/s | comm 1.2 MiB/step | mem 3.1 MiB/rank | 12.4s

Those plain lines also go to ``log`` (the run's ``train.log``), under a bar too.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

from tqdm import tqdm

__all__ = ["Progress"]


class Progress:
    """``update(status)`` once per step; ``close()`` at the end. Disabled: does nothing.

    Args:
        total: the last step. initial: the step already done (a resumed run).
        every: plain-line period in steps; 0 picks about 20 lines per run. A terminal ignores it.
        file: where to write (default stderr); ``isatty()`` picks bar or lines.
        log: also called with each plain line (a bar or not), e.g. ``Console.log``.
    """

    def __init__(self, total: int, *, initial: int = 0, desc: str = "", enabled: bool = True, every: int = 0,
                 file: TextIO | None = None, log: Callable[[str], None] | None = None) -> None:
        self.file = sys.stderr if file is None else file
        self.log = log
        self.total, self.step, self.desc = total, initial, desc
        self.enabled = enabled
        self.every = every if every > 0 else max(1, total // 20)
        self.bar = None
        if enabled and _is_terminal(self.file):
            self.bar = tqdm(total=total, initial=initial, desc=desc, file=self.file)
        self._t0 = time.perf_counter()

    def update(self, status: str) -> None:
        self.step += 1
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(status, refresh=False)
            self.bar.update()
        if self.step % self.every == 0 or self.step == self.total:
            pct = 100 * self.step / self.total if self.total else 100
            elapsed = time.perf_counter() - self._t0
            line = f"{self.desc} step {self.step}/{self.total} ({pct:.0f}%) | {status} | {elapsed:.1f}s"
            if self.bar is None:
                print(line, file=self.file, flush=True)
            if self.log is not None:
                self.log(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _is_terminal(file: TextIO) -> bool:
    try:
        return file.isatty()
    except (AttributeError, ValueError):  # closed or not a real stream
        return False
