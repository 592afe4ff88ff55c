"""visualize: exact output on hand-checked layouts, and every rank shown for any mesh."""

import contextlib
import io
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Shard

from shardings import Mesh, P, shard, simulate, visualize
from shardings.spec.lower import local_block, rank_coords
from shardings.testing import meshes, specs

GRID_2D = """\
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
rank 3 (dp=1, tp=1): [2:4, 3:6]"""

# Replicated over dp (each block on two ranks), split over tp.
GRID_1D = """\
shape (10,), spec P('tp'), mesh Mesh(dp=2, tp=2)
  0:5    5:10
+------+------+
| 0,2  | 1,3  |
+------+------+
rank 0 (dp=0, tp=0): [0:5]
rank 1 (dp=0, tp=1): [5:10]
rank 2 (dp=1, tp=0): [0:5]
rank 3 (dp=1, tp=1): [5:10]"""

# Uneven: 3 elements over 4 ranks leaves the last one empty.
UNEVEN = """\
shape (3,), spec P(('dp', 'tp')), mesh Mesh(dp=2, tp=2)
  0:1   1:2   2:3
+-----+-----+-----+
|  0  |  1  |  2  |
+-----+-----+-----+
rank 0 (dp=0, tp=0): [0:1]
rank 1 (dp=0, tp=1): [1:2]
rank 2 (dp=1, tp=0): [2:3]
rank 3 (dp=1, tp=1): [3:3] (empty)"""

LIST_3D = """\
shape (2, 3, 4), spec P(None, 'dp', 'tp'), mesh Mesh(dp=2, tp=2)
rank 0 (dp=0, tp=0): [0:2, 0:2, 0:2]
rank 1 (dp=0, tp=1): [0:2, 0:2, 2:4]
rank 2 (dp=1, tp=0): [0:2, 2:3, 0:2]
rank 3 (dp=1, tp=1): [0:2, 2:3, 2:4]"""


@pytest.mark.parametrize(
    ("shape", "spec", "want"),
    [
        ((4, 6), P("dp", "tp"), GRID_2D),
        ((10,), P("tp"), GRID_1D),
        ((3,), P(("dp", "tp")), UNEVEN),
        ((2, 3, 4), P(None, "dp", "tp"), LIST_3D),
    ],
)
def test_exact_output(shape, spec, want, capsys):
    with simulate(4):
        text = visualize(shard(torch.zeros(shape), spec, Mesh(dp=2, tp=2)))
    assert text == want
    assert capsys.readouterr().out == want + "\n"


def test_out_of_mesh_order_and_partial():
    with simulate(4):
        mesh = Mesh(dp=2, tp=2)
        strided = visualize(shard(torch.zeros(2, 8), P(None, ("tp", "dp")), mesh))
        grad = DTensor.from_local(torch.zeros(2, 3), mesh.device_mesh, [Partial(), Shard(0)], run_check=False)
        grad_text = visualize(grad)
    # tp is major: dp=1, tp=0 (rank 2) holds the second quarter.
    assert "0:2 |  0  |  2  |  1  |  3  |" in strided and "rank 2 (dp=1, tp=0): [0:2, 2:4]" in strided
    assert grad_text.splitlines()[0] == "shape (4, 3), spec P('tp'), mesh Mesh(dp=2, tp=2), unreduced sum over 'dp'"


def test_rejects_plain_tensors():
    with pytest.raises(TypeError, match=r"got a Tensor.*Fix: place it first"):
        visualize(torch.zeros(3))


def ranks_in(label: str) -> set[int]:
    out: set[int] = set()
    for part in label.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


@given(mesh=meshes(), shape=st.lists(st.integers(1, 9), max_size=3).map(tuple), data=st.data())
@settings(max_examples=25)
def test_every_rank_is_shown(mesh, shape, data):
    spec = data.draw(specs(shape, mesh))
    with simulate(mesh.size), contextlib.redirect_stdout(io.StringIO()):
        text = visualize(shard(torch.zeros(shape), spec, mesh))
    blocks = [local_block(shape, spec, mesh, c) for c in rank_coords(mesh)]
    for rank, (coords, block) in enumerate(zip(rank_coords(mesh), blocks)):
        where = ", ".join(f"{k}={v}" for k, v in coords.items())
        assert f"rank {rank} ({where}): [{', '.join(f'{s.start}:{s.stop}' for s in block)}]" in text
    if len(shape) in (1, 2):
        in_grid = set().union(*(ranks_in(c.strip()) for c in re.findall(r"\|([^|\n]+)(?=\|)", text)))
        assert in_grid == {r for r, b in enumerate(blocks) if all(s.stop > s.start for s in b)}
