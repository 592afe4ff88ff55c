"""TeraPipe's chunk sizes: where to cut each microbatch's sequence so that the pipeline finishes first.

With causal attention a chunk of ``l`` tokens after a prefix of ``p`` tokens costs more the longer its prefix:
its matmuls cost ``a·l`` and its attention ``b·l·(p + (l + 1)/2)`` (each query attends over the prefix and the
chunk's earlier tokens), so equal chunks are unequal work, and the slowest chunk sets the pipeline's pace.
TeraPipe (Li et al. 2021, arXiv 2102.07988, §3.3) picks the cuts by a dynamic program: a pipeline of ``K`` stages
running ``m`` microbatches of chunks with costs ``t_1..t_n`` takes

    T = m · Σ t_i + (K − 1) · max t_i

(every stage runs every chunk; the first chunk to leave the pipeline waits ``K − 1`` of the slowest chunk's
slots). TeraPipe enumerates ``max t_i`` and, for each, minimizes ``Σ t_i`` by a dynamic program. With a *fixed*
number of chunks ``k`` (``seq_chunks``) and the cost model above, ``Σ t_i`` does not depend on the cuts: the
chunks together run every token's matmuls and every causal (query, key) pair once, whatever the cuts, plus a
per-chunk overhead ``c·k``. So minimizing ``T`` is minimizing the slowest chunk, which the dynamic program here
does exactly (over cut positions on a grid of ``quantum`` tokens; at most :data:`GRID` cut positions).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import torch

from shardings.pipeline.schedule import ScheduleError
from shardings.runtime.compat import pytree
from shardings.spec.errors import sharding_error

__all__ = ["GRID", "SeqChunks", "cut", "seq_length"]

GRID = 256  # the most cut positions the dynamic program considers (a coarser grid beyond: O(k · GRID²))
RULES = ("terapipe", "equal")


@dataclasses.dataclass(frozen=True)
class SeqChunks:
    """How a pipeline cuts each microbatch's sequence into ``count`` chunks (TeraPipe).

    Attributes:
        count: chunks per sequence (``seq_chunks``).
        rule: ``"terapipe"`` (the dynamic program: module docstring), ``"equal"`` (equal chunks, the remainder
            spread over the first ones) or explicit sizes (a tuple adding up to the sequence length).
        token_cost: the cost of a token's matmuls in one block (default: 2 FLOPs per block parameter).
        pair_cost: the cost of one (query, key) pair of attention in one block (default: 4 FLOPs per attention
            width, for ``q kᵀ`` and the weighted sum of values).
        chunk_cost: a fixed cost per chunk (kernel launches, messages), in the same unit.
        quantum: chunk sizes are multiples of it (a sequence-parallel layout: the ranks sharing ``seq``).
        stages: the pipeline's stages ``K`` and ``microbatches`` its ``m``: the terms of ``T``.
    """

    count: int
    rule: str | tuple[int, ...] = "terapipe"
    token_cost: float = 1.0
    pair_cost: float = 0.0
    chunk_cost: float = 0.0
    quantum: int = 1
    stages: int = 1
    microbatches: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.count, int) or self.count < 1:
            raise sharding_error(f"seq_chunks={self.count!r}", fix="pass an integer seq_chunks >= 1", cls=ScheduleError)
        if isinstance(self.rule, str) and self.rule not in RULES:
            raise sharding_error(f"chunk rule {self.rule!r}", fix=f"use one of {RULES} or explicit sizes",
                                 cls=ScheduleError)
        if not isinstance(self.rule, str) and (len(self.rule) != self.count or min(self.rule) < 1):
            raise sharding_error(f"chunk sizes {self.rule} for seq_chunks={self.count}",
                                 fix=f"give {self.count} positive sizes", cls=ScheduleError)

    def cost(self, length: int, prefix: int) -> float:
        """A chunk's cost in one block: ``length`` tokens attending over ``prefix`` earlier tokens and themselves."""
        return self.token_cost * length + self.pair_cost * length * (prefix + (length + 1) / 2) + self.chunk_cost

    def costs(self, sizes: tuple[int, ...]) -> list[float]:
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [self.cost(n, p) for n, p in zip(sizes, starts)]

    def time(self, sizes: tuple[int, ...]) -> float:
        """TeraPipe's ``T = m · Σ t_i + (K − 1) · max t_i`` of these chunk sizes (module docstring)."""
        t = self.costs(sizes)
        return self.microbatches * sum(t) + (self.stages - 1) * max(t)

    def sizes(self, seq_len: int) -> tuple[int, ...]:
        """The chunk sizes for sequences of ``seq_len`` tokens, first to last.

        Raises:
            ScheduleError: fewer quanta than chunks, a length that is not a multiple of the quantum, or explicit
                sizes that do not add up to ``seq_len``.
        """
        return _sizes(self, seq_len)

    def explain(self, seq_len: int) -> str:
        """Why these sizes: each chunk's cost, ``T`` against equal chunks'."""
        sizes = self.sizes(seq_len)
        costs = self.costs(sizes)
        rule = self.rule if isinstance(self.rule, str) else "given"
        lines = [f"seq_chunks={self.count} ({rule}) of {seq_len} tokens: sizes {list(sizes)}",
                 f"  chunk cost per block = {self.token_cost:g}·l + {self.pair_cost:g}·l·(prefix + (l+1)/2)"
                 + (f" + {self.chunk_cost:g}" if self.chunk_cost else ""),
                 "  costs " + ", ".join(f"{c:,.0f}" for c in costs) + f" (slowest {max(costs):,.0f})",
                 f"  T = m·Σt + (K-1)·max t = {self.microbatches}·{sum(costs):,.0f} + {self.stages - 1}·"
                 f"{max(costs):,.0f} = {self.time(sizes):,.0f}"]
        if rule != "equal" and seq_len % self.quantum == 0 and seq_len // self.quantum >= self.count:
            equal = dataclasses.replace(self, rule="equal").sizes(seq_len)
            lines.append(f"  equal chunks {list(equal)}: slowest {max(self.costs(equal)):,.0f}, "
                         f"T = {self.time(equal):,.0f}")
        return "\n".join(lines)


@functools.lru_cache(maxsize=256)
def _sizes(chunks: SeqChunks, seq_len: int) -> tuple[int, ...]:
    k, q = chunks.count, chunks.quantum
    if not isinstance(chunks.rule, str):
        if sum(chunks.rule) != seq_len:
            raise sharding_error(f"chunk sizes {list(chunks.rule)} add up to {sum(chunks.rule)}, not the sequence's "
                                 f"{seq_len} tokens", fix="give sizes that add up to the sequence length",
                                 cls=ScheduleError)
        return chunks.rule
    if seq_len % q or seq_len // q < k:
        raise sharding_error(f"a sequence of {seq_len} tokens cannot be cut into {k} chunks of multiples of {q} "
                             "tokens", fix=f"use a sequence length that is a multiple of {q} and at least {k * q}, "
                             "or fewer seq_chunks", cls=ScheduleError)
    n = seq_len // q
    if chunks.rule == "equal":
        base, extra = divmod(n, k)
        return tuple(q * (base + (i < extra)) for i in range(k))
    step = -(-n // GRID)  # grid cells of `step` quanta: at most GRID cut positions
    grid = [min(i * step, n) * q for i in range(-(-n // step) + 1)]
    return _minimax(chunks, grid, k)


def _minimax(chunks: SeqChunks, grid: list[int], k: int) -> tuple[int, ...]:
    """Cuts on ``grid`` (token positions, ``grid[0] = 0``, ``grid[-1]`` the length) into ``k`` chunks minimizing the
    slowest chunk's cost (the total is the same for any cuts: module docstring); among equals, the earliest cuts.
    Dynamic programming over (chunks so far, cut position), as :func:`~shardings.pipeline.stages.split` balances
    blocks: O(k · n²)."""
    n, inf = len(grid) - 1, float("inf")
    if n < k:  # a grid coarser than the chunks (more than GRID / 2 chunks of a long sequence)
        raise sharding_error(f"{grid[-1]} tokens on a grid of {n} cells cannot hold {k} chunks",
                             fix="use fewer seq_chunks", cls=ScheduleError)
    best = [[inf] * (n + 1) for _ in range(k + 1)]  # best[c][j]: slowest chunk cutting grid[:j] into c chunks
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for c in range(1, k + 1):
        for j in range(c, n - (k - c) + 1):
            for i in range(c - 1, j):
                value = max(best[c - 1][i], chunks.cost(grid[j] - grid[i], grid[i]))
                if value < best[c][j]:
                    best[c][j], cut[c][j] = value, i
    sizes, j = [], n
    for c in range(k, 0, -1):
        sizes.append(grid[j] - grid[cut[c][j]])
        j = cut[c][j]
    return tuple(sizes[::-1])


def cut(batch: Any, sizes: Sequence[int], dim: int = 1) -> list[Any]:
    """``batch`` (a pytree of tensors of sequences along ``dim``) cut into consecutive chunks of ``sizes`` tokens.

    >>> [c["tokens"].shape[1] for c in cut({"tokens": torch.zeros(2, 10)}, (4, 3, 3))]
    [4, 3, 3]
    """
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [pytree.tree_map(lambda x, a=a, n=n: x.narrow(dim, a, n) if isinstance(x, torch.Tensor) else x, batch)
            for a, n in zip(starts, sizes)]


def seq_length(batch: Any, dim: int = 1) -> int:
    """The tokens per sequence of ``batch``: the size along ``dim`` of its first tensor that has that dim (what
    :func:`cut` cuts; a chunk's offset in its sequence is the lengths of the chunks before it)."""
    return next(x.shape[dim] for x in pytree.tree_leaves(batch) if isinstance(x, torch.Tensor) and x.ndim > dim)
