"""How a model splits into pipeline stages: what runs before its blocks, each block, what runs after.

A model opts in to pipeline parallelism by declaring :class:`Stages`: ``first(params, batch)`` (the
embedding) returns the *carry* that flows between blocks (a tensor, or a pytree of tensors such as
``(x, aux_losses)``), ``block(params["blocks"][i], carry, i)`` is block ``i``, and
``last(params, carry, batch)`` (final norm, unembedding, loss) returns the microbatch's mean loss.
The model's own single-device loss is these functions composed (:meth:`Stages.loss`), so the
pipeline's reference is the model's loss.

A model opts in to TeraPipe (``pipeline.plan(..., seq_chunks=k)``: each microbatch's sequence cut into chunks
that flow through the stages in order) by declaring ``prefix_block(params["blocks"][i], carry, i, past)``:
block ``i`` on a chunk's carry after ``past``, the list of what the same block returned for the earlier chunks
of the sequence, returning ``(carry, present)`` (a decoder: the chunk's keys and values). The executor keeps
each stage's ``past`` until the chunks' backward, and sums the gradients later chunks send to a ``present``
before that chunk's own backward. A model whose first stage depends on where the chunk sits in its sequence
(learned positions) also declares ``prefix_first(params, batch, offset)``: ``first`` on a chunk whose first token
is token ``offset`` of its sequence (the earlier chunks' lengths, counted by the executor); without it, ``first``
runs on every chunk as on a whole sequence (RoPE's positions are the blocks', from ``past``).
:meth:`Stages.chunked_loss` is the single-device loss run chunk by chunk.

:func:`split` assigns contiguous blocks to stages, balancing cost (parameter count by default); the
first stage also pays for what ``first`` uses and the last for what ``last`` uses. The split prints as a
table and can be given explicitly instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from shardings.pipeline.seq_chunks import seq_length
from shardings.runtime.compat import pytree

__all__ = ["Split", "Stages", "block_index", "rank_stages", "split"]


@dataclasses.dataclass(frozen=True)
class Stages:
    """A model's pipeline declaration (module docstring). ``blocks`` names the list of per-block params."""

    first: Callable[[Any, Any], Any]
    block: Callable[[Any, Any, int], Any]
    last: Callable[[Any, Any, Any], torch.Tensor]
    blocks: str = "blocks"
    # carry -> the logical names of its tensors (a pytree like it): how a carry of DTensors is laid out when
    # it arrives from another process (real ranks under a layout); e.g. ``lambda x: ("batch", "seq", "embed")``
    carry_names: Callable[[Any], Any] | None = None
    # TeraPipe (module docstring): block i on a chunk after the earlier chunks' presents -> (carry, present)
    prefix_block: Callable[[Any, Any, int, list[Any]], tuple[Any, Any]] | None = None
    # TeraPipe: the first stage on a chunk that starts ``offset`` tokens into its sequence (module docstring)
    prefix_first: Callable[[Any, Any, int], Any] | None = None

    def __call__(self, params: Any, batch: Any) -> torch.Tensor:
        """The stages are a loss function: ``train_step(models.gpt.stages(cfg), ...)`` under any layout."""
        return self.loss(params, batch)

    def loss(self, params: Any, batch: Any) -> torch.Tensor:
        """The single-device loss: ``last(params, block_{n-1}(... block_0(first(params, batch))), batch)``."""
        carry = self.first(params, batch)
        for i, p in enumerate(params[self.blocks]):
            carry = self.block(p, carry, i)
        return self.last(params, carry, batch)

    def chunk_first(self, params: Any, chunk: Any, offset: int) -> Any:
        """The first stage on a chunk that starts ``offset`` tokens into its sequence: ``prefix_first`` where the
        model declares it, else ``first``."""
        return self.first(params, chunk) if self.prefix_first is None else self.prefix_first(params, chunk, offset)

    def chunked_loss(self, params: Any, chunks: Sequence[Any], weights: Sequence[float]) -> torch.Tensor:
        """The loss of a sequence cut into ``chunks`` (batches of consecutive tokens, first to last), each chunk's
        loss times its ``weights`` share, the blocks run by ``prefix_block`` chunk after chunk: what a TeraPipe
        pipeline computes, on one device."""
        pasts: list[list[Any]] = [[] for _ in params[self.blocks]]
        total, offset = None, 0
        for chunk, w in zip(chunks, weights):
            carry = self.chunk_first(params, chunk, offset)
            offset += seq_length(chunk)
            for i, p in enumerate(params[self.blocks]):
                carry, present = self.prefix_block(p, carry, i, list(pasts[i]))
                pasts[i].append(present)
            loss = self.last(params, carry, chunk) * w
            total = loss if total is None else total + loss
        return total


@dataclasses.dataclass(frozen=True)
class Split:
    """Which blocks each stage runs: ``ranges[s] = range(start, stop)``, contiguous and covering all blocks."""

    ranges: tuple[range, ...]
    costs: tuple[float, ...]  # per stage, in the unit split() balanced

    @property
    def stages(self) -> int:
        return len(self.ranges)

    def stage_of(self, block: int) -> int:
        return next(s for s, r in enumerate(self.ranges) if block in r)

    def __str__(self) -> str:
        rows = [f"stage {s}: blocks {r.start}..{r.stop - 1} ({len(r)}), cost {c:,.0f}"
                for s, (r, c) in enumerate(zip(self.ranges, self.costs))]
        return "\n".join(rows)


def rank_stages(stages: Stages, first: bool, last: bool) -> Stages:
    """``stages`` as a pipeline rank runs them that holds the model's first stage (``first``) and its last
    (``last``) or not: the planner's stand-in for one rank of a pipeline, run at ``pp = 1``. Without the first, the
    embedding's output enters as a fresh leaf, as a carry received from another rank does (its backward stops there
    and yields the carry's gradient); without the last, a stand-in loss (the carry's squares summed) replaces the
    head, so the backward starts from a gradient the carry's size, as one received from the next rank. A probe so
    holds at each moment what that rank holds.
    """
    def leaf(params: Any, batch: Any) -> Any:
        return pytree.tree_map(lambda x: x.detach().requires_grad_(x.is_floating_point())
                               if isinstance(x, torch.Tensor) else x, stages.first(params, batch))

    def stand_in(params: Any, carry: Any, batch: Any) -> torch.Tensor:
        return sum((x.float() ** 2).sum() for x in pytree.tree_leaves(carry)
                   if isinstance(x, torch.Tensor) and x.is_floating_point())

    return dataclasses.replace(stages, first=stages.first if first else leaf, last=stages.last if last else stand_in,
                               prefix_first=stages.prefix_first if first else None)


def block_index(path: Any, blocks: str = "blocks") -> int | None:
    """The ``i`` of a leaf under ``params[blocks][i]`` (a pytree key path), or ``None`` for the rest."""
    return path[1].idx if len(path) > 1 and getattr(path[0], "key", None) == blocks else None


def _numel(tree: Any) -> int:
    """Elements of the tensors in ``tree`` (or of anything with a shape: ``core.deferred`` recipes)."""
    return sum(int(x.shape.numel()) for x in pytree.tree_leaves(tree) if hasattr(x, "shape"))


def split(params: Any, stages: int, *, blocks: str = "blocks", costs: Sequence[float] | None = None,
          sizes: Sequence[int] | None = None) -> Split:
    """Contiguous blocks per stage minimizing the most expensive stage.

    Args:
        params: the model's params (a dict with the list ``params[blocks]``).
        stages: the number of pipeline stages (the ``pp`` axis size).
        costs: per-block cost (default: parameter count); the rest of ``params`` (embedding, final norm,
            unembedding) counts on the first and the last stage (half each: either may use it).
        sizes: blocks per stage, given explicitly (overrides the balancing).

    Raises:
        ValueError: fewer blocks than stages, or ``sizes`` that do not add up to the blocks.

    >>> p = {"embed": torch.zeros(8), "blocks": [{"w": torch.zeros(4)} for _ in range(5)]}
    >>> [len(r) for r in split(p, 2).ranges]
    [3, 2]
    """
    n = len(params[blocks])
    if stages < 1 or n < stages:
        raise ValueError(f"pipeline split: {n} blocks cannot fill {stages} stages (each needs at least one). "
                         f"Fix: use pp <= {n}, or a model with more layers.")
    block_costs = [float(c) for c in costs] if costs is not None else [float(_numel(b)) for b in params[blocks]]
    rest = float(_numel({k: v for k, v in params.items() if k != blocks}))
    edge = [rest / 2 if s in (0, stages - 1) else 0.0 for s in range(stages)]
    if stages == 1:
        edge = [rest]
    if sizes is None:
        sizes = _balanced(block_costs, edge)
    elif len(sizes) != stages or sum(sizes) != n or min(sizes) < 1:
        raise ValueError(f"pipeline split: sizes {list(sizes)} must be {stages} positive counts adding up to the "
                         f"{n} blocks. Fix: e.g. sizes={_balanced(block_costs, edge)}.")
    starts = [sum(sizes[:s]) for s in range(stages)]
    ranges = tuple(range(a, a + k) for a, k in zip(starts, sizes))
    return Split(ranges, tuple(edge[s] + sum(block_costs[i] for i in r) for s, r in enumerate(ranges)))


def _balanced(costs: list[float], edge: list[float]) -> list[int]:
    """Sizes of a contiguous partition of ``costs`` into ``len(edge)`` non-empty parts minimizing the max part
    (part ``s`` also costs ``edge[s]``); ties go to the earliest feasible cut (dynamic programming, n·p·n)."""
    n, p = len(costs), len(edge)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(p + 1)]  # best[s][i]: max cost of splitting blocks[:i] into s parts
    cut = [[0] * (n + 1) for _ in range(p + 1)]
    best[0][0] = 0.0
    for s in range(1, p + 1):
        for i in range(s, n - (p - s) + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], prefix[i] - prefix[j] + edge[s - 1])
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    sizes, i = [], n
    for s in range(p, 0, -1):
        sizes.append(i - cut[s][i])
        i = cut[s][i]
    return sizes[::-1]
