"""The search space: every layout composition the preset registry allows × mesh factorizations × pipeline,
microbatch, remat and precision choices.

Layouts come from :mod:`shardings.spec.presets` through :func:`shardings.layouts.get` (one preset per group at
most; ``get`` refuses what does not compose), never from a list kept here: a preset registered tomorrow is a
candidate tomorrow. A layout's presets say which mesh axes it uses (``Preset.needs``); the world size is
factorized over exactly those axes (every axis of size ≥ 2: an axis no preset uses would only replicate), laid
out major to minor as ``pp, dp, fsdp, ep, cp, tp`` (tensor parallelism innermost, within a node). Pipelined
layouts add a schedule from the schedule registry and microbatch counts; every layout adds remat choices and
the precisions asked for.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import core
from shardings.pipeline import SCHEDULES
from shardings.pipeline.schedule import VIRTUAL_STAGES, cuts_sequences, stages_per_rank
from shardings.spec import layouts
from shardings.spec.errors import ShardingError

__all__ = ["AXIS_ORDER", "PRECISIONS", "Candidate", "Space", "compositions", "enumerate_candidates", "layout_of",
           "mesh_text"]

AXIS_ORDER = ("pp", "dp", "fsdp", "ep", "cp", "tp")  # major to minor: tp innermost (one node), pp outermost
PRECISIONS = tuple(core.precision.NAMED)  # core.precision's named policies (experiments' precision group)


@dataclasses.dataclass(frozen=True, order=True)
class Candidate:
    """One way to run the step: a layout on a mesh, with its pipeline, microbatches, remat and precision.

    Attributes:
        layout: the layout's canonical name (``"zero3+tp+sp"``), as ``layouts.get`` spells it.
        mesh: ``(axis, size)`` pairs, major to minor.
        microbatches: gradient accumulation steps, or with ``pp`` the pipeline's microbatches.
        schedule: with ``pp``: the schedule's registry name; else ``None``.
        virtual_stages: with a schedule whose stages per rank the caller picks: that number; else ``None``.
        remat: recompute each block in backward (``True``), keep its activations on the host (``"offload"``),
            or neither (``False``).
        precision: ``"fp32"`` (no policy), ``"bf16"`` or ``"fp16"`` (fp32 master weights and reduction).
        seq_chunks: with ``pp``: TeraPipe's chunks per microbatch's sequence (1: whole sequences).
    """

    layout: str
    mesh: tuple[tuple[str, int], ...]
    microbatches: int = 1
    schedule: str | None = None
    virtual_stages: int | None = None
    remat: bool | str = False
    precision: str = "fp32"
    seq_chunks: int = 1

    @property
    def sizes(self) -> dict[str, int]:
        """Mesh sizes by axis name, major to minor."""
        return dict(self.mesh)

    @property
    def pipelined(self) -> bool:
        """Whether the layout pipelines the blocks (``Layout.pipelined``, the one answer; it then has a schedule)."""
        return layout_of(self.layout).pipelined

    @property
    def mesh_name(self) -> str:
        """The mesh as the rows print it and the experiments name their meshes (``pp2_dp2_tp2``)."""
        return mesh_text(self.sizes)

    def size(self, axis: str) -> int:
        """The size of ``axis`` (1 when the mesh lacks it)."""
        return self.sizes.get(axis, 1)

    def __str__(self) -> str:
        parts = [self.layout, self.mesh_name]
        if self.pipelined:
            v = f" v{self.virtual_stages}" if self.virtual_stages else ""
            parts.append(f"{self.schedule}{v} m{self.microbatches}" + (f" k{self.seq_chunks}"
                                                                         if self.seq_chunks > 1 else ""))
        elif self.microbatches > 1:
            parts.append(f"accum{self.microbatches}")
        if self.remat:
            parts.append("remat" if self.remat is True else f"remat={self.remat}")
        parts.append(self.precision)
        return " ".join(parts)


def mesh_text(sizes: dict[str, int]) -> str:
    """``{"dp": 8, "tp": 2}`` -> ``"dp8_tp2"`` (the experiments' mesh names)."""
    return "_".join(f"{a}{n}" for a, n in sizes.items())


@dataclasses.dataclass(frozen=True)
class Space:
    """What to search over besides layouts and meshes.

    Attributes:
        precisions: precision names to try.
        remat: remat choices to try.
        schedules: pipeline schedules to try (default: every registered one).
        max_microbatches: the most microbatches (accumulation or pipeline) per step.
        accumulate: try gradient accumulation on layouts without ``pp``.
        max_cp: the largest context-parallel degree (1: none).
        max_pp: the largest pipeline-parallel degree.
        offload: try the offload presets.
        seq_chunks: TeraPipe's chunks per sequence to try with the schedules that cut sequences (``gpipe``,
            ``1f1b``) on layouts that leave attention's sequence whole (1: whole sequences only, the default).
    """

    precisions: tuple[str, ...] = ("fp32",)
    remat: tuple[bool | str, ...] = (False, True)
    schedules: tuple[str, ...] | None = None
    max_microbatches: int = 64
    accumulate: bool = True
    max_cp: int = 1
    max_pp: int = 16
    offload: bool = True
    seq_chunks: tuple[int, ...] = (1,)


@functools.lru_cache(maxsize=1024)
def layout_of(name: str) -> layouts.Layout:
    """``layouts.get(name)``, once per name (a search asks thousands of times; composing the tables is not free)."""
    return layouts.get(name)


@functools.cache
def compositions(offload: bool = True) -> tuple[layouts.Layout, ...]:
    """Every layout ``layouts.get`` accepts with at most one preset per group (aliases left out)."""
    groups: dict[str, list[str]] = {}
    for name in layouts.names(aliases=False):
        groups.setdefault(layouts.preset(name).group, []).append(name)
    found: dict[str, layouts.Layout] = {}
    for choice in itertools.product(*[[None, *members] for members in groups.values()]):
        parts = [p for p in choice if p]
        if not parts or (not offload and any(layouts.preset(p).layout.host for p in parts)):
            continue
        try:
            layout = layouts.get(parts)
        except ShardingError:
            continue
        found.setdefault(layout.name, layout)
    return tuple(found.values())


def _axes(layout: layouts.Layout) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(axes the layout must have at size ≥ 2, axes it may also have): one per ``needs`` entry, the first
    alternative, and ``dp`` as the replica axis of a layout that shards over ``fsdp`` alone (hsdp: without a
    replica axis it is zero3, a candidate of its own)."""
    needed: list[str] = []
    for p in layout.presets:
        for alternatives in layouts.preset(p).needs:
            if not any(a in needed for a in alternatives):
                needed.append(alternatives[0])
    if "fsdp" in needed and "dp" not in needed:
        needed.append("dp")
    return tuple(needed), ()


@functools.cache
def _factorizations(world: int, axes: tuple[str, ...], optional: tuple[str, ...]) -> tuple[dict[str, int], ...]:
    """Sizes ≥ 2 for ``axes`` (≥ 1 for ``optional``) whose product is ``world``, in :data:`AXIS_ORDER`."""
    names = list(axes) + list(optional)

    def split(rest: int, i: int) -> Iterator[tuple[int, ...]]:
        if i == len(names):
            if rest == 1:
                yield ()
            return
        for d in range(1 if i >= len(axes) else 2, rest + 1):
            if rest % d == 0:
                yield from ((d, *tail) for tail in split(rest // d, i + 1))

    order = AXIS_ORDER + tuple(n for n in names if n not in AXIS_ORDER)
    out = []
    for sizes in split(world, 0):
        chosen = {a: s for a, s in zip(names, sizes) if s > 1}
        out.append({a: chosen[a] for a in order if a in chosen})
    return tuple(out)


def _prod(values: Sequence[int]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def _shape_ok(layout: layouts.Layout, sizes: dict[str, int], cfg: Any, rows: int, seq: int, per_node: int) -> bool:
    """What a mesh must satisfy for this model and batch before anything runs: tp within a node and dividing
    the heads, the batch dividing over the data ranks, the sequence over cp (and tp under sp), experts over ep."""
    tp, cp, ep = sizes.get("tp", 1), sizes.get("cp", 1), sizes.get("ep", 1)
    heads, kv = getattr(cfg, "heads", None), getattr(cfg, "n_kv_heads", getattr(cfg, "heads", None))
    if tp > per_node or (heads and heads % tp) or (kv and kv % tp):
        return False
    if "ep" in sizes and (not getattr(cfg, "experts", 0) or cfg.experts % ep):
        return False
    data = sizes.get("dp", 1) * sizes.get("fsdp", 1) * ep
    if rows % data:
        return False
    seq_split = cp * (tp if "sp" in layout.presets else 1)
    return seq % seq_split == 0 and sizes.get("pp", 1) <= getattr(cfg, "layers", 1)


def enumerate_candidates(world: int, cfg: Any, rows: int, seq: int, *, per_node: int,
                         space: Space | None = None) -> list[Candidate]:
    """Every candidate for ``world`` ranks, a model config ``cfg`` and a global batch of ``rows`` × ``seq``.

    Args:
        world: the number of ranks.
        cfg: the model config (read for ``heads``, ``n_kv_heads``, ``layers``, ``experts``).
        rows: sequences per step.
        seq: tokens per sequence.
        per_node: ranks per node (tensor parallelism stays within one).
        space: the choices besides layouts and meshes.

    Returns:
        The candidates, deduplicated, in a fixed order.
    """
    space = space or Space()
    schedules = space.schedules or tuple(SCHEDULES)
    out: list[Candidate] = []
    for layout in compositions(space.offload):
        needed, optional = _axes(layout)
        for sizes in _factorizations(world, needed, optional):
            too_big = sizes.get("cp", 1) > space.max_cp or sizes.get("pp", 1) > space.max_pp
            if too_big or not _shape_ok(layout, sizes, cfg, rows, seq, per_node):
                continue
            data = sizes.get("dp", 1) * sizes.get("fsdp", 1) * sizes.get("ep", 1)
            mesh = tuple(sizes.items())
            for precision, remat in itertools.product(space.precisions, space.remat):
                for m, schedule, v in _pipelines(layout, sizes, rows // data, schedules, space, cfg):
                    out.append(Candidate(layout.name, mesh, m, schedule, v, remat, precision))
                    out += [Candidate(layout.name, mesh, m, schedule, v, remat, precision, k)
                            for k in _seq_chunks(layout, sizes, schedule, seq, space)]
    return list(dict.fromkeys(out))


def _seq_chunks(layout: layouts.Layout, sizes: dict[str, int], schedule: str | None, seq: int,
                space: Space) -> list[int]:
    """TeraPipe's chunk counts for a pipelined candidate: the space's, where the schedule cuts sequences, attention's
    sequence is whole (no cp) and each chunk holds at least one token per rank sharing the sequence (sp)."""
    if schedule is None or not cuts_sequences(schedule) or sizes.get("cp", 1) > 1:
        return []
    quantum = sizes.get("tp", 1) if "sp" in layout.presets else 1
    return [k for k in space.seq_chunks if k > 1 and seq % quantum == 0 and seq // quantum >= k]


def _pipelines(layout: layouts.Layout, sizes: dict[str, int], local_rows: int, schedules: Sequence[str],
               space: Space, cfg: Any) -> Iterator[tuple[int, str | None, int | None]]:
    """(microbatches, schedule, virtual stages) choices: accumulation steps without ``pp``; with it, each
    schedule at pp × 1, 2, 4, ... microbatches (and one row per microbatch)."""
    counts = sorted({m for m in (1, 2, 4, 8, 16, 32, 64, 128, 256, local_rows)
                     if m <= min(local_rows, space.max_microbatches) and local_rows % m == 0})
    if not layout.pipelined:
        yield from ((m, None, None) for m in (counts if space.accumulate else [1]))
        return
    pp, layers = sizes["pp"], getattr(cfg, "layers", 1)
    for name in schedules:
        v = stages_per_rank(name) if VIRTUAL_STAGES[name] is None else None  # the caller's choice: the default
        if pp * (v or VIRTUAL_STAGES[name]) > layers:
            continue
        yield from ((m, name, v) for m in counts if m >= pp)  # the schedule checks itself when it is built

