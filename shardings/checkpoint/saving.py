"""Saving a train state: ``save`` into ``step_N.tmp``, then the commit (manifest, rename, prune); asynchronous saves
and their pending handles; the save hooks of fault drills. The package docstring (``shardings.checkpoint``) tells
the layout on disk and why a crash never leaves half a checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from shardings.checkpoint.files import (
    _FORMAT,
    _describe_files,
    _distributed,
    _dtype_name,
    _error,
    _steps,
    _write_manifest,
)
from shardings.checkpoint.tensors import is_absent, split_state
from shardings.runtime.compat import maybe_disable_local_tensor_mode

__all__ = ["PendingSave", "add_save_hook", "finish_pending", "save"]

_PENDING: dict[str, PendingSave] = {}  # root path -> its save still being written (async)
_SAVE_HOOKS: list[Callable[[str, str], None]] = []


def add_save_hook(hook: Callable[[str, str], None]) -> Callable[[], None]:
    """Call ``hook(moment, folder)`` at each commit moment of every later save in this process; return its remover.

    The moments: ``"written"`` (this rank's files are in ``folder``, the ``step_N.tmp`` being written; nothing
    is committed yet) and ``"manifest"`` (rank 0 only: the manifest is written, the folder not yet renamed).
    For fault drills (``experiments.drill``): a hook that kills the process or raises ``OSError(ENOSPC)`` there
    shows that such a save is never taken for a complete checkpoint.

    >>> remove = add_save_hook(lambda moment, folder: print(moment, folder))  # doctest: +SKIP
    """
    _SAVE_HOOKS.append(hook)
    return lambda: _SAVE_HOOKS.remove(hook)


def _at(moment: str, folder: str) -> None:
    for hook in list(_SAVE_HOOKS):
        hook(moment, folder)


def finish_pending(root: str) -> None:
    """Commit the asynchronous save to ``root`` still in flight, if any (what every save, load or look-up waits for)."""
    if root in _PENDING:
        _PENDING.pop(root).wait()


# -- saving ----------------------------------------------------------------------------------------


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()


class PendingSave:
    """A save whose files may still be being written; :meth:`wait` commits it (every rank must call it).

    ``save`` waits for the previous pending save to the same root by itself, so a training loop can
    ignore the handle; call ``wait()`` before the process exits.
    """

    def __init__(self, root: str, step: int, manifest: dict[str, Any], future: Future | None, keep: int | None):
        self.root, self.step, self._manifest, self._future, self._keep = root, step, manifest, future, keep
        self.path: str | None = None

    def wait(self) -> str:
        """Block until the files are written, commit the checkpoint, and return its folder.

        Raises:
            CheckpointError: writing failed (a full or read-only disk); the previous checkpoint is intact.
        """
        if self.path is None:
            with _writing(self.root, self.step):
                if self._future is not None:
                    self._future.result()
                self.path = _commit(self.root, self.step, self._manifest, self._keep)
            if _PENDING.get(self.root) is self:
                del _PENDING[self.root]
        return self.path


def save(
    path: str | os.PathLike, state: Any, step: int, *, keep: int | None = 3, async_: bool = False
) -> PendingSave:
    """Save ``state`` as ``path/step_{step}``, atomically; every rank calls it with its own shards.

    Args:
        path: the root folder of a run's checkpoints.
        state: a pytree of tensors/DTensors and JSON values (numbers, strings, ``None``).
        step: the training step, a non-negative int; an existing ``step_{step}`` is replaced.
        keep: how many complete checkpoints to keep (the newest); ``None`` keeps all.
        async_: return once the tensors are staged in memory, writing the files in a background
            thread; the checkpoint is committed by ``PendingSave.wait()`` (called by the next
            ``save``/``latest``/``load`` of the same root).

    Returns:
        A :class:`PendingSave`; ``.wait()`` returns the checkpoint folder (already done when not async).

    Raises:
        CheckpointError: a leaf that is neither a tensor nor a JSON value, a bad ``step`` or ``keep``; writing
            failed (a full or read-only disk: the message says so, and that the previous checkpoint is intact).

    >>> save("ckpt", {"params": params, "opt_state": opt_state, "data": {"position": 640}}, step=20)  # doctest: +SKIP
    """
    root = os.fspath(path)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise _error(f"step must be a non-negative int, got {step!r}", fix="pass the training step, e.g. step=100")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise _error(f"keep must be a positive int or None, got {keep!r}", fix="pass e.g. keep=3")
    finish_pending(root)
    tensors, values = split_state(state)
    described = {p: {"shape": list(t.shape), "dtype": _dtype_name(t)} for p, t in tensors.items()}
    # pp on real processes: a rank holds its own stage's blocks, the others are absent. Each rank writes
    # what it holds; the manifest lists every rank's tensors.
    tensors = {p: t for p, t in tensors.items() if not is_absent(t)}
    if _distributed():
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, described)
        described = {p: info for part in parts for p, info in part.items()}
    tmp = os.path.join(root, f"step_{step}.tmp")
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crashed save
        os.makedirs(tmp)
    _barrier()
    manifest = {
        "format": _FORMAT,
        "step": step,
        "world_size": dist.get_world_size() if _distributed() else 1,
        "tensors": described,
        "values": values,
    }
    kwargs = {"checkpoint_id": tmp, "no_dist": not _distributed()}
    with maybe_disable_local_tensor_mode(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process.*")
        if not async_:
            with _writing(root, step):
                dcp.save(tensors, **kwargs)
            future = None
        else:
            future = dcp.async_save(tensors, process_group=_async_group(), **kwargs)
    pending = PendingSave(root, step, manifest, future, keep)
    if async_:
        _PENDING[root] = pending
    else:
        pending.wait()
    return pending


@contextlib.contextmanager
def _writing(root: str, step: int) -> Iterator[None]:
    """A failed write (a full or read-only disk: OSError, or DCP's exception wrapping one) as a CheckpointError."""
    try:
        yield
    except (OSError, CheckpointException) as e:
        steps = _steps(root)
        intact = f"the newest complete one, step_{steps[-1]}, is intact" if steps else "there is no earlier one"
        raise _error(
            f"saving step_{step} under {root} failed ({type(e).__name__}: {e}); it is left an unfinished "
            f"step_{step}.tmp, which latest(), load() and resume() ignore; {intact}",
            fix="free space on that disk (or make it writable), or save elsewhere; a restart resumes from the "
                "newest complete checkpoint",
        ) from e


_ASYNC_GROUPS: dict[int, Any] = {}


def _async_group() -> Any:
    """A gloo group for background saves, so their collectives never interleave with training's."""
    if not _distributed():
        return None
    world = id(dist.group.WORLD)
    if world not in _ASYNC_GROUPS:
        _ASYNC_GROUPS[world] = dist.new_group(backend="gloo")
    return _ASYNC_GROUPS[world]


def _commit(root: str, step: int, manifest: dict[str, Any], keep: int | None) -> str:
    """Hash each rank's files, then rank 0 writes the manifest, renames ``.tmp`` away and prunes."""
    tmp, final = os.path.join(root, f"step_{step}.tmp"), os.path.join(root, f"step_{step}")
    rank = _rank()
    mine = sorted(n for n in os.listdir(tmp) if n.startswith(f"__{rank}_") or (rank == 0 and n == ".metadata"))
    _at("written", tmp)
    files = [_describe_files(tmp, mine)]
    if _distributed():
        files = [None] * dist.get_world_size()
        dist.all_gather_object(files, _describe_files(tmp, mine))
    if rank == 0:
        manifest = {**manifest, "time": time.time(), "files": {k: v for part in files for k, v in part.items()}}
        _write_manifest(tmp, manifest)
        _at("manifest", tmp)
        if os.path.exists(final):
            os.replace(final, final + ".old")
        os.replace(tmp, final)
        shutil.rmtree(final + ".old", ignore_errors=True)
        for old in _steps(root)[: -keep if keep else 0]:
            shutil.rmtree(os.path.join(root, f"step_{old}"), ignore_errors=True)
    _barrier()
    return final


