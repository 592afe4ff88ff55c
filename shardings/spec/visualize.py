"""``visualize(x)``: which rank holds which block of a DTensor, as text.

For 1-D and 2-D tensors a grid (like ``jax.debug.visualize_array_sharding``) whose cells list
the ranks holding that block; for every tensor a list of each rank's block and mesh coordinates.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from torch.distributed.tensor import DTensor

from shardings.spec.errors import sharding_error
from shardings.spec.lower import from_placements, local_block, mesh_of, rank_coords

__all__ = ["visualize"]


def _ranks_label(ranks: Sequence[int]) -> str:
    """Compact rank list: ``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return ",".join(f"{run[0]}-{run[-1]}" if len(run) > 2 else ",".join(map(str, run)) for run in runs)


def _interval(s: slice) -> str:
    return f"{s.start}:{s.stop}"


def _cuts(size: int, blocks: Sequence[slice]) -> list[slice]:
    """The finest intervals of ``range(size)`` that every block boundary respects."""
    points = sorted({0, size, *(b.start for b in blocks), *(b.stop for b in blocks)})
    return [slice(lo, hi) for lo, hi in itertools.pairwise(points) if hi > lo]


def _grid(shape: tuple[int, ...], blocks: list[tuple[slice, ...]]) -> list[str]:
    """Lines of a box grid for a 1-D or 2-D tensor; each cell names the ranks that hold it."""
    one_d = len(shape) == 1
    if one_d:  # a single row, like JAX
        shape, blocks = (1, *shape), [(slice(0, 1), *b) for b in blocks]
    rows, cols = _cuts(shape[0], [b[0] for b in blocks]), _cuts(shape[1], [b[1] for b in blocks])
    cells = [
        [
            _ranks_label([rank for rank, (br, bc) in enumerate(blocks) if _covers(br, r) and _covers(bc, c)])
            for c in cols
        ]
        for r in rows
    ]
    width = max(len(s) for s in [*map(_interval, cols), *(label for row in cells for label in row)]) + 2
    margin = 0 if one_d else max(len(_interval(r)) for r in rows) + 1  # row labels, right-aligned
    rule = " " * margin + "+" + "+".join("-" * width for _ in cols) + "+"
    out = [" " * margin + " " + " ".join(_interval(c).center(width) for c in cols), rule]
    for r, row in zip(rows, cells):
        label = "" if one_d else _interval(r).rjust(margin - 1) + " "
        out += [label + "|" + "|".join(x.center(width) for x in row) + "|", rule]
    return out


def _covers(block: slice, cell: slice) -> bool:
    return block.start <= cell.start and cell.stop <= block.stop


def visualize(x: DTensor) -> str:
    """Print, and return, which rank holds which block of ``x``.

    Args:
        x: a DTensor (e.g. from :func:`shardings.shard`).

    Returns:
        The text printed: a header (shape, spec, mesh, pending reductions), a grid for 1-D/2-D
        tensors whose cells list the ranks holding them, and one ``rank r (axis=i, ...): [a:b, ...]``
        line per rank.

    Raises:
        TypeError: ``x`` is not a DTensor.

    >>> with simulate(4):
    ...     _ = visualize(shard(torch.zeros(4, 6), P("dp", "tp"), Mesh(dp=2, tp=2)))
    shape (4, 6), spec P('dp', 'tp'), mesh Mesh(dp=2, tp=2)
          0:3   3:6
        +-----+-----+
    0:2 |  0  |  1  |
        +-----+-----+
    2:4 |  2  |  3  |
        +-----+-----+
    rank 0 (dp=0, tp=0): [0:2, 0:3]
    rank 1 (dp=0, tp=1): [0:2, 3:6]
    rank 2 (dp=1, tp=0): [2:4, 0:3]
    rank 3 (dp=1, tp=1): [2:4, 3:6]
    """
    if not isinstance(x, DTensor):
        raise sharding_error(
            f"visualize shows how a DTensor is laid out; got a {type(x).__name__}",
            fix="place it first with shardings.shard(x, P(...), mesh)",
            cls=TypeError,
        )
    mesh = mesh_of(x)
    spec, partial = from_placements(x.placements, mesh)
    shape = tuple(x.shape)
    coords = rank_coords(mesh)
    blocks = [local_block(shape, spec, mesh, c) for c in coords]
    header = f"shape {shape}, spec {spec!r}, mesh {mesh!r}"
    if partial:
        header += ", unreduced " + ", ".join(f"{op} over {axis!r}" for axis, op in partial.items())
    lines = [header]
    if len(shape) in (1, 2) and all(shape):
        lines += _grid(shape, blocks)
    for rank, (c, block) in enumerate(zip(coords, blocks)):
        where = ", ".join(f"{name}={i}" for name, i in c.items())
        empty = " (empty)" if any(s.stop == s.start for s in block) else ""
        lines.append(f"rank {rank} ({where}): [{', '.join(_interval(s) for s in block)}]{empty}")
    text = "\n".join(line.rstrip() for line in lines)
    print(text)
    return text
