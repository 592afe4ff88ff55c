"""The data pipeline: an offline byte corpus, packed into sequences, each rank reading only its rows.

The corpus is one stream of bytes (token = byte, vocab 256): by default the Python standard
library's own ``.py`` files, in sorted path order, each followed by a ``\\0`` separator, so it
exists on every machine with nothing downloaded. The stream is cut into packed rows of
``seq_len + 1`` bytes (consecutive rows overlap by one byte: the last label of a row is the first
token of the next); rows are shuffled by a seeded permutation per epoch.

Batch ``position`` (the number of global batches already consumed) fixes everything: which rows,
in which order. A :class:`DataState` is that position, so saving it and resuming continues the
same token stream exactly. Each rank builds only its block of the global batch — the block the
layout's ``batch`` spec gives it (``shardings.from_callback``) — as a DTensor, so no rank
reads or holds another rank's rows.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sysconfig
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor

from shardings import Mesh, P, check_batch_rows, from_callback, layouts, logical_to_spec

__all__ = ["DataState", "Packed", "batch_spec", "load_corpus", "read_files", "stdlib_files"]

SEPARATOR = b"\0"  # between documents; never occurs in Python source


class DataState(NamedTuple):
    """Where the pipeline stands: global batches consumed so far (the whole resumable state)."""

    position: int = 0


def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files (no site-packages, no tests), sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "__pycache__"}
    files = [p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts[:-1])]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def read_files(files: list[Path], max_bytes: int) -> torch.Tensor:
    """Concatenate files (each followed by a separator) into a uint8 stream of at most ``max_bytes``."""
    chunks, total = [], 0
    for path in files:
        data = path.read_bytes() + SEPARATOR
        chunks.append(data[: max_bytes - total])
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


def load_corpus(source: str, max_bytes: int, seed: int = 0) -> torch.Tensor:
    """The byte stream for a ``data.source``: ``"stdlib"``, ``"random"`` or a directory of text files.

    >>> load_corpus("stdlib", 1000).shape
    torch.Size([1000])
    """
    if source == "stdlib":
        return read_files(stdlib_files(), max_bytes)
    if source == "random":
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(0, 256, (max_bytes,), generator=gen, dtype=torch.uint8)
    if not os.path.isdir(source):
        raise ValueError(
            f"data.source={source!r} is neither 'stdlib', 'random' nor a directory. "
            f"Fix: pass data.source=stdlib, data.source=random or data.source=/path/to/text/files."
        )
    return read_files(sorted(p for p in Path(source).rglob("*") if p.is_file()), max_bytes)


@functools.lru_cache(maxsize=4)
def _permutation(rows: int, seed: int, epoch: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(rows, generator=gen)


def batch_spec(layout: Any, mesh: Mesh) -> P:
    """The spec of a ``(batch, seq)`` input under the layout's ``batch`` rules (e.g. ``P(("dp", "fsdp"))``)."""
    return logical_to_spec(("batch", "seq"), layouts.get(layout).role("batch"), mesh)


@dataclasses.dataclass(frozen=True)
class Packed:
    """Packed next-token batches over a byte stream.

    Args:
        stream: the corpus, a 1-D uint8 tensor.
        seq_len: tokens per row.
        batch_size: rows per global batch.
        seed: the shuffling seed.
    """

    stream: torch.Tensor
    seq_len: int
    batch_size: int
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rows < self.batch_size:
            raise ValueError(
                f"the corpus ({self.stream.numel()} bytes) packs into {self.rows} rows of {self.seq_len + 1} bytes, "
                f"fewer than one batch of {self.batch_size}. Fix: raise data.max_bytes or lower data.batch_size."
            )

    @property
    def rows(self) -> int:
        """Packed rows in the stream (the tail that does not fill a row is dropped)."""
        return (self.stream.numel() - 1) // self.seq_len

    @property
    def batches_per_epoch(self) -> int:
        return self.rows // self.batch_size

    def global_rows(self, state: DataState) -> torch.Tensor:
        """Row indices of the global batch at ``state`` (``batch_size`` of them)."""
        epoch, i = divmod(state.position, self.batches_per_epoch)
        return _permutation(self.rows, self.seed, epoch)[i * self.batch_size : (i + 1) * self.batch_size]

    def block(self, state: DataState, block: tuple[slice, slice] = (slice(None), slice(None))) -> dict[str, Any]:
        """``{"tokens", "labels"}`` int64 for one block ``(rows, positions)`` of the global batch at ``state``."""
        rows = self.global_rows(state)[block[0]]
        offsets = torch.arange(self.seq_len + 1)[block[1].start : (block[1].stop or self.seq_len) + 1]
        windows = self.stream[(rows * self.seq_len)[:, None] + offsets].long()  # (rows, positions + 1)
        return {"tokens": windows[:, :-1].contiguous(), "labels": windows[:, 1:].contiguous()}

    def next(self, state: DataState) -> tuple[dict[str, torch.Tensor], DataState]:
        """The full global batch at ``state`` and the state after it (the single-device path)."""
        return self.block(state), DataState(state.position + 1)

    def next_sharded(self, state: DataState, layout: Any, mesh: Mesh) -> tuple[dict[str, DTensor], DataState]:
        """This rank's block of the global batch as DTensors placed by the batch spec, and the next state.

        Under ``simulate`` each simulated rank gets its own block; in a real process group, the
        block of ``dist.get_rank()``. Either way a rank materializes only its own rows.
        """
        spec = batch_spec(layout, mesh)
        check_batch_rows(self.batch_size, mesh.axis_size(spec.dim_axes()[0]), setting="data.batch_size",
                         spec=spec, mesh=mesh)

        def part(key: str) -> DTensor:  # one block per (simulated) rank
            return from_callback((self.batch_size, self.seq_len), spec, mesh, lambda rows: self.block(state, rows)[key])

        return {"tokens": part("tokens"), "labels": part("labels")}, DataState(state.position + 1)
