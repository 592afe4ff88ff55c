"""TeraPipe's per-stage prefix: the keys and values a stage keeps of each microbatch's earlier chunks.

A stage runs a chunk's blocks by the model's ``Stages.prefix_block`` after ``past``, what each block returned for
the earlier chunks of the same sequence (a decoder: their keys and values). :class:`Prefixes` keeps those presents
per stage and microbatch as fresh leaves (so a later chunk's backward stops there and yields their gradients),
sums the gradients the later chunks' backwards send each earlier chunk (in the order they run: last chunk first),
hands that sum to the earlier chunk's own backward as its presents' cotangents, and frees a chunk's leaves at its
own backward, once every later chunk's has run. Units number ``(microbatch, chunk)`` as ``mb·k + c``
(:class:`~shardings.pipeline.schedule.Action`).
"""

from __future__ import annotations

from typing import Any

import torch

from shardings.pipeline.stages import Stages
from shardings.runtime.compat import pytree

__all__ = ["Prefixes"]


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def _leaves(tree: Any) -> Any:
    """Fresh leaves of the floating tensors (detached views: no copy), so backward stops here with their gradient."""
    return pytree.tree_map(lambda x: x.detach().requires_grad_(x.is_floating_point())
                           if isinstance(x, torch.Tensor) else x, tree)


class Prefixes:
    """Every stage's prefixes of one step with ``k`` chunks per microbatch (module docstring)."""

    def __init__(self, stages: Stages, k: int):
        if stages.prefix_block is None:
            raise ValueError(f"pipeline run: the schedule cuts each sequence into {k} chunks, but the model's Stages "
                             "declare no prefix_block (a block on a chunk after the earlier chunks' keys and values). "
                             "Fix: declare Stages(prefix_block=...) (models.gpt does), or plan without seq_chunks.")
        self.stages, self.k = stages, k
        self.past: dict[tuple[int, int], list[list[Any]]] = {}  # (stage, mb) -> per block: each chunk's leaves
        self.presents: dict[tuple[int, int], list[Any]] = {}  # (stage, unit) -> per block: its present
        self.sums: dict[tuple[int, int], list[torch.Tensor | None]] = {}  # (stage, unit) -> its presents' gradients

    def forward(self, s: int, unit: int, blocks: list[tuple[int, Any]], x: Any) -> Any:
        """Chunk ``unit``'s ``blocks`` (``(index, params)``) on ``x`` after the earlier chunks' presents; keeps its
        own (as leaves) for the later chunks."""
        past = self.past.setdefault((s, unit // self.k), [[] for _ in blocks])
        presents = []
        for j, (i, p) in enumerate(blocks):
            x, present = self.stages.prefix_block(p, x, i, list(past[j]))
            presents.append(present)
            past[j].append(_leaves(present))
        self.presents[(s, unit)] = presents
        return x

    def backward_terms(self, s: int, unit: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """``(outputs, cotangents, inputs)`` chunk ``unit``'s backward adds: its presents with the gradients the later
        chunks sent them (zeros where none did: a compiled block's backward needs every tangent), and the earlier
        chunks' leaves it attended over."""
        presents = _tensors(self.presents.pop((s, unit)))
        sums = self.sums.pop((s, unit), [None] * len(presents))
        cots = [torch.zeros_like(p) if g is None else g for p, g in zip(presents, sums)]
        past = [x for block in self.past[(s, unit // self.k)] for x in _tensors(block[: unit % self.k])]
        return presents, cots, past

    def send_to_past(self, s: int, unit: int, grads: list[torch.Tensor | None]) -> None:
        """Add ``grads`` (of the leaves :meth:`backward_terms` listed) to the earlier chunks' sums and free this
        chunk's leaves, which every later chunk's backward has used."""
        mb, c = divmod(unit, self.k)
        blocks = self.past[(s, mb)]
        it = iter(grads)
        per_chunk: dict[int, list[torch.Tensor | None]] = {}
        for block in blocks:  # the order backward_terms listed them in: block by block, chunk by chunk
            for earlier in range(c):
                per_chunk.setdefault(earlier, []).extend(next(it) for _ in _tensors(block[earlier]))
        for earlier, found in per_chunk.items():  # per earlier chunk: its presents' tensors, block by block
            key = (s, mb * self.k + earlier)
            held = self.sums.get(key)
            self.sums[key] = list(found) if held is None else [
                g if h is None else h if g is None else h + g for h, g in zip(held, found)]
        for block in blocks:
            del block[c:]
        if c == 0:
            del self.past[(s, mb)]
