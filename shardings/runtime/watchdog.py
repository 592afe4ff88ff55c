"""Heartbeats of launched ranks: when a rank's collective or pipeline receive times out, name the peers that
stopped answering (a SIGSTOPped, hung or dead process), not just the timeout.

Each rank of :func:`shardings.launch` touches its own file in a folder the launch owns every
:data:`INTERVAL_S` from a daemon thread; a process that is stopped (SIGSTOP, a debugger, swapped out) or dead
stops touching it. On the failure path only, a rank reads the others' files (:func:`silent`) and
:func:`explain` adds who went silent and in which ``torch.distributed`` call this rank was waiting.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import traceback
from collections.abc import Iterator

__all__ = ["INTERVAL_S", "SILENT_AFTER_S", "beating", "explain", "silent"]

INTERVAL_S = 0.5  # how often a rank beats
SILENT_AFTER_S = 5.0  # a rank whose last beat is older is named silent (>> INTERVAL_S: a busy machine is slow)


def _file(folder: str, rank: int) -> str:
    return os.path.join(folder, f"rank{rank}")


@contextlib.contextmanager
def beating(folder: str, rank: int) -> Iterator[None]:
    """Beat for ``rank`` into ``folder`` while the block runs."""
    os.makedirs(folder, exist_ok=True)
    file, stop = _file(folder, rank), threading.Event()
    open(file, "w").close()

    def beat() -> None:
        while not stop.wait(INTERVAL_S):
            os.utime(file)

    thread = threading.Thread(target=beat, name=f"heartbeat-rank{rank}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()


def silent(folder: str, world_size: int, me: int) -> dict[int, float]:
    """``{rank: seconds since its last beat}`` of the other ranks silent for over :data:`SILENT_AFTER_S`."""
    now, found = time.time(), {}
    for rank in range(world_size):
        file = _file(folder, rank)
        if rank != me and os.path.exists(file) and now - os.path.getmtime(file) > SILENT_AFTER_S:
            found[rank] = round(now - os.path.getmtime(file), 1)
    return found


def _waiting_in(e: BaseException) -> str | None:
    """The innermost ``torch.distributed`` function on ``e``'s traceback (the collective or receive it waited in)."""
    names = [f.name for f in traceback.extract_tb(e.__traceback__)
             if f"{os.sep}torch{os.sep}distributed{os.sep}" in f.filename and not f.name.startswith("_")]
    return names[-1] if names else None


def explain(e: BaseException, folder: str, world_size: int, me: int) -> str:
    """A sentence naming the silent peers and the call this rank waited in ('' when every peer still beats)."""
    quiet = silent(folder, world_size, me)
    if not quiet:
        return ""
    who = ", ".join(f"rank {r} (silent for {s} s)" for r, s in sorted(quiet.items()))
    where = _waiting_in(e)
    return (f"rank {me} waited{f' in {where}' if where else ''} while {who} stopped answering: stopped (SIGSTOP), "
            f"hung or dead. Fix: look at {'those ranks' if len(quiet) > 1 else 'that rank'} first")
