"""Real processes: ``launch(fn, world_size)`` runs ``fn`` on N local ranks via torch's elastic launcher.

The engine is ``torch.distributed.launcher.api.elastic_launch`` (what ``torchrun`` runs): one node,
a c10d rendezvous on ``localhost`` with a port the OS picks, no restarts. Workers are forked from a
``forkserver`` that imported torch once, so only the first launch of a process pays for imports
(seconds); later ones start in well under a second. Each worker initializes
the default process group with a bounded ``timeout`` (a mismatched collective or a dead peer ends
in an error, never a hang), runs ``fn(*args)``, and tears the group down again.

Code already started by ``torchrun`` (``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` in the environment)
needs no second launcher: ``launch`` then runs ``fn`` on this process's rank and all-gathers the
results, so one script works both ways. :func:`init_from_env` / :func:`shutdown` are the same
steps for scripts that manage the group themselves.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import json
import multiprocessing
import os
import pickle
import re
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from core import tree
from shardings.runtime import watchdog
from shardings.runtime.simulate import rank_threads
from shardings.spec.errors import sharding_error
from shardings.spec.mesh import _clear_device_meshes

__all__ = ["LaunchError", "init_from_env", "launch", "shutdown"]

_ENV_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_PRELOAD = ["torch", "torch.distributed.tensor", "shardings"]
_DEAD_PEER_GRACE_S = 1.0  # >> elastic's monitor_interval (0.1 s) below


class LaunchError(RuntimeError):
    """A launched rank raised; the message holds its rank, exception and traceback text.

    Attributes:
        rank: the global rank whose exception came first.
        exc_type: the worker exception's class name, e.g. ``"ValueError"``.
        worker_traceback: the worker's formatted traceback.
    """

    def __init__(self, message: str, rank: int, exc_type: str, worker_traceback: str):
        super().__init__(message)
        self.rank, self.exc_type, self.worker_traceback = rank, exc_type, worker_traceback


def _default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _as_timedelta(timeout: float | timedelta) -> timedelta:
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)


def init_from_env(backend: str | None = None, timeout: float | timedelta = 300.0) -> int:
    """Initialize the default process group from ``torchrun``'s environment variables; return the rank.

    A no-op (returning the rank) when a group is already running. Pair it with :func:`shutdown`.

    Args:
        backend: ``"gloo"`` or ``"nccl"``; default nccl when CUDA is available, else gloo.
        timeout: seconds (or a ``timedelta``) after which a collective that cannot complete raises.

    Returns:
        This process's global rank.

    Raises:
        RuntimeError: the environment does not describe a process group (not under torchrun).

    >>> rank = init_from_env()  # doctest: +SKIP  (under `torchrun --nproc-per-node 4 train.py`)
    """
    if dist.is_initialized():
        return dist.get_rank()
    missing = [v for v in _ENV_VARS if v not in os.environ]
    if missing:
        raise sharding_error(
            f"init_from_env() needs the environment variables {_ENV_VARS}; missing {tuple(missing)}",
            fix="start the script with torchrun, or use shardings.launch(fn, world_size)",
            cls=RuntimeError,
        )
    backend = backend or _default_backend()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=_as_timedelta(timeout))
    return dist.get_rank()


def shutdown() -> None:
    """Destroy the default process group and forget the device meshes built on it."""
    _clear_device_meshes()
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def _process_group(backend: str | None, timeout: float | timedelta) -> Iterator[None]:
    owned = not dist.is_initialized()
    init_from_env(backend, timeout)
    try:
        yield
    finally:
        if owned:
            shutdown()


def _to_cpu(x: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(x, DTensor):
        x = x.to_local()
    return x.detach().cpu() if isinstance(x, torch.Tensor) else x


def _write_report(path: str, report: dict[str, Any]) -> None:
    """Write a rank's report whole or not at all: the main thread and the heartbeat thread may both report, and a
    rank may be killed mid-write (the launcher then read an empty report and crashed: found by the drills)."""
    tmp = f"{path}.{threading.get_ident()}.tmp"
    with open(tmp, "w") as f:
        json.dump(report, f)
    os.replace(tmp, path)


def _heartbeats(error_dir: str) -> str:
    return os.path.join(os.path.dirname(error_dir), "heartbeats")


def _report(e: BaseException, error_dir: str) -> None:
    """Leave the exception that ends this rank where the launcher finds it (the first one only), with the peers
    that had stopped answering by then (:func:`shardings.runtime.watchdog.explain`)."""
    rank = int(os.environ["RANK"])
    path = os.path.join(error_dir, f"rank{rank}.json")
    if not os.path.exists(path):
        why = watchdog.explain(e, _heartbeats(error_dir), int(os.environ["WORLD_SIZE"]), rank)
        _write_report(path, {"time": time.time(), "type": type(e).__name__, "message": f"{why}: {e}" if why else str(e),
                             "traceback": traceback.format_exc()})


def _report_hang(error_dir: str, message: str, stack: str, silent: dict[int, float]) -> None:
    """From the heartbeat thread: a peer stayed silent past the timeout while this rank waits in a call that has
    no deadline of its own, or in the process group's teardown after its own error (gloo's waits there for the
    silent peer). Report it as this rank's error unless one is reported, and end the process (the wait cannot be
    interrupted)."""
    path = os.path.join(error_dir, f"rank{os.environ['RANK']}.json")
    if not os.path.exists(path):
        _write_report(path, {"time": time.time(), "type": "TimeoutError", "message": message, "traceback": stack})
    # A stopped peer ignores the SIGTERM the launcher ends the others with, for 30 s (torch's spawn join, not
    # configurable): end it now, as NCCL's watchdog aborts a hung communicator.
    watchdog.end(_heartbeats(error_dir), silent)
    os._exit(1)


def _worker(
    fn: Callable[..., Any], args: tuple[Any, ...], backend: str | None, timeout: float, error_dir: str
) -> bytes:
    """One rank: run ``fn`` in a process group; return its pickled result, or leave why it failed in error_dir."""
    world = int(os.environ["WORLD_SIZE"])
    if (backend or _default_backend()) == "gloo":
        torch.set_num_threads(rank_threads(world))  # ranks share this machine's cores
    try:
        hang = functools.partial(_report_hang, error_dir)
        with watchdog.beating(_heartbeats(error_dir), int(os.environ["RANK"]), world, timeout, hang), \
                _process_group(backend, timeout):
            try:
                return pickle.dumps(tree.map(_to_cpu, fn(*args)))
            except BaseException as e:
                # Report before the group is torn down: peers fail of the teardown, and must come later.
                _report(e, error_dir)
                # Then stay alive a moment: elastic names one failed process, the first its poll finds.
                # A peer killed by a signal (whose death likely caused this error) must be that one.
                time.sleep(_DEAD_PEER_GRACE_S)
                raise
    except BaseException as e:
        _report(e, error_dir)
        raise


def _check_main_guard() -> None:
    """Workers re-import the main script (as ``__mp_main__``, multiprocessing's spawn and forkserver): a ``launch``
    reached from its top level without an ``if __name__ == "__main__":`` guard would run again in every worker, which
    fails there ("rank 1 failed without a Python exception"). Seen here, before any process starts: the main
    script's statement now running, found in its source, is not inside such an ``if``."""
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") ==
                                     "__main__"):
        frame = frame.f_back
    path = frame and frame.f_code.co_filename
    if not path or not os.path.exists(path):  # python -c, a notebook, stdin: nothing re-imported
        return
    try:
        body = ast.parse(Path(path).read_text(), path).body
    except (OSError, SyntaxError, ValueError):
        return
    line = frame.f_lineno
    while body:  # down the statements that hold the running line
        stmt = next((n for n in body if n.lineno <= line <= (n.end_lineno or n.lineno)), None)
        if stmt is None or (isinstance(stmt, ast.If) and "__name__" in ast.unparse(stmt.test)):
            return
        body = [n for field in ("body", "orelse", "finalbody", "handlers") for n in getattr(stmt, field, [])]
    raise sharding_error(
        f"launch() is reached from the top level of {path} (line {line}) without an `if __name__ == \"__main__\":` "
        "guard: each worker process re-imports that script and would launch again",
        fix="put the script's top-level code that launches under `if __name__ == \"__main__\":`",
        cls=RuntimeError,
    )


def _check_picklable(fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if main_file is not None and not os.path.exists(main_file):  # `python - < script`: workers re-run __main__
        raise sharding_error(
            f"launch() from a script read from {main_file}: worker processes cannot re-import __main__",
            fix="save the script to a .py file and run `python file.py`",
            cls=RuntimeError,
        )
    if main_file is None and getattr(fn, "__module__", None) == "__main__":
        raise sharding_error(
            f"launch({fn.__qualname__}, ...): fn is defined in an interactive session, which workers cannot import",
            fix="define fn in a .py module and import it",
            cls=TypeError,
        )
    for what, value in (("fn", fn), ("args", args)):
        try:
            pickle.dumps(value)
        except Exception as e:
            name = getattr(fn, "__qualname__", repr(fn))
            raise sharding_error(
                f"launch({name}, ...): {what} cannot be sent to worker processes ({type(e).__name__}: {e})",
                fix="define fn at module level (not a lambda or nested function) and pass picklable args",
                cls=TypeError,
            ) from e


def _first_error(error_dir: str, failed: ChildFailedError, world_size: int) -> LaunchError:
    reports = {}
    for name in os.listdir(error_dir):
        if re.fullmatch(r"rank\d+\.json", name):  # not a report still being written (*.tmp)
            with open(os.path.join(error_dir, name)) as f:
                reports[int(name.removeprefix("rank").removesuffix(".json"))] = json.load(f)
    # The rank elastic saw exit first; peers usually fail later, of its consequences.
    rank, failure = failed.get_first_failure()
    # A rank ended by a peer's watchdog (it had stopped answering: watchdog.end) is not the root cause to report:
    # the peer's error naming it silent (its own timeout, or the watchdog's TimeoutError) is.
    ended = any(f"rank {rank} (silent" in r["message"] for r in reports.values())
    if rank not in reports and not ended:  # it died without a Python exception (signal, os._exit, segfault)
        after = f" (then rank {min(reports)} raised {reports[min(reports)]['type']})" if reports else ""
        signal = f" ({failure.signal_name()})" if failure.exitcode < 0 else ""
        return LaunchError(
            f"rank {rank} of {world_size} failed without a Python exception: exit code {failure.exitcode}"
            f"{signal}{after}",
            rank,
            "ChildFailedError",
            failed.format_msg(),
        )
    # Several exceptions: the earliest is the root cause (each worker timestamps its own).
    rank = min(reports, key=lambda r: (reports[r]["time"], r))
    report, others = reports[rank], sorted(set(reports) - {rank})
    return LaunchError(
        f"rank {rank} of {world_size} raised {report['type']}: {report['message']}"
        f"{f' (ranks {others} failed after it)' if others else ''}\n\n"
        f"Worker traceback (rank {rank}):\n{report['traceback']}",
        rank,
        report["type"],
        report["traceback"],
    )


def _under_torchrun() -> bool:
    return all(v in os.environ for v in _ENV_VARS)


def _run_here(fn: Callable[..., Any], world_size: int, args: tuple[Any, ...], backend, timeout) -> list[Any]:
    with _process_group(backend, timeout):
        if dist.get_world_size() != world_size:
            raise sharding_error(
                f"launch(..., world_size={world_size}) under a running world of {dist.get_world_size()} ranks",
                fix=f"pass world_size={dist.get_world_size()}, or start torchrun with {world_size} processes",
            )
        results: list[Any] = [None] * world_size
        dist.all_gather_object(results, tree.map(_to_cpu, fn(*args)))
        return results


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str | None = None,
    timeout: float | timedelta = 300.0,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` local processes; return the results indexed by rank.

    Inside ``fn`` the default process group is running (``shardings.Mesh(...).device_mesh``
    works). Results must be picklable; tensors come back as CPU tensors, DTensors as their local
    shard. Under ``torchrun`` (environment already set), ``fn`` runs on this process's rank and
    the results are all-gathered instead.

    Args:
        fn: a module-level function (it is pickled to the workers); not a lambda or closure.
        world_size: number of ranks (processes).
        *args: picklable arguments passed to every rank.
        backend: ``"gloo"`` or ``"nccl"``; default nccl when CUDA is available, else gloo.
        timeout: seconds (or a ``timedelta``) after which a collective that cannot complete
            (a peer died, or ranks disagree on which collectives to run) raises.

    Returns:
        ``[fn's result on rank 0, ..., on rank world_size - 1]``.

    Raises:
        TypeError: ``fn`` or ``args`` cannot be pickled.
        LaunchError: a rank raised; the message names the rank and holds its traceback.

    >>> def world(): return torch.distributed.get_world_size()
    >>> launch(world, 2)  # doctest: +SKIP
    [2, 2]
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise sharding_error(f"world_size must be a positive int, got {world_size!r}", fix="pass e.g. launch(fn, 4)")
    if _under_torchrun():
        return _run_here(fn, world_size, args, backend, timeout)
    _check_main_guard()
    _check_picklable(fn, args)
    # Workers fork from one server process that imported torch once (a spawned worker pays ~5-20 s
    # of imports per launch); the server is clean (no threads, no CUDA) and ends with this process.
    multiprocessing.set_forkserver_preload(_PRELOAD)
    seconds = _as_timedelta(timeout).total_seconds()
    with tempfile.TemporaryDirectory(prefix="shardlab-launch-") as tmp:
        error_dir = os.path.join(tmp, "errors")
        os.mkdir(error_dir)
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=world_size,
            run_id=f"shardlab-{uuid.uuid4().hex[:12]}",
            rdzv_backend="c10d",
            rdzv_endpoint="localhost:0",  # the OS picks a free port: no races between concurrent launches
            max_restarts=0,
            monitor_interval=0.1,
            start_method="forkserver",
            logs_specs=DefaultLogsSpecs(log_dir=os.path.join(tmp, "logs")),
            local_addr="localhost",
        )
        try:
            pickled = elastic_launch(config, _worker)(fn, args, backend, seconds, error_dir)
        except ChildFailedError as failed:
            raise _first_error(error_dir, failed, world_size) from None
    return [pickle.loads(pickled[rank]) for rank in range(world_size)]
