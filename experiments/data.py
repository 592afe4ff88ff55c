"""The data pipeline: a corpus, packed into sequences, each rank reading only its rows.

The batch contract (what every model's ``loss`` takes): ``{"tokens", "labels"}``, both int64 of shape
``(batch_size, seq_len)``, ``labels`` the next token after each of ``tokens`` (``-100``, the ignore index, where
there is none). Tokens are ids below the model's ``vocab``: bytes (vocab 256) by default.

Where they come from (``data`` config): ``data.source`` ``stdlib`` (default), ``random`` or a directory of text
files, read as bytes; ``data.path=`` one file: a text file read as bytes, or a pre-tokenized token file
(``.bin``, or ``data.dtype=uint16|uint32``: a flat array of ids, nanoGPT's ``train.bin`` format), memory-mapped
(``np.memmap``) and never read whole; ``data.name=<module>``: your own batches, a module with
``batches(conf, batch_size, seq_len)`` yielding global batches by the contract (:class:`FromIterator`).

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
import random
import sysconfig
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor

from shardings import Mesh, P, check_batch_rows, from_callback, layouts, logical_to_spec

__all__ = ["DataState", "FromIterator", "Packed", "batch_spec", "load_corpus", "mismatch", "read_files", "source",
           "stdlib_files", "token_file"]

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
    if source == "random":  # Python's generator: under simulated ranks torch's RNG ops draw one stream per rank
        return torch.frombuffer(bytearray(random.Random(seed).randbytes(max_bytes)), dtype=torch.uint8)
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
        return _placed(lambda block: self.block(state, block), self.batch_size, self.seq_len, layout, mesh), \
            DataState(state.position + 1)


def _placed(block: Any, batch_size: int, seq_len: int, layout: Any, mesh: Mesh) -> dict[str, DTensor]:
    """``{"tokens", "labels"}`` DTensors placed by the batch spec, each rank's block from ``block(slices)``."""
    spec = batch_spec(layout, mesh)
    check_batch_rows(batch_size, mesh.axis_size(spec.dim_axes()[0]), setting="data.batch_size", spec=spec, mesh=mesh)

    def part(key: str) -> DTensor:  # one block per (simulated) rank
        return from_callback((batch_size, seq_len), spec, mesh, lambda rows: block(rows)[key])

    return {"tokens": part("tokens"), "labels": part("labels")}


class FromIterator:
    """Your own batches: the global batches an iterator yields, checked against the contract and placed.

    Every rank runs the same iterator (it must be deterministic: the same batches in the same order on every
    rank and every run), so a resume at position ``p`` skips its first ``p`` batches.

    Args:
        batches: an iterator of global batches ``{"tokens", "labels"}``, int64 ``(batch_size, seq_len)``.
        batch_size, seq_len: what the run expects of each batch.
        where: the config key it came from, for errors.
    """

    def __init__(self, batches: Any, batch_size: int, seq_len: int, where: str) -> None:
        self.batches, self.batch_size, self.seq_len, self.where = iter(batches), batch_size, seq_len, where
        self.position = 0

    def _at(self, state: DataState) -> dict[str, torch.Tensor]:
        if state.position < self.position:
            raise ValueError(f"{self.where}: batch {state.position} was asked after batch {self.position - 1}; an "
                             "iterator only goes forward. Fix: read batches in order (a resume starts a new iterator).")
        while self.position <= state.position:
            try:
                batch = next(self.batches)
            except StopIteration:
                raise ValueError(f"{self.where}: the iterator ended after {self.position} batches. Fix: yield at least "
                                 "`steps` batches (cycle over your data), or lower steps.") from None
            self.position += 1
        want = (self.batch_size, self.seq_len)
        for key in ("tokens", "labels"):
            x = batch.get(key) if isinstance(batch, dict) else None
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != want or x.dtype != torch.int64:
                got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(f"{self.where}: batch {state.position}[{key!r}] is {got}, the run needs int64 {want} "
                                 "(data.batch_size, the sequence length). Fix: yield {'tokens', 'labels'} int64 "
                                 "tensors of that shape (docs/experiments.md#data).")
        return batch

    def next(self, state: DataState) -> tuple[dict[str, torch.Tensor], DataState]:
        return self._at(state), DataState(state.position + 1)

    def next_sharded(self, state: DataState, layout: Any, mesh: Mesh) -> tuple[dict[str, DTensor], DataState]:
        batch = self._at(state)
        return _placed(lambda block: {k: v[block] for k, v in batch.items()}, self.batch_size, self.seq_len, layout,
                       mesh), DataState(state.position + 1)


_TOKEN_DTYPES = ("uint16", "uint32")


def token_file(path: str, dtype: str) -> torch.Tensor:
    """A pre-tokenized file (a flat array of ``dtype`` ids, nanoGPT's ``.bin``), memory-mapped, as a 1-D tensor
    over the mapping (no copy: pages are read as rows are)."""
    import numpy as np  # a dependency of tensorboard's; only token files need it

    mapped = np.memmap(path, dtype=dtype, mode="r")
    wide = mapped.view(np.int16 if dtype == "uint16" else np.int32)  # torch indexes signed ints; ids are < 2**31
    with warnings.catch_warnings():  # the mapping is read-only: nothing writes to it
        warnings.simplefilter("ignore", UserWarning)
        stream = torch.from_numpy(wide)
    return _Unsigned(stream, dtype)


class _Unsigned(NamedTuple):
    """A signed view of unsigned ids: indexing it gives the ids as int64 (``Packed`` indexes, then ``.long()``)."""

    signed: torch.Tensor
    dtype: str

    def __getitem__(self, index: Any) -> torch.Tensor:
        x = self.signed[index].long()
        return x & (0xFFFF if self.dtype == "uint16" else 0xFFFFFFFF)

    def numel(self) -> int:
        return self.signed.numel()


def source(conf: Any, seq_len: int, vocab: int | None) -> tuple[Any, str]:
    """The run's batches for a ``data`` config node (``Packed`` or :class:`FromIterator`), and one line saying what
    they are, for the console.

    Raises:
        ValueError: a file that is not there, an unknown ``data.dtype``, ids the model's ``vocab`` cannot embed.
    """
    if conf.get("name"):
        from experiments.build import _import  # the one importer of user modules (model, optim, data)

        module = _import(f"data.name={conf.name}", "a module with batches(conf, batch_size, seq_len)", ("batches",))
        return (FromIterator(module.batches(conf, batch_size=conf.batch_size, seq_len=seq_len), conf.batch_size,
                             seq_len, f"data.name={conf.name}"), f"data: {conf.name}.batches (your iterator)")
    path = conf.get("path")
    if not path:
        stream = load_corpus(conf.source, conf.max_bytes, conf.seed)
        return Packed(stream, seq_len, conf.batch_size, conf.seed), f"data: {conf.source}, {stream.numel():,} bytes"
    if not os.path.isfile(path):
        raise ValueError(f"data.path={path!r} is not a file. Fix: pass a text file or a token file (.bin).")
    dtype = conf.get("dtype") or ("uint16" if path.endswith(".bin") else "bytes")
    if dtype == "bytes":
        stream = read_files([Path(path)], conf.max_bytes)[:-1]  # no separator after the one document
        what, top = f"{stream.numel():,} bytes of text (data.max_bytes={conf.max_bytes:,})", 255
    elif dtype in _TOKEN_DTYPES:
        stream = token_file(path, dtype)
        import numpy as np

        top = int(np.memmap(path, dtype=dtype, mode="r").max()) if stream.numel() else 0  # one pass, no copy
        what = f"{stream.numel():,} {dtype} tokens, memory-mapped"
    else:
        raise ValueError(f"data.dtype={dtype!r} is unknown. Fix: use bytes (a text file), uint16 or uint32 (token "
                         "files), or null (from the suffix: .bin is uint16).")
    if vocab is not None and top >= vocab:
        raise ValueError(f"data.path={path!r} holds token id {top}, but the model's vocab is {vocab}. Fix: set "
                         f"model.config.vocab={top + 1} or more (the tokenizer's vocabulary size).")
    return Packed(stream, seq_len, conf.batch_size, conf.seed), f"data: {path}, {what}"


def _byte_text(conf: Any) -> bool:
    """Whether ``conf`` (a ``data`` node) reads text as bytes (ids 0-255): a corpus, or a file that is not token ids."""
    if conf.get("name"):
        return False
    path = conf.get("path")
    return not path or (conf.get("dtype") or ("uint16" if str(path).endswith(".bin") else "bytes")) == "bytes"


def _described(batch: Any) -> str:
    if not isinstance(batch, dict):
        return type(batch).__name__
    return "{" + ", ".join(f"{k!r}: " + (f"{str(v.dtype).removeprefix('torch.')} {tuple(v.shape)}"
                                        if isinstance(v, torch.Tensor) else type(v).__name__)
                           for k, v in batch.items()) + "}"


def mismatch(conf: Any, name: str, module: Any, model_cfg: Any) -> str | None:
    """Why model ``name`` (its module and config) cannot train on the batches ``conf`` (a ``data`` node) makes, or
    ``None``: checked before any process starts. The data gives the contract's ``{"tokens", "labels"}``, int64
    ``(batch_size, seq_len)`` (module docstring); the model's own example batch must be that, its sequence length
    must come from ``data.seq_len`` or its config's ``seq_len``, and byte text's ids (0-255) must be below its
    config's ``vocab`` (a token file's ids are checked by :func:`source`, which reads them)."""
    example = module.example_batch(model_cfg, 2)
    tokens = example.get("tokens") if isinstance(example, dict) else None
    same_kind = isinstance(example, dict) and set(example) == {"tokens", "labels"} and all(
        isinstance(v, torch.Tensor) and v.dtype == torch.int64 and v.ndim == 2 and v.shape == tokens.shape
        for v in example.values())
    no_seq = conf.get("seq_len") is None and not hasattr(model_cfg, "seq_len")
    vocab = getattr(model_cfg, "vocab", None)
    small_vocab = _byte_text(conf) and isinstance(vocab, int) and vocab < 256
    problems = [why for why, bad in ((f"its example batch is {_described(example)}", not same_kind),
                                     ("its Config has no seq_len (and data.seq_len is not set)", no_seq),
                                     (f"its vocab is {vocab}, which cannot embed byte ids up to 255", small_vocab))
                if bad]
    if not problems:
        return None
    if not same_kind:  # another kind of input: no setting makes text of it
        fix = ("train it through the API on batches of its own kind (shardings.train_step, or "
               "shardings.testing.check_equivalence; docs/models.md#training-it)")
    else:
        fix = " and ".join(f for f, bad in (("set model.config.vocab=256 (or more)", small_vocab),
                                             ("set data.seq_len", no_seq)) if bad)
    gives = "{'tokens', 'labels'}, int64 (data.batch_size, seq_len): next-token rows" + (
        " of byte ids 0-255" if _byte_text(conf) else "")
    return (f"model.name={name} cannot train on experiments.train's data: the data gives {gives}, but "
            f"{'; '.join(problems)}. Fix: {fix}.")
