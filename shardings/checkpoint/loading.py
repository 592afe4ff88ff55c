"""Finding and loading checkpoints: ``latest``, ``saved_values``, ``load`` (verified, resharded into ``like``) and
``resume`` (the newest that verifies). The package docstring (``shardings.checkpoint``) tells what is verified
before anything is read, and how loading reshards.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from core import tree
from shardings.checkpoint.files import (
    MANIFEST,
    CheckpointError,
    CheckpointWarning,
    _check_files,
    _check_like,
    _distributed,
    _error,
    _read_manifest,
    _SafeReader,
    _steps,
)
from shardings.checkpoint.saving import finish_pending
from shardings.checkpoint.tensors import empty_like, is_absent, place_like
from shardings.runtime.compat import maybe_disable_local_tensor_mode

__all__ = ["latest", "load", "resume", "saved_values"]


# -- where things are -------------------------------------------------------------------------------


def latest(path: str | os.PathLike) -> str | None:
    """The newest complete checkpoint folder under ``path`` (``path/step_N``), or ``None`` if there is none.

    Waits for an asynchronous save to ``path`` still in flight first.

    >>> latest("runs/exp1/checkpoints")  # doctest: +SKIP
    'runs/exp1/checkpoints/step_300'
    """
    root = os.fspath(path)
    finish_pending(root)
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
    finish_pending(root)
    for step in reversed(_steps(root)):
        try:
            return _read_manifest(os.path.join(root, f"step_{step}"))["values"], step
        except CheckpointError:
            continue  # resume() skips it too, with its warning
    return None



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
    finish_pending(root)
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
    finish_pending(root)
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
