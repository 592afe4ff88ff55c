"""What a run says on its console, one line per event, and the same lines in ``<run dir>/train.log``.

The events: the run directory (at the start and the end), each checkpoint saved, a resume (from which step,
saved under which layout and mesh, now which), the first step's compile under ``jit=true``, the progress lines,
each warning (also kept in ``warnings.jsonl`` for ``experiments.report``), and an error: one
``Error: ... Fix: ...`` line and the path of the full trace, written to ``error.log`` in the run directory.
"""

from __future__ import annotations

import contextlib
import json
import sys
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

__all__ = ["ERROR_LOG", "LOG", "WARNINGS", "Console", "compile_done", "error_line"]

_PRINT = warnings._showwarnmsg_impl  # stdlib default: print to stderr (a console line replaces it)
LOG = "train.log"  # Hydra's job log file name for the train app: its own records land there too
ERROR_LOG = "error.log"
WARNINGS = "warnings.jsonl"


class Console:
    """Lines to ``file`` (default stderr) and appended to ``<out_dir>/train.log``; disabled: nothing anywhere.

    Args:
        out_dir: the run directory (``None``: the console only).
        enabled: whether this process speaks (rank 0 does).
    """

    def __init__(self, out_dir: str | None, enabled: bool = True, file: TextIO | None = None) -> None:
        self.out_dir, self.enabled = out_dir, enabled
        self.file = sys.stderr if file is None else file
        self._open = ""  # a line begun with begin() and not yet ended

    def line(self, text: str) -> None:
        if not self.enabled:
            return
        if self._open:  # a warning or a progress line in the middle of "compiling ...": end that line first
            print(file=self.file)
        print(text, file=self.file, flush=True)
        self.log(text)

    def log(self, text: str) -> None:
        """Append ``text`` to ``train.log`` only (what the console showed as a redrawn bar, say)."""
        if self.enabled and self.out_dir is not None:
            with open(Path(self.out_dir, LOG), "a") as f:
                f.write(text + "\n")

    def begin(self, text: str) -> None:
        """The first half of a line (``compiling ...``) that :meth:`end` completes."""
        if self.enabled:
            print(text, end="", file=self.file, flush=True)
            self._open = text

    def end(self, text: str) -> None:
        begun, self._open = self._open, ""
        if self.enabled:
            print(text, file=self.file, flush=True)
            self.log(begun + text)

    @contextlib.contextmanager
    def warnings_shown(self) -> Iterator[None]:
        """Within the block each warning is one console line and a record in ``warnings.jsonl`` (once per message)."""
        seen: set[str] = set()

        def show(message, category, filename, lineno, file=None, line=None) -> None:
            recorder = warnings._showwarnmsg_impl  # what catch_warnings(record=True) swaps in
            if recorder is not _PRINT:  # an outer recorder (pytest.warns, catch_warnings(record=True)) gets it too
                recorder(warnings.WarningMessage(message, category, filename, lineno, file, line))
            text = f"{category.__name__}: {message}"
            if text in seen:
                return
            seen.add(text)
            self.line(f"warning: {text}")
            if self.enabled and self.out_dir is not None:
                with open(Path(self.out_dir, WARNINGS), "a") as f:
                    f.write(json.dumps({"category": category.__name__, "message": str(message)}) + "\n")

        with warnings.catch_warnings():
            warnings.showwarning = show
            yield


def compile_done(graphs: int, seconds: float) -> str:
    """The end of the first step's ``compiling ...`` line: how many graphs it compiled, and how long it took.

    >>> compile_done(1, 88.04)
    ' 1 graph compiled (with its backward), done in 88.0 s (tokens/s counts the steps after it)'
    """
    what = (f"{graphs} graph{'s' if graphs != 1 else ''} compiled (with {'its' if graphs == 1 else 'their'} backward)"
            if graphs else "no graph compiled (the step ran eagerly)")
    return f" {what}, done in {seconds:.1f} s (tokens/s counts the steps after it)"


def error_line(e: BaseException, out_dir: str, trace: str | None = None) -> str:
    """Write ``e``'s full trace to ``<out_dir>/error.log`` and return the console's line for it:
    ``Error: <the message's first line> (full trace: <path>)``. The messages of this project end with ``Fix: ...``.
    """
    path = Path(out_dir, ERROR_LOG)
    path.parent.mkdir(parents=True, exist_ok=True)
    full = trace or "".join(traceback.format_exception(e))
    path.write_text(f"{type(e).__name__}: {e}\n\n{full}")
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return f"Error: {first}\nfull trace: {path}"
