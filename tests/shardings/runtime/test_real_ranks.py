"""The core round trip and the axis-named collectives on 4 real gloo processes, against full-tensor references.

The same properties are tested exhaustively under ``simulate`` (test_distribute.py, test_collectives.py);
here a few fixed cases check that real process groups agree. Everything runs in one launch: the
checks run on every rank, and each returns its largest error per case for the parent to assert.
"""

from collections.abc import Callable

import pytest
import torch

from shardings import Mesh, P, gather, launch, reshard, shard, spec_of
from shardings.comm.collectives import all_gather, all_to_all, bind_mesh, ppermute, psum, psum_scatter
from shardings.spec.lower import rank_coords

pytestmark = pytest.mark.multiprocess

MESH = Mesh(dp=2, tp=2)
SPECS = [P(), P("dp"), P(None, "tp"), P("dp", "tp"), P(("dp", "tp")), P("tp", "dp"), P(("tp", "dp"))]


def _groups(names: tuple[str, ...]) -> tuple[list[int], list[list[int]]]:
    """Per rank: its index along ``names`` (major to minor), and its group's ranks in index order."""
    coords = rank_coords(MESH)
    index = [0] * MESH.size
    for r, c in enumerate(coords):
        for n in names:
            index[r] = index[r] * MESH.shape[n] + c[n]
    rest = [tuple(c[n] for n in MESH.axis_names if n not in names) for c in coords]
    members = [
        sorted((q for q in range(MESH.size) if rest[q] == rest[r]), key=index.__getitem__) for r in range(MESH.size)
    ]
    return index, members


def _roundtrip_errors(x: torch.Tensor) -> dict[str, float]:
    errors = {}
    for spec in SPECS:
        s = shard(x, spec, MESH)
        assert spec_of(s) == spec.normalized(), (spec_of(s), spec)
        errors[f"gather {spec}"] = (gather(s) - x).abs().max().item()
        for target in SPECS:
            moved = reshard(s, target)
            assert spec_of(moved) == target.normalized(), (spec, target, spec_of(moved))
            errors[f"reshard {spec} -> {target}"] = (gather(moved) - x).abs().max().item()
    return errors


def _collective_cases() -> dict[str, tuple[Callable, Callable, tuple[int, ...]]]:
    """name -> (per-rank op, reference on the stacked rows X[world, ...], shape of one row)."""
    tp_index, tp_members = _groups(("tp",))
    dp_index, dp_members = _groups(("dp",))
    all_index, all_members = _groups(("tp", "dp"))  # not in mesh order: a flattened, reordered group
    world = range(MESH.size)
    ring = [(i, (i + 1) % MESH.size) for i in world]
    src_of = {d: s for s, d in ring}

    def rows(fn: Callable[[torch.Tensor, int], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda x: torch.stack([fn(x, r) for r in world])

    return {
        "psum tp": (lambda t: psum(t, "tp"), rows(lambda x, r: sum(x[q] for q in tp_members[r])), (3, 2)),
        "psum (tp, dp)": (
            lambda t: psum(t, ("tp", "dp")),
            rows(lambda x, r: sum(x[q] for q in all_members[r])),
            (3,),
        ),
        "all_gather dp": (
            lambda t: all_gather(t, "dp", axis=1),
            rows(lambda x, r: torch.stack([x[q] for q in dp_members[r]], 1)),
            (2, 3),
        ),
        "all_gather dp tiled": (
            lambda t: all_gather(t, "dp", tiled=True),
            rows(lambda x, r: torch.cat([x[q] for q in dp_members[r]])),
            (2, 3),
        ),
        "psum_scatter tp tiled": (
            lambda t: psum_scatter(t, "tp", scatter_dimension=1, tiled=True),
            rows(lambda x, r: sum(x[q] for q in tp_members[r]).chunk(2, 1)[tp_index[r]]),
            (3, 4),
        ),
        "ppermute ring (tp, dp)": (
            lambda t: ppermute(t, ("tp", "dp"), ring),
            rows(lambda x, r: x[all_members[r][src_of[all_index[r]]]]),
            (2, 3),
        ),
        "all_to_all dp": (
            lambda t: all_to_all(t, "dp", 0, 1, tiled=True),
            rows(lambda x, r: torch.cat([x[q].chunk(2, 0)[dp_index[r]] for q in dp_members[r]], 1)),
            (4, 3),
        ),
    }


def _collective_errors(seed: int) -> dict[str, float]:
    """Forward and backward of each case on this rank vs the reference row (autograd on full tensors)."""
    rank = torch.distributed.get_rank()
    errors = {}
    for name, (op, reference, shape) in _collective_cases().items():
        gen = torch.Generator().manual_seed(seed)  # every rank draws the same full tensors
        x_full = torch.randn(MESH.size, *shape, generator=gen).requires_grad_(True)
        y_ref = reference(x_full)
        cot = torch.randn(y_ref.shape, generator=gen)
        (g_ref,) = torch.autograd.grad((y_ref * cot).sum(), x_full)
        x = x_full[rank].detach().clone().requires_grad_(True)
        with bind_mesh(MESH):
            y = op(x)
            (g,) = torch.autograd.grad((y * cot[rank]).sum(), x)  # backward runs the transposed collectives
        errors[f"{name} forward"] = (y - y_ref[rank]).abs().max().item()
        errors[f"{name} backward"] = (g - g_ref[rank]).abs().max().item()
    return errors


def _check_all(seed: int) -> dict[str, float]:
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(seed))
    return {**_roundtrip_errors(x), **_collective_errors(seed)}


def test_roundtrip_and_collectives_on_real_ranks():
    per_rank = launch(_check_all, MESH.size, 0, timeout=60)
    assert len(per_rank) == MESH.size
    expected = set(per_rank[0])
    assert len(expected) == len(SPECS) * (1 + len(SPECS)) + 2 * 7
    for rank, errors in enumerate(per_rank):
        assert set(errors) == expected
        # shard/gather/reshard move values exactly; collectives sum in a different order: fp32 tolerance
        bad = {k: v for k, v in errors.items() if v > (0.0 if k.startswith(("gather", "reshard")) else 1e-5)}
        assert not bad, f"rank {rank}: {bad}"
