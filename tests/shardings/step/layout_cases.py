"""The layout coverage cases (a module of cases, imported by the tests that run them): the configurations users
run, each compared with one device (loss, grads and params, every rank, every step), and a strategy drawing random
cases of the same kind.

- ``CASES``: the ``make train`` layout and its siblings on Mesh(dp=2, tp=2); 3-D meshes with a real HSDP replica
  axis; every pure data layout on the local path with several buckets and on the DTensor path; cp and ep with
  accumulation, clipping and the ZeRO/HSDP compositions, tp+sp+ep, cp=4. They are the pinned ``@example``s of
  tests/shardings/step/test_layout_coverage.py's property test, which draws more with :func:`cases`;
  docs/equivalence.md's coverage matrix is generated from them (:func:`coverage_matrix`).
- tests/shardings/step/test_jit_equivalence.py and test_ep_memory_and_comms.py take their cases from here too.
"""

import dataclasses
import functools
import math
from typing import Any

from hypothesis import strategies as st

import core
import models.gpt as gpt
import models.moe as moe
from experiments import build
from experiments import config as experiments_config
from shardings import Mesh
from shardings.comm.buckets import DEFAULT_BUCKET_MB
from shardings.testing import check_equivalence, meshes
from shardings.testing.strategies import ALL_AXIS_NAMES
from shardings.testing.strategies import layouts as layout_strategy

# -- the fixed cases -----------------------------------------------------------------------------------------------
GPT = gpt.Config(vocab=32, dim=16, layers=1, heads=4, kv_heads=2, mlp=32, seq_len=8, tie_embeddings=True)
GPT_2 = dataclasses.replace(GPT, layers=2)  # several buckets: gathers of one block prefetched while another runs
MAKE_TRAIN = gpt.Config(**experiments_config.MODELS["gpt_tiny"][1])  # `make train`'s model (untied)


# one MoE block; capacity 1.0: some assignments are dropped
MOE = moe.Config(vocab=32, dim=8, layers=1, heads=2, mlp=8, seq_len=4, experts=4, top_k=2, moe_every=1,
                 capacity_factor=1.0)
MOE_2 = dataclasses.replace(MOE, layers=2, moe_every=2)  # a dense block, then a MoE block
MODEL_NAMES = {id(GPT): "gpt", id(GPT_2): "gpt 2 blocks", id(MAKE_TRAIN): "gpt_tiny (make train)", id(MOE): "moe"}
OPTIMIZERS = {
    "sgd": functools.partial(core.optim.sgd, 0.1),  # param differences proportional to grad differences
    "adamw": functools.partial(core.optim.adamw, 1e-3),
    # `make train`'s AdamW (lr 3e-3, b2 0.95, weight decay 0.1) at its peak learning rate (no warmup: the
    # schedule's first step has lr 0)
    "adamw (make train)": lambda: build.optimizer(experiments_config.OptimConf(), steps=2, schedule=False),
}
CLIP = 0.05  # below every case's gradient norm: clipping is active
SMALL_BUCKETS = 0.004  # 4 kB: several buckets for GPT's gradients and ZeRO-3 gathers


@dataclasses.dataclass(frozen=True)
class Case:
    """One equivalence check: a layout on a mesh, a model config, and the train step's options (2 steps)."""

    layout: str
    mesh: tuple[tuple[str, int], ...]  # (axis, size), major to minor
    cfg: Any  # a gpt.Config or moe.Config
    rows: int  # the global batch's rows
    accum: int = 2
    clip: float | None = CLIP
    optimizer: str = "sgd"
    local: bool = True
    bucket_mb: float = DEFAULT_BUCKET_MB
    ignored: bool = True
    seed: int = 0

    @property
    def model(self) -> Any:
        return moe if isinstance(self.cfg, moe.Config) else gpt


def case(layout: str, mesh: dict[str, int], cfg: Any = GPT, rows: int | None = None, **kw: Any) -> Case:
    """A Case with one row per data rank and microbatch unless ``rows`` says otherwise."""
    data = math.prod(n for a, n in mesh.items() if a in ("dp", "fsdp", "ep"))
    return Case(layout, tuple(mesh.items()), cfg, rows or data * kw.get("accum", 2), **kw)


DP2_TP2, DP2_FSDP2_TP2 = {"dp": 2, "tp": 2}, {"dp": 2, "fsdp": 2, "tp": 2}


DP2_CP2, DP2_EP2 = {"dp": 2, "cp": 2}, {"dp": 2, "ep": 2}


# zero1/2/3 on two data axes would take the DTensor path (the local path splits over one mesh dim): dp=4
DATA = [*((layout, {"dp": 4}) for layout in ("dp", "zero1", "zero2", "zero3")), ("hsdp", {"dp": 2, "fsdp": 2})]


def mesh_name(mesh: dict[str, int]) -> str:
    return "×".join(f"{a}{n}" for a, n in mesh.items())
CASES = {  # id: Case; the matrix in docs/equivalence.md lists them in this order
    # `make train`: gpt_tiny, zero3+tp on dp2×tp2, its AdamW and clip norm (1.0: inactive on this batch)
    "make train": case("zero3+tp", DP2_TP2, MAKE_TRAIN, clip=1.0, optimizer="adamw (make train)"),
    **{f"{layout} dp2×tp2": case(layout, DP2_TP2, optimizer="adamw")
       for layout in ("zero3+tp", "dp+tp", "zero1+tp", "dp+tp+sp", "zero1+tp+sp")},
    # 3-D meshes: hsdp with a real replica axis (dp) beside its shard axis (fsdp)
    **{f"{layout} dp2×fsdp2×tp2": case(layout, DP2_FSDP2_TP2, accum=1)
       for layout in ("hsdp+tp", "hsdp+tp+sp", "zero3+tp+sp")},
    # pure data layouts: the local path with several buckets, and the DTensor path
    # (accumulation where gradients are reduced or re-gathered per microbatch: not zero1/zero2, reduced once)
    **{f"{layout} {mesh_name(mesh)} buckets": case(layout, mesh, GPT_2, bucket_mb=SMALL_BUCKETS,
                                                   accum=1 if layout in ("zero1", "zero2") else 2)
       for layout, mesh in DATA},
    **{f"{layout} {mesh_name(mesh)} dtensor": case(layout, mesh, local=False, accum=1, optimizer="adamw")
       for layout, mesh in DATA},
    # context parallelism: seq 8 in 2·cp chunks (1 token each at cp=4)
    "zero1+cp dp2×cp2": case("zero1+cp", DP2_CP2),
    "zero2+cp dp2×cp2": case("zero2+cp", DP2_CP2),
    "zero3+cp_allgather dp2×cp2": case("zero3+cp_allgather", DP2_CP2, optimizer="adamw"),
    "hsdp+cp dp2×fsdp2×cp2": case("hsdp+cp", {"dp": 2, "fsdp": 2, "cp": 2}, accum=1),
    "cp cp4": case("cp", {"cp": 4}, rows=2),
    "cp_allgather cp4": case("cp_allgather", {"cp": 4}, rows=2, optimizer="adamw"),
    # expert parallelism (MoE: see the note below)
    "ep ep4": case("ep", {"ep": 4}, MOE),
    "dp+ep dp2×ep2": case("dp+ep", DP2_EP2, MOE, optimizer="adamw"),
    "zero1+ep dp2×ep2": case("zero1+ep", DP2_EP2, MOE),
    "zero2+ep dp2×ep2": case("zero2+ep", DP2_EP2, MOE, optimizer="adamw"),
    "zero3+ep dp2×ep2": case("zero3+ep", DP2_EP2, MOE),
    "hsdp+ep dp2×fsdp2×ep2": case("hsdp+ep", {"dp": 2, "fsdp": 2, "ep": 2}, MOE, accum=1),
    "tp+sp+ep tp2×ep2": case("tp+sp+ep", {"tp": 2, "ep": 2}, MOE, optimizer="adamw"),
}
# MoE cases (model moe): they depend on models.moe's aux-loss semantics (issue 17, deliverable 1: per-row
# statistics, layout-invariant); a failure there that names a router or aux-loss path is that, not a layout bug.


def terms(c: Case) -> int:
    """The tolerance rule's reduction length: the longest sum behind a value, the batch's tokens (a gradient sums
    over them) or the model's widest contraction, longer when the batch is tiny (one row of 4 tokens, dim 64)."""
    cfg = c.cfg
    return max(c.rows * cfg.seq_len, cfg.dim, cfg.mlp, cfg.heads * cfg.d_head, cfg.vocab)


def check(c: Case) -> None:
    """``check_equivalence`` of one case over 2 steps: every rank's loss, grads and params, every step."""
    batch = c.model.example_batch(c.cfg, c.rows, seed=c.seed, with_ignored=c.ignored)
    report = check_equivalence(c.model.init, c.model.loss, c.model.axes, c.cfg, batch, layouts=[c.layout],
                               mesh=Mesh(dict(c.mesh)), steps=2, optimizer=OPTIMIZERS[c.optimizer],
                               accum_steps=c.accum, clip_norm=c.clip, local=c.local, bucket_mb=c.bucket_mb,
                               terms=terms(c))
    assert report.ok and len(report.rows) == 3 * 2  # loss, grads, params per step


def path(c: Case) -> str:
    """The train step's path for a case: local tensors for a pure data layout unless ``local=False``, else DTensor."""
    return "local" if c.local and set(c.layout.split("+")) <= {"dp", "zero1", "zero2", "zero3", "hsdp"} else "DTensor"


@st.composite
def cases(draw: st.DrawFn, ranks: tuple[int, ...] | None = None, presets: frozenset[str] | None = None) -> Case:
    """A mesh of 1-8 ranks over up to 3 of dp/fsdp/tp/cp/ep, a layout it can run (cp and ep included), a tiny model
    that fits both (moe where the mesh has ep, else gpt), and the step's options. ``ranks``: only meshes of these
    sizes; ``presets``: only layouts made of these (the compiled step's, tests/shardings/step/test_jit_equivalence.py).
    """
    mesh_strategy = meshes(max_ranks=max(ranks or (8,)), max_axes=3, axis_names=ALL_AXIS_NAMES)
    mesh = draw(mesh_strategy.filter(lambda m: m.size in ranks) if ranks else mesh_strategy)
    experts = "ep" in mesh.axis_names
    layout_draws = layout_strategy(mesh, experts=experts)
    layout = draw(layout_draws.filter(lambda name: set(name.split("+")) <= presets) if presets else layout_draws)
    parts = layout.split("+")
    tp = mesh.shape["tp"] if "tp" in parts else 1
    cp = mesh.shape["cp"] if {"cp", "cp_allgather"} & set(parts) else 1
    kv_heads = draw(st.sampled_from([tp, 2 * tp] if tp > 1 else [1, 2]))  # MQA/GQA/MHA where tp allows
    heads = kv_heads * draw(st.sampled_from([1, 2]))
    dims = dict(
        vocab=draw(st.integers(17, 40)),  # rarely divisible by tp: uneven vocab shards
        dim=heads * 4, heads=heads, kv_heads=kv_heads, head_dim=4,
        mlp=tp * draw(st.sampled_from([4, 6])) if experts else draw(st.sampled_from([8, 12])),  # experts: even over tp
        seq_len=2 * cp * draw(st.integers(1, 2)) if cp > 1 else 4,  # ring attention: 2·cp chunks
        tie_embeddings=draw(st.booleans()),
    )
    if experts:
        ep = mesh.shape["ep"] if "ep" in parts else 1
        top_k = draw(st.integers(1, 2))
        cfg = moe.Config(**dims, layers=2, moe_every=draw(st.sampled_from([1, 2])),
                         experts=max(top_k, ep * draw(st.integers(1, 2))), top_k=top_k,
                         capacity_factor=draw(st.sampled_from([None, 1.0, 1.25])))
    else:
        cfg = gpt.Config(**dims, layers=draw(st.integers(1, 2)))
    accum = draw(st.sampled_from([1, 2]))
    data = mesh.size // (mesh.shape.get("tp", 1) * mesh.shape.get("cp", 1))
    return Case(layout, tuple(mesh.shape.items()), cfg, data * accum, accum=accum,
                clip=draw(st.sampled_from([None, CLIP])), optimizer=draw(st.sampled_from(["sgd", "adamw"])),
                local=draw(st.booleans()), bucket_mb=draw(st.sampled_from([DEFAULT_BUCKET_MB, SMALL_BUCKETS])),
                ignored=draw(st.booleans()), seed=draw(st.integers(0, 3)))
EXTERNAL = [  # (layout, mesh, model, options) of the tests below that compare with another reference
    ("dp", "dp2 (gloo)", "gpt", "3 steps vs torch DDP + torch.optim.AdamW: grads and params"),
    ("zero3", "dp2 (gloo)", "gpt", "3 steps vs FSDP2 (fully_shard per block) + torch.optim.AdamW: grads and params"),
]


def coverage_matrix() -> str:
    """The markdown table of the fixed cases (``CASES``, then ``EXTERNAL``): layout × mesh × model × options."""
    rows = ["| layout | mesh | model | accum | clip | optimizer | path | buckets | ignored labels | tied |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for c in CASES.values():
        mesh = mesh_name(dict(c.mesh))
        buckets = f"{c.bucket_mb * 1000:g} kB" if c.bucket_mb != DEFAULT_BUCKET_MB else "default"
        rows.append(f"| `{c.layout}` | {mesh} | {MODEL_NAMES[id(c.cfg)]} | {c.accum} | {c.clip or '-'} | "
                    f"{c.optimizer} | {path(c)} | {buckets} | {'yes' if c.ignored else 'no'} | "
                    f"{'yes' if c.cfg.tie_embeddings else 'no'} |")
    rows += ["", "| layout | mesh | model | compared with |", "|---|---|---|---|"]
    rows += [f"| `{layout}` | {mesh} | {model} | {what} |" for layout, mesh, model, what in EXTERNAL]
    return "\n".join(rows)
