"""Heartbeats of launched ranks: a rank waiting on a peer that stopped answering (a SIGSTOPped, hung or dead
process) fails within the process group's timeout, naming that peer and the call it waited in.

Each rank of :func:`shardings.launch` touches its own file in a folder the launch owns every
:data:`INTERVAL_S` from a daemon thread; a process that is stopped (SIGSTOP, a debugger, swapped out) or dead
stops touching it. Two ways out of a hang, both naming the silent peers (:func:`silent`):

- the wait times out by itself (gloo's collectives and receives do, after the group's timeout): the rank's error
  gets :func:`explain`'s sentence (who went silent, and the ``torch.distributed`` call on its traceback);
- the wait never times out (a functional collective's ``wait_tensor`` waits without a deadline: found by the
  MoE dp+ep drill, which hung for minutes): once a peer has been silent for the group's timeout, the heartbeat
  thread itself calls ``on_hang`` with the same sentence, the main thread's waiting call read off its stack.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator

__all__ = ["INTERVAL_S", "SILENT_AFTER_S", "beating", "end", "explain", "silent", "waiting_for"]

INTERVAL_S = 0.5  # how often a rank beats
SILENT_AFTER_S = 5.0  # a rank whose last beat is older is named silent (>> INTERVAL_S: a busy machine is slow)


def _file(folder: str, rank: int) -> str:
    return os.path.join(folder, f"rank{rank}")


@contextlib.contextmanager
def beating(folder: str, rank: int, world_size: int, timeout_s: float,
            on_hang: Callable[[str, str, dict[int, float]], None]) -> Iterator[None]:
    """Beat for ``rank`` into ``folder`` while the block runs; call ``on_hang(message, stack, silent)`` from the
    heartbeat thread (once) when peers have been silent for ``timeout_s`` (the process group's timeout)."""
    os.makedirs(folder, exist_ok=True)
    file, stop, main = _file(folder, rank), threading.Event(), threading.get_ident()
    with open(file, "w") as f:
        f.write(str(os.getpid()))  # for end(): the process to stop once it is silent

    def beat() -> None:
        while not stop.wait(INTERVAL_S):
            try:
                os.utime(file)
            except FileNotFoundError:  # the launcher removed the folder at teardown: nothing left to beat for
                return
            hung = silent(folder, world_size, rank, after_s=timeout_s)
            if hung:
                frames = traceback.extract_stack(sys._current_frames()[main])
                where = _WAITING[0] or _distributed_call(frames)
                on_hang(_sentence(rank, hung, where) + f" (for over the timeout, {timeout_s} s)",
                        "".join(traceback.format_list(frames)), hung)
                return

    thread = threading.Thread(target=beat, name=f"heartbeat-rank{rank}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=2 * INTERVAL_S)  # no beat touches the file once it is gone (on_hang may still run)
        with contextlib.suppress(OSError):  # done (or failing of its own error): never taken for a silent peer
            os.remove(file)


def silent(folder: str, world_size: int, me: int, after_s: float = SILENT_AFTER_S) -> dict[int, float]:
    """``{rank: seconds since its last beat}`` of the other ranks silent for over ``after_s``."""
    now, found = time.time(), {}
    for rank in range(world_size):
        try:
            last = os.path.getmtime(_file(folder, rank))
        except FileNotFoundError:  # not started, or done (its file removed while this looked)
            continue
        if rank != me and now - last > after_s:
            found[rank] = round(now - last, 1)
    return found


_WAITING: list[str | None] = [None]  # what this process's main thread waits for (waiting_for), else None


@contextlib.contextmanager
def waiting_for(what: str) -> Iterator[None]:
    """Name what the block waits for (``"for the activations of microbatch 2 from rank 0 (stage 0)"``), for the
    message when the peer goes silent; the pipeline executor's receives use it (they know their peer)."""
    before, _WAITING[0] = _WAITING[0], what
    try:
        yield
    finally:
        _WAITING[0] = before


def _distributed_call(frames: traceback.StackSummary) -> str | None:
    """``"in <f>"``: the innermost public ``torch.distributed`` function among ``frames`` (the collective waited in)."""
    names = [f.name for f in frames if f"{os.sep}torch{os.sep}distributed{os.sep}" in f.filename
             and not f.name.startswith("_") and f.name != "wrapper"]  # wrapper: c10d's logging decorator
    return f"in {names[-1]}" if names else None


def _sentence(me: int, quiet: dict[int, float], where: str | None) -> str:
    who = ", ".join(f"rank {r} (silent for {s} s)" for r, s in sorted(quiet.items()))
    return (f"rank {me} waited{f' {where}' if where else ''} while {who} stopped answering: stopped (SIGSTOP), "
            f"hung or dead. Fix: look at {'those ranks' if len(quiet) > 1 else 'that rank'} first")


def explain(e: BaseException, folder: str, world_size: int, me: int) -> str:
    """A sentence naming the silent peers and the call this rank waited in ('' when every peer still beats)."""
    quiet = silent(folder, world_size, me)
    where = _WAITING[0] or _distributed_call(traceback.extract_tb(e.__traceback__))
    return _sentence(me, quiet, where) if quiet else ""


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])  # the field after the state: the parent's pid
    except (OSError, ValueError, IndexError):
        return None


def end(folder: str, ranks: dict[int, float]) -> None:
    """SIGKILL the silent ``ranks``' processes that are this process's siblings (the same launch's workers)."""
    for rank in ranks:
        with contextlib.suppress(OSError, ValueError):
            with open(_file(folder, rank)) as f:
                pid = int(f.read())
            if _parent(pid) == os.getppid():
                os.kill(pid, signal.SIGKILL)
