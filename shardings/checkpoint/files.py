"""What a checkpoint folder holds and how it is verified before any load.

The on-disk integrity layer of :mod:`shardings.checkpoint`: the ``step_N`` folder naming, the
``manifest.json`` (its format, writing and reading), the size and SHA-256 description of every
file, the checks of those files and of a ``like`` state's key paths, shapes and dtypes against the
manifest, and the restricted reader of DCP's pickled ``.metadata`` (:class:`_MetadataUnpickler`,
which builds only DCP's metadata classes, ``torch.Size`` and dtypes).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata

from shardings.runtime.simulate import simulated
from shardings.spec.errors import sharding_error

MANIFEST = "manifest.json"
_FORMAT = 1
_STEP_DIR = re.compile(r"step_(\d+)")


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved or loaded as asked; the message names the file or key path."""

    __module__ = "shardings.checkpoint"  # its public home, which re-exports it


class CheckpointWarning(UserWarning):
    """A checkpoint skipped on resume (damaged: a file missing, truncated or corrupted); an older one is used."""

    __module__ = "shardings.checkpoint"


def _error(problem: str, fix: str, path: str | None = None) -> CheckpointError:
    return sharding_error(problem, fix=fix, path=path, cls=CheckpointError)


def _distributed() -> bool:
    """Real ranks (a process group that is not :func:`shardings.simulate`'s fake one)."""
    return dist.is_available() and dist.is_initialized() and not simulated()


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


# -- where things are -------------------------------------------------------------------------------


def _steps(root: str) -> list[int]:
    """Steps of the complete checkpoints under ``root``, ascending."""
    if not os.path.isdir(root):
        return []
    found = (_STEP_DIR.fullmatch(name) for name in os.listdir(root))
    return sorted(int(m[1]) for m in found if m and os.path.isfile(os.path.join(root, m[0], MANIFEST)))


# -- describing and checking files -----------------------------------------------------------------


def _sha256(file: str) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _describe_files(folder: str, names: list[str]) -> dict[str, dict[str, Any]]:
    return {n: {"bytes": os.path.getsize(os.path.join(folder, n)), "sha256": _sha256(os.path.join(folder, n))}
            for n in names}


def _write_manifest(folder: str, manifest: dict[str, Any]) -> None:
    """Write ``folder/manifest.json`` and fsync it (the last file of a save)."""
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _read_manifest(folder: str) -> dict[str, Any]:
    file = os.path.join(folder, MANIFEST)
    try:
        with open(file) as f:
            manifest = json.load(f)
        ok = manifest.get("format") == _FORMAT and {"step", "tensors", "values", "files"} <= set(manifest)
    except (OSError, ValueError, AttributeError) as e:
        raise _error(f"cannot read {file} ({e})", fix="load an earlier checkpoint (latest() skips none)") from None
    if not ok:
        raise _error(f"{file} is not a format-{_FORMAT} manifest", fix="load a checkpoint written by checkpoint.save")
    return manifest


def _check_files(folder: str, files: dict[str, dict[str, Any]]) -> None:
    """Every file the manifest lists exists with its size and hash; ranks split the hashing."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)
    problems = []
    for i, (name, want) in enumerate(sorted(files.items())):
        file = os.path.join(folder, name)
        if not os.path.isfile(file):
            writer = re.fullmatch(r"__(\d+)_\d+\.distcp", name)
            problems.append(f"{file} is missing (written by rank {writer[1] if writer else 0})")
        elif os.path.getsize(file) != want["bytes"]:
            problems.append(f"{file} has {os.path.getsize(file)} bytes, the manifest says {want['bytes']} (truncated?)")
        elif i % world == rank and _sha256(file) != want["sha256"]:
            problems.append(f"{file} is corrupted (its SHA-256 differs from the manifest's)")
    if _distributed():
        gathered = [None] * world
        dist.all_gather_object(gathered, problems)
        problems = sorted({p for part in gathered for p in part})
    if problems:
        raise _error("; ".join(problems), fix="restore the files, or load an earlier checkpoint")


def _check_like(saved: dict[str, Any], tensors: dict[str, torch.Tensor], values: dict[str, Any], folder: str) -> None:
    want = set(tensors) | set(values)
    have = set(saved["tensors"]) | set(saved["values"])
    for what, paths in (("is not in the checkpoint", want - have), ("is saved but not in `like`", have - want)):
        if paths:
            raise _error(
                f"{sorted(paths)[0]} {what} ({len(paths)} such key paths; checkpoint {folder})",
                fix="pass `like` with the saved state's structure (same model config and optimizer)",
            )
    for path, t in tensors.items():
        info = saved["tensors"].get(path)
        if info is None:
            raise _error("`like` has a tensor where the checkpoint has a value", fix="match its structure", path=path)
        dtype = _dtype_name(t)
        if list(t.shape) != info["shape"] or dtype != info["dtype"]:
            raise _error(
                f"the checkpoint holds shape {tuple(info['shape'])} {info['dtype']}, `like` asks for "
                f"{tuple(t.shape)} {dtype} (checkpoint {folder})",
                fix="build `like` from the same model config and precision as the saved run",
                path=path,
            )


# -- reading DCP's metadata safely ----------------------------------------------------------------


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only DCP's metadata classes, ``torch.Size``, dtypes and paths: never arbitrary code."""

    _ALLOWED: ClassVar = {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("collections", "OrderedDict"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == dcp_metadata.__name__ and isinstance(getattr(dcp_metadata, name, None), type):
            return getattr(dcp_metadata, name)
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


class _SafeReader(dcp.FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        file = os.path.join(self.path, ".metadata")
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
