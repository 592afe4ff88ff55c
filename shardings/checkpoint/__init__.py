"""Checkpoints of a whole train state over ``torch.distributed.checkpoint`` (DCP): atomic, verified, reshardable.

A state is any pytree: params and optimizer state (DTensors or plain tensors), the RNG key, the
data position, a config dict. Tensor leaves go to DCP, keyed by their ``core.tree.keystr`` path, so
each rank writes only its own shards; every other leaf (numbers, strings, ``None``) goes to
``manifest.json`` with the step, the global shape and dtype of every tensor, and the size and
SHA-256 of every file.

Layout on disk, under the root ``path``::

    step_120/            a complete checkpoint: DCP files + manifest.json (written last)
    step_130.tmp/        a save in flight (or one that crashed): ignored by latest() and load()

A save writes into ``step_N.tmp``; when every rank has finished, rank 0 writes the manifest and
renames the folder to ``step_N`` (a rename is atomic), then deletes all but the newest ``keep``.
So a crash at any point leaves the previous checkpoint intact, and ``latest`` never sees half a save.
A checkpoint damaged later (a file lost, truncated or corrupted on disk) fails :func:`load`; :func:`resume`
skips it, with a :class:`CheckpointWarning` naming it and why, and loads the newest one that verifies.

Loading reshards: ``like`` is a state in the target layout (say from ``shardings.init`` and
``step.init``, on another mesh), or plain tensors for one device; DCP reads each rank's blocks
from whichever saved shards overlap them. Before anything is read, every file is checked against
the manifest (missing, truncated or corrupted files are named), and every key path, shape and
dtype of ``like`` against the saved ones. Nothing untrusted is unpickled: tensor files are read by
DCP with ``torch.load(weights_only=True)``; DCP's ``.metadata`` is a pickle, read here by an
unpickler that only builds DCP's own metadata classes, ``torch.Size`` and dtypes, and only after
its SHA-256 matched the (JSON) manifest.

Under ``shardings.simulate`` (one process, a fake process group) each tensor is gathered and saved
whole from the one process; the files are the same format, so such checkpoints load on real ranks
and vice versa.

The on-disk side (manifest, hashes, the safe metadata reader) is in :mod:`shardings.checkpoint.files`;
how tensors become what DCP writes and reads (whole on simulated ranks, shards on real ones, another pipeline
stage's absent blocks skipped) in :mod:`shardings.checkpoint.tensors`.

May import: every other subpackage but ``testing``.
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

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from core import tree
from shardings.checkpoint.files import (
    _FORMAT,
    MANIFEST,
    CheckpointError,
    CheckpointWarning,
    _check_files,
    _check_like,
    _describe_files,
    _distributed,
    _dtype_name,
    _error,
    _read_manifest,
    _SafeReader,
    _steps,
    _write_manifest,
)
from shardings.checkpoint.files import _MetadataUnpickler as _MetadataUnpickler  # re-exported: tests use it here
from shardings.checkpoint.tensors import empty_like, is_absent, place_like, split_state
from shardings.runtime.compat import maybe_disable_local_tensor_mode

__all__ = ["CheckpointError", "CheckpointWarning", "PendingSave", "add_save_hook", "latest", "load", "resume", "save",
           "saved_values"]

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


# -- where things are -------------------------------------------------------------------------------


def latest(path: str | os.PathLike) -> str | None:
    """The newest complete checkpoint folder under ``path`` (``path/step_N``), or ``None`` if there is none.

    Waits for an asynchronous save to ``path`` still in flight first.

    >>> latest("runs/exp1/checkpoints")  # doctest: +SKIP
    'runs/exp1/checkpoints/step_300'
    """
    root = os.fspath(path)
    if root in _PENDING:
        _PENDING.pop(root).wait()
    steps = _steps(root)
    return os.path.join(root, f"step_{steps[-1]}") if steps else None


def saved_values(path: str | os.PathLike) -> tuple[dict[str, Any], int] | None:
    """The JSON values (not the tensors) of the newest checkpoint under the root ``path`` whose manifest reads.

    Cheap (the manifest only, no file is hashed): what a caller checks before it resumes, e.g. the run's
    config saved with the state. ``None`` when there is no checkpoint.

    Returns:
        ``({key path: value}, step)``.

    >>> values, step = saved_values("runs/exp1/checkpoints")  # doctest: +SKIP
    >>> values["['config']['resolved']"]  # doctest: +SKIP
    """
    root = os.fspath(path)
    if root in _PENDING:
        _PENDING.pop(root).wait()
    for step in reversed(_steps(root)):
        try:
            return _read_manifest(os.path.join(root, f"step_{step}"))["values"], step
        except CheckpointError:
            continue  # resume() skips it too, with its warning
    return None


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
    if root in _PENDING:
        _PENDING.pop(root).wait()
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


# -- loading ---------------------------------------------------------------------------------------


def _resolve(path: str) -> str:
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return path
    found = latest(path)
    if found is None:
        raise _error(
            f"no complete checkpoint in {path!r} (no {MANIFEST} there, nor any step_N/{MANIFEST} under it)",
            fix="pass a checkpoint folder or the root that save() wrote to; *.tmp folders are unfinished saves",
        )
    return found


def load(path: str | os.PathLike, like: Any = None) -> tuple[Any, int]:
    """Load a checkpoint into ``like``'s structure and layout; every rank calls it.

    Args:
        path: a checkpoint folder (``root/step_N``) or a root, whose newest complete checkpoint is used.
        like: a state in the target layout: DTensor leaves give the placements (any mesh), plain
            tensors load whole; their values are not used. ``None`` returns ``{key path: value}``
            with whole tensors.

    Returns:
        ``(state, step)``: a new state shaped like ``like``.

    Raises:
        CheckpointError: no complete checkpoint; a missing, truncated or corrupted file; a key path
            missing on either side; a shape or dtype mismatch. Nothing is loaded partially.

    >>> params = shardings.init(gpt.init, key, cfg, axes=gpt.axes(cfg), layout="zero3+tp", mesh=Mesh(dp=2, tp=2))
    >>> state, step = load("ckpt", like={"params": params, "opt_state": step_fn.init(params)})  # doctest: +SKIP
    """
    root = os.fspath(path)
    if root in _PENDING:
        _PENDING.pop(root).wait()
    folder = _resolve(root)
    return _load_verified(folder, _verified(folder), like)


def resume(path: str | os.PathLike, like: Any = None) -> tuple[Any, int]:
    """Load the newest checkpoint under the root ``path`` that verifies; every rank calls it.

    A damaged checkpoint (its manifest unreadable, a file missing, truncated or corrupted) is
    skipped with a :class:`CheckpointWarning` saying which and why, and the next older one is
    tried: a restarted job loses the steps since that one, not the run. Anything else (``like``
    with another structure, shape or dtype) raises as :func:`load` does.

    Args:
        path: the root folder ``save`` wrote ``step_N`` folders into.
        like: as for :func:`load`.

    Returns:
        ``(state, step)`` of the checkpoint loaded.

    Raises:
        CheckpointError: no complete checkpoint under ``path``, or none that verifies (each named);
            ``like`` does not match the checkpoint.

    >>> state, step = resume("ckpt", like=state)  # doctest: +SKIP
    """
    root = os.fspath(path)
    if root in _PENDING:
        _PENDING.pop(root).wait()
    damaged = []
    for step in reversed(_steps(root)):
        folder = os.path.join(root, f"step_{step}")
        try:
            saved = _verified(folder)
        except CheckpointError as e:
            damaged.append(f"{folder}: {e}")
            warnings.warn(f"resume: skipping the damaged checkpoint {folder}: {e}", CheckpointWarning, stacklevel=2)
            continue
        return _load_verified(folder, saved, like)
    if damaged:
        raise _error(f"no checkpoint under {root!r} verifies: " + " | ".join(damaged),
                     fix="restore the files, or move the folder away to start over")
    return load(root, like)  # none at all: load's error says so


def _verified(folder: str) -> dict[str, Any]:
    """``folder``'s manifest, once every file it lists has the size and SHA-256 it records."""
    saved = _read_manifest(folder)
    _check_files(folder, saved["files"])
    return saved


def _load_verified(folder: str, saved: dict[str, Any], like: Any) -> tuple[Any, int]:
    if like is None:
        paths = [*saved["tensors"], *saved["values"]]
        leaves = [torch.empty(i["shape"], dtype=getattr(torch, i["dtype"])) for i in saved["tensors"].values()]
        leaves += list(saved["values"].values())
        rebuild = lambda out: dict(zip(paths, out))
    else:
        flat, treedef = tree.flatten_with_path(like)
        paths, leaves = [tree.keystr(p) for p, _ in flat], [x for _, x in flat]
        rebuild = lambda out: tree.unflatten(treedef, out)
    tensors = {p: x for p, x in zip(paths, leaves) if isinstance(x, torch.Tensor)}
    values = {p: x for p, x in zip(paths, leaves) if not isinstance(x, torch.Tensor)}
    _check_like(saved, tensors, values, folder)
    targets = {p: empty_like(x) for p, x in tensors.items() if not is_absent(x)}  # an absent block stays so
    with maybe_disable_local_tensor_mode(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        try:
            _SafeReader(folder).read_metadata()  # first on its own: torch 2.11's dcp.load hides why it failed
            dcp.load(targets, storage_reader=_SafeReader(folder), no_dist=not _distributed())
        except (Exception, CheckpointException) as e:  # DCP's exception derives from BaseException
            raise _error(f"reading {folder} failed: {type(e).__name__}: {e}",
                         fix="restore the files, or load an earlier checkpoint") from e
    out = [(x if p not in targets else place_like(targets[p], x)) if p in tensors else saved["values"][p]
           for p, x in zip(paths, leaves)]
    return rebuild(out), saved["step"]
