"""Coverage a user would expect: the configurations users run, each compared with one device (loss, grads and
params, every rank, every step), random draws of the same kind, and the pieces random draws reach too rarely.

- ``CASES``: the ``make train`` layout and its siblings on Mesh(dp=2, tp=2); 3-D meshes with a real HSDP replica
  axis; every pure data layout on the local path with several buckets and on the DTensor path; cp and ep with
  accumulation, clipping and the ZeRO/HSDP compositions, tp+sp+ep, cp=4. They are the pinned ``@example``s of the
  property test, which draws more cases of the same kind (every preset and composition, cp and ep included);
  docs/equivalence.md's coverage matrix is generated from them (:func:`coverage_matrix`).
- torch's own DDP + AdamW and FSDP2 (``fully_shard``) over 3 steps on the same weights (real gloo ranks);
- the DTensor path's ZeRO-3 backward re-gather order and prefetch;
- the vocab-parallel cross-entropy on logits of magnitude 1e4, tp 4 and 8;
- per-role bytes and collectives of ep layouts, from formulas;
- the ``layouts()`` strategy draws every valid composition.
"""

import dataclasses
import functools
import itertools
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

import core
import models.gpt as gpt
import models.moe as moe
import shardings
from core import tree
from experiments import build
from experiments import config as experiments_config
from models.layers import cross_entropy
from shardings import Mesh, P, shard
from shardings.comm import flat_comm
from shardings.comm.buckets import DEFAULT_BUCKET_MB
from shardings.ops.vocab_parallel import nll
from shardings.residency import gather_buckets, gather_params
from shardings.spec import layouts
from shardings.testing import assert_close, check_equivalence, meshes
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


def test_the_fixed_cases_exercise_what_they_say():
    """Clipping active where asked, ignored labels where asked, the path the matrix names, several buckets on the
    local path where asked (a planning pass, no steps)."""
    for name, c in CASES.items():
        batch = c.model.example_batch(c.cfg, c.rows, seed=c.seed, with_ignored=c.ignored)
        assert (batch["labels"] == c.cfg.ignore_index).any() == c.ignored, name
        if c.clip == CLIP:
            grads = core.grad(c.model.loss)(c.model.init(core.random.key(0), c.cfg), batch, c.cfg)
            assert float(core.optim.global_norm(grads)) > CLIP, name
        if set(c.layout.split("+")) <= {"dp", "zero1", "zero2", "zero3", "hsdp"}:  # others never run locally
            mesh = Mesh(dict(c.mesh))
            with shardings.simulate(mesh.size):
                params = shardings.init(c.model.init, core.random.key(0), c.cfg, axes=c.model.axes(c.cfg),
                                        layout=c.layout, mesh=mesh)
                step = shardings.train_step(functools.partial(c.model.loss, cfg=c.cfg), OPTIMIZERS["sgd"](),
                                            layout=c.layout, mesh=mesh, bucket_mb=c.bucket_mb, local=c.local)
                lp = step.plan(params).local
            assert (lp is not None) == (path(c) == "local"), name
            if c.bucket_mb == SMALL_BUCKETS:  # several buckets: boundaries, overlap and prefetch all run
                assert len(lp.gathers if c.layout in ("zero3", "hsdp") else lp.reduces) > 2, name


# -- the property test: random cases of the same kind, the fixed ones pinned ----------------------------------------


@st.composite
def cases(draw: st.DrawFn) -> Case:
    """A mesh of 1-8 ranks over up to 3 of dp/fsdp/tp/cp/ep, a layout it can run (cp and ep included), a tiny model
    that fits both (moe where the mesh has ep, else gpt), and the step's options."""
    mesh = draw(meshes(max_ranks=8, max_axes=3, axis_names=ALL_AXIS_NAMES))
    experts = "ep" in mesh.axis_names
    layout = draw(layout_strategy(mesh, experts=experts))
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


def _pinned(test):
    for c in reversed(CASES.values()):
        test = example(c)(test)
    return test


@_pinned
@given(cases())
def test_layouts_train_like_one_device(c):
    """Random cases (the ci profile's examples, derandomized) and every fixed case in CASES (the ``@example``s)."""
    check(c)


# -- the coverage matrix in docs/equivalence.md -----------------------------------------------------------------------


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


_MATRIX = re.compile(r"<!-- coverage-matrix:begin -->\n(.*?)\n<!-- coverage-matrix:end -->", re.S)


def test_the_coverage_matrix_in_the_docs_is_generated_from_the_cases():
    text = (Path(__file__).parents[2] / "docs" / "equivalence.md").read_text()
    found = _MATRIX.search(text)
    assert found, "docs/equivalence.md lost its <!-- coverage-matrix --> markers"
    assert found.group(1) == coverage_matrix(), (
        "docs/equivalence.md's coverage matrix is out of date. Fix: replace it with the output of "
        "`python -c 'from tests.shardings.test_coverage import coverage_matrix; print(coverage_matrix())'`"
    )


# -- an external reference: torch's DDP + AdamW and FSDP2 on the same weights ------------------------------------------


NATIVE = dict(vocab=32, dim=16, layers=2, heads=2, mlp=32, seq_len=8)  # untied: NativeGpt mirrors untied models
NATIVE_STEPS = 3


def _native_tree(model, cfg, grads):
    """``model``'s full weights (or grads) as a gpt tree: FSDP2's DTensor shards gathered, DDP's tensors as they are."""
    from experiments import native_gpt

    plain = native_gpt.NativeGpt(cfg)
    with torch.no_grad():
        for (name, p), (plain_name, q) in zip(model.named_parameters(), plain.named_parameters(), strict=True):
            assert name == plain_name, (name, plain_name)
            x = p.grad if grads else p
            x = (x.full_tensor() if isinstance(x, DTensor) else x).detach().clone()
            if grads:
                q.grad = x
            else:
                q.copy_(x)
    return native_gpt.to_params(plain, grads=grads)


def _torch_and_ours_on_ranks(steps):
    """On each gloo rank: per layout, per step, the full grads and params of torch's wrapper and of shardlab's step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from experiments import native_gpt

    torch.set_num_threads(1)
    cfg = gpt.Config(**NATIVE)
    batch = gpt.example_batch(cfg, 4)  # no ignored labels: DDP/FSDP2 average per-rank means, equal token counts
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    rows = len(batch["tokens"]) // world
    local = {k: v[rank * rows:(rank + 1) * rows] for k, v in batch.items()}
    out = {}
    for layout in ("dp", "zero3"):
        model = native_gpt.from_params(gpt.init(core.random.key(0), cfg), cfg)
        if layout == "dp":
            wrapped = DistributedDataParallel(model)
        else:  # FSDP2 as torchtitan wraps it: each block, then the root (embedding, final norm, unembedding)
            dp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
            for block in model.blocks:
                fully_shard(block, mesh=dp_mesh)
            wrapped = fully_shard(model, mesh=dp_mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)  # = core.optim.adamw(1e-3)
        theirs = []
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            wrapped(local).backward()
            grads = _native_tree(model, cfg, grads=True)
            opt.step()
            theirs.append({"grads": grads, "params": _native_tree(model, cfg, grads=False)})
        mesh = Mesh(dp=world)
        params = shardings.init(gpt.init, core.random.key(0), cfg, axes=gpt.axes(cfg), layout=layout, mesh=mesh)
        step = shardings.train_step(functools.partial(gpt.loss, cfg=cfg), core.optim.adamw(1e-3), layout=layout,
                                    mesh=mesh)
        state, ours = step.init(params), []
        for _ in range(steps):
            _, grads, _ = step.grads(params, batch)
            params, state = step.apply(params, state, grads)
            ours.append({"grads": shardings.gather(grads), "params": shardings.gather(params)})
        out[layout] = theirs, ours
    return out


@pytest.mark.multiprocess
def test_dp_and_zero3_match_torch_ddp_and_fsdp2_with_adamw_over_three_steps():
    per_rank = shardings.launch(_torch_and_ours_on_ranks, 2, NATIVE_STEPS, backend="gloo")
    cfg = gpt.Config(**NATIVE)
    init = gpt.init(core.random.key(0), cfg)
    tokens = 4 * cfg.seq_len
    for rank, out in enumerate(per_rank):
        for layout, torch_name in (("dp", "DDP"), ("zero3", "FSDP2")):
            theirs, ours = out[layout]
            assert len(theirs) == len(ours) == NATIVE_STEPS
            for i, (t, o) in enumerate(zip(theirs, ours), start=1):
                for quantity in ("grads", "params"):
                    assert_close(o[quantity], t[quantity], terms=tokens,
                                 msg=f"{layout} vs {torch_name}, rank {rank}, step {i}, {quantity}")
            # not vacuous: the weights moved, and so did the gradients between steps
            assert not torch.equal(ours[-1]["params"]["blocks"][0]["wq"], init["blocks"][0]["wq"])
            assert not torch.equal(ours[0]["grads"]["unembed"], ours[-1]["grads"]["unembed"])


# -- the DTensor path's ZeRO-3 backward: re-gather order and prefetch --------------------------------------------------


PREFETCH_CFG = gpt.Config(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, mlp=64, seq_len=8)


@pytest.mark.parametrize(("layout", "mesh", "local"), [
    ("zero3+tp", Mesh(dp=2, tp=2), True),  # model axes: the DTensor path whatever `local` says
    ("zero3", Mesh(dp=4), False),
], ids=["zero3+tp-dp2xtp2", "zero3-dp4-local=False"])
def test_dtensor_path_zero3_regathers_buckets_in_backward_prefetching_the_next(monkeypatch, layout, mesh, local):
    """The DTensor path's mirror of test_local_step's test: backward re-gathers each block bucket once, last block
    first, every one after the first already in flight when backward asks for it; the root's never."""
    created, launches, asked, plans = [], [], [], []  # buckets (forward order); (bucket, in backward); first asks
    init, launch = gather_buckets._Bucket.__init__, gather_buckets._Bucket.launch
    gathered, unit_buckets = gather_params.Regather.gathered, flat_comm.unit_buckets

    def recording_init(self, *args, **kw):
        init(self, *args, **kw)
        created.append(self)

    def recording_launch(self):
        launches.append((created.index(self), torch._C._current_autograd_node() is not None))
        return launch(self)

    def recording_gathered(self, k):
        bucket = self.buckets[k]  # registered by gather_buckets: launch is its _Bucket's bound method
        if bucket.hold and bucket.cached is None:  # backward's first ask: was its gather already launched?
            asked.append((created.index(bucket.launch.__self__), bucket.pending is not None))
        return gathered(self, k)

    def recording_unit_buckets(*args, **kw):
        plans.append(unit_buckets(*args, **kw))
        return plans[-1]

    monkeypatch.setattr(gather_buckets._Bucket, "__init__", recording_init)
    monkeypatch.setattr(gather_buckets._Bucket, "launch", recording_launch)
    monkeypatch.setattr(gather_params.Regather, "gathered", recording_gathered)
    monkeypatch.setattr(flat_comm, "unit_buckets", recording_unit_buckets)
    batch = gpt.example_batch(PREFETCH_CFG, 4)
    with shardings.simulate(mesh.size):
        params = shardings.init(gpt.init, core.random.key(0), PREFETCH_CFG, axes=gpt.axes(PREFETCH_CFG),
                                layout=layout, mesh=mesh)
        step = shardings.train_step(functools.partial(gpt.loss, cfg=PREFETCH_CFG), core.optim.sgd(0.1),
                                    layout=layout, mesh=mesh, bucket_mb=0.01, local=local)
        step.grads(params, batch)
        assert step.plan(params).local is None
    ((bucketed, kept),) = plans
    n, paths = len(created), [path for path, _ in tree.leaves_with_path(params)]
    assert n == len(bucketed) > PREFETCH_CFG.layers + 1  # several buckets per block
    forward = [k for k, backward in launches if not backward]
    backward = [k for k, backward in launches if backward]
    assert forward == list(range(n))  # in order, each once, as the loss first uses them (the next in flight)
    per_bucket = [{flat_comm.unit_of(paths[i]) for i in b} for b in bucketed]
    assert all(len(u) == 1 for u in per_bucket)  # a bucket never spans two blocks
    assert set(kept) == {k for k, u in enumerate(per_bucket) if u == {()}}  # the root's stay gathered
    assert sorted(backward) == sorted(set(range(n)) - set(kept))  # every block bucket re-gathered, once
    assert backward == sorted(backward, reverse=True)  # last block first
    assert [k for k, _ in asked] == backward
    assert not asked[0][1] and all(prefetched for _, prefetched in asked[1:])  # each next one was in flight


# -- the vocab-parallel cross-entropy on large logits ------------------------------------------------------------------


def _large_logits(kind, vocab, tp):
    """``(4, 6, vocab)`` logits of magnitude 1e4 (exp() overflows without the max shift): spread (N(0, 1e4²): the
    softmax is ~one-hot) or shifted (1e4 + N(0, 3²): a full softmax on top of a large common offset); labels with
    about a quarter ignored; a cotangent per token."""
    gen = torch.Generator().manual_seed(tp + vocab)
    noise = torch.randn(4, 6, vocab, generator=gen)
    x = noise * 1e4 if kind == "spread" else 1e4 + 3 * noise
    labels = torch.randint(0, vocab, (4, 6), generator=gen)
    ignored = labels.masked_fill(torch.rand(4, 6, generator=gen) < 0.25, GPT.ignore_index)
    return x, labels, ignored, torch.randn(4, 6, generator=gen)


def _vocab_parallel(x, labels, ignored, cot, tp):
    """On tp simulated ranks, x's vocab dim sharded: per rank, per-token nll and its gradient, the mean loss
    (``cross_entropy`` with ignored labels) and its gradient, as full tensors."""
    with shardings.simulate(tp):
        mesh = Mesh(tp=tp)
        logits = shard(x, P(None, None, "tp"), mesh).requires_grad_()
        per_token = nll(logits, shard(labels, P(), mesh))
        (grad,) = torch.autograd.grad(per_token, logits, shard(cot, P(), mesh))
        logits = shard(x, P(None, None, "tp"), mesh).requires_grad_()
        mean = cross_entropy(logits, shard(ignored, P(), mesh), GPT.ignore_index)
        (mean_grad,) = torch.autograd.grad(mean, logits)
        return list(zip(*(shardings.per_rank(t.full_tensor()) for t in (per_token, grad, mean, mean_grad))))


def _values_and_grads(fn, x, labels, ignored, cot):
    ref = x.clone().requires_grad_()
    per_token = fn(ref, labels, None)
    (grad,) = torch.autograd.grad(per_token, ref, cot)
    ref = x.clone().requires_grad_()
    mean = fn(ref, ignored, GPT.ignore_index)
    (mean_grad,) = torch.autograd.grad(mean, ref)
    return per_token.detach(), grad, mean.detach(), mean_grad


def _ours(x, labels, ignore_index):  # shardlab's single-device loss: what the gpt reference runs
    return nll(x, labels) if ignore_index is None else cross_entropy(x, labels, ignore_index)


def _torch(x, labels, ignore_index):
    if ignore_index is None:
        return F.cross_entropy(x.flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)
    return F.cross_entropy(x.flatten(0, 1), labels.flatten(), ignore_index=ignore_index)


# vocab 64: nll's block function on each rank's block; vocab 60 over tp 8: uneven blocks, the composite form
@pytest.mark.parametrize(("kind", "vocab", "tp"), list(itertools.product(["spread", "shifted"], [64, 60], [4, 8])))
def test_vocab_parallel_cross_entropy_on_logits_of_magnitude_1e4_equals_one_device_and_torch(kind, vocab, tp):
    x, labels, ignored, cot = _large_logits(kind, vocab, tp)
    references = {"one device": _values_and_grads(_ours, x, labels, ignored, cot),
                  "torch": _values_and_grads(_torch, x, labels, ignored, cot)}
    names = ("per-token loss", "its gradient", "mean loss", "its gradient")
    for rank, got in enumerate(_vocab_parallel(x, labels, ignored, cot, tp)):
        for reference, want in references.items():
            for name, g, w in zip(names, got, want):
                assert w.isfinite().all(), name
                # a loss subtracts logits of size |x| (the rule's magnitude); gradients take the plain rule
                magnitude = float(x.abs().max()) if "loss" in name else None
                assert_close(g, w, terms=vocab, magnitude=magnitude, msg=f"rank {rank} vs {reference}, {name}")


# -- ep layouts: persistent bytes per role and collectives per step, from formulas -------------------------------------


def _moe_sizes(cfg):
    """Elements of the dense weights and of the expert weights (leaves with an ``expert`` dim), the number of dense
    leaves and of all leaves, the MoE layers, and the root's elements (outside the blocks)."""
    params = moe.init(core.random.key(0), cfg)
    sizes = [x.numel() for x in tree.leaves(params)]
    is_expert = [("expert" in names) for names in tree.leaves(moe.axes(cfg), is_leaf=lambda a: isinstance(a, tuple))]
    expert = sum(n for n, e in zip(sizes, is_expert) if e)
    root = sum(x.numel() for k, x in params.items() if k != "blocks")
    return (sum(sizes) - expert, expert, is_expert.count(False), len(sizes), sum(map(cfg.is_moe, range(cfg.layers))),
            root)


def _ring(kind, n, nbytes):
    return nbytes * 2 * (n - 1) // n if kind == "all_reduce" else nbytes * (n - 1) // n


def _ep_memory(divisors):
    """Persistent bytes per rank per role: dense weights split by the data presets, expert weights by ep too;
    AdamW's two moments and its int32 step count."""
    dense, expert, *_ = _moe_sizes(MOE_2)
    out = {role: 4 * (dense // d + expert // e) * (2 if role == "opt_state" else 1) for role, (d, e) in
           zip(("params", "grads", "opt_state"), divisors)}
    out["opt_state"] += 4
    return out


def _ep_comm(layout, mesh, rows):
    """Kinds, axes, counts and bytes of one step, from the model's sizes (DESIGN §4's ep row, §6's formulas)."""
    dense, expert, n_dense, n_leaves, moe_layers, root = _moe_sizes(MOE_2)
    ep, dp = mesh["ep"], mesh.get("dp", 1)
    local = 4 * (dense + expert // ep)  # a rank's share of the weights: experts split over ep
    # the MoE layers' all-to-alls: per layer 2 forward + 2 backward, each (ep-1)/ep of one rank's
    # (experts, rows · capacity, dim) fp32 buffer
    rank_rows = rows // math.prod(n for a, n in mesh.items() if a in ("dp", "fsdp", "ep"))
    buffer = 4 * MOE_2.experts * rank_rows * moe.capacity(MOE_2, MOE_2.seq_len) * MOE_2.dim
    table = {("all_to_all", "ep"): (4 * moe_layers, 4 * moe_layers * _ring("all_to_all", ep, buffer))}
    if layout in ("ep", "dp+ep"):
        # DDP over (dp, ep) for the dense weights (one bucket: all-reduce over each axis), over dp for experts
        table[("all_reduce", "ep")] = (1, _ring("all_reduce", ep, 4 * dense))
        if dp > 1:
            table[("all_reduce", "dp")] = (2, _ring("all_reduce", dp, local))
    elif layout in ("zero1+ep", "zero2+ep"):
        # per leaf (the DTensor path): reduce-scatter over dp, then the dense shard all-reduced over ep;
        # the updated shards all-gathered back over dp
        table[("reduce_scatter", "dp")] = (n_leaves, _ring("reduce_scatter", dp, local))
        table[("all_reduce", "ep")] = (n_dense, _ring("all_reduce", ep, 4 * dense // dp))
        table[("all_gather", "dp")] = (n_leaves, _ring("all_gather", dp, local))
    else:  # zero3+ep, hsdp+ep: ZeRO-3 over the shard axis
        # one bucket per block and one for the root: gathered, blocks again in backward, reduce-scattered;
        # before that each dense gradient is all-reduced over ep whole, one collective per leaf (and hsdp's
        # replica all-reduce over dp moves each leaf's whole gradient too: DTensor reduces Partial over the
        # mesh dims in order, dp before fsdp; reducing the fsdp shard would move half)
        units, axis = MOE_2.layers + 1, "fsdp" if "fsdp" in mesh else "dp"
        table[("all_gather", axis)] = (2 * units - 1, _ring("all_gather", mesh[axis], 2 * local - 4 * root))
        table[("reduce_scatter", axis)] = (units, _ring("reduce_scatter", mesh[axis], local))
        table[("all_reduce", "ep")] = (n_dense, _ring("all_reduce", ep, 4 * dense))
        if axis == "fsdp":
            table[("all_reduce", "dp")] = (n_leaves, _ring("all_reduce", dp, local))
    return table


# (dense divisor, expert divisor) of params, grads, opt_state per rank: the data presets split dense weights,
# ep splits expert weights in every role
EP_BYTES = {
    "ep ep2": ("ep", {"ep": 2}, [(1, 2), (1, 2), (1, 2)]),
    "ep ep4": ("ep", {"ep": 4}, [(1, 4), (1, 4), (1, 4)]),
    "dp+ep dp2×ep2": ("dp+ep", DP2_EP2, [(1, 2), (1, 2), (1, 2)]),
    "zero1+ep dp2×ep2": ("zero1+ep", DP2_EP2, [(1, 2), (1, 2), (2, 4)]),
    "zero2+ep dp2×ep2": ("zero2+ep", DP2_EP2, [(1, 2), (2, 4), (2, 4)]),
    "zero3+ep dp2×ep2": ("zero3+ep", DP2_EP2, [(2, 4), (2, 4), (2, 4)]),
    "hsdp+ep dp2×fsdp2×ep2": ("hsdp+ep", {"dp": 2, "fsdp": 2, "ep": 2}, [(2, 4), (2, 4), (2, 4)]),
}


@pytest.mark.parametrize(("layout", "sizes", "divisors"), list(EP_BYTES.values()), ids=list(EP_BYTES))
def test_ep_layouts_persistent_bytes_per_role_and_collectives_per_step(layout, sizes, divisors):
    # torch caches DTensor's sharding propagation by spec equality, so after an earlier simulate() in this process
    # some gradients carry that session's (equal, torn-down) DeviceMesh and buckets.plan, which keys buckets by the
    # DeviceMesh object, reduces them in two collectives instead of one: start from empty caches
    _clear_sharding_prop_cache()
    rows = max(4, math.prod(n for a, n in sizes.items() if a != "tp"))
    mesh, batch = Mesh(sizes), moe.example_batch(MOE_2, rows)  # built outside simulate(): one global batch
    with shardings.simulate(mesh.size):
        params = shardings.init(moe.init, core.random.key(0), MOE_2, axes=moe.axes(MOE_2), layout=layout, mesh=mesh)
        step = shardings.train_step(functools.partial(moe.loss, cfg=MOE_2), core.optim.adamw(1e-3), layout=layout,
                                    mesh=mesh, axes=moe.axes(MOE_2))
        _, _, metrics = step(params, step.init(params), batch)
    assert metrics["memory"] == _ep_memory(divisors)
    assert {(r["kind"], r["axis"]): (r["count"], r["bytes"]) for r in metrics["comm"]} == _ep_comm(layout, sizes, rows)


# -- the layouts() strategy reaches every valid composition -----------------------------------------------------------


def _all_compositions():
    """Every composition the registry accepts: a data strategy or none, tp(+sp) or not, a cp variant, ep or not."""
    out = set()
    for parts in itertools.product([None, "dp", "zero1", "zero2", "zero3", "hsdp"], [None, "tp", "tp+sp"],
                                   [None, "cp", "cp_allgather"], [None, "ep"]):
        name = "+".join(p for p in parts if p)
        if name:
            layouts.get(name)  # valid
            out.add(frozenset(name.split("+")))
    return out


def test_the_layouts_strategy_draws_every_preset_and_valid_composition():
    mesh = Mesh({a: 2 for a in ALL_AXIS_NAMES})  # every axis a preset needs (never built: no ranks)
    every, drawn = _all_compositions(), set()
    assert len(every) == 6 * 3 * 3 * 2 - 1

    @settings(max_examples=3000, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(layout_strategy(mesh))
    def draw_all(name):
        drawn.add(frozenset(name.split("+")))

    draw_all()
    assert drawn == every, sorted(map(sorted, every - drawn))

    # what a mesh lacks is never drawn; nor cp/ep with context/experts off (a model without ring attention/experts)
    @settings(max_examples=200, database=None, derandomize=True)
    @given(layout_strategy(Mesh(dp=2, tp=2)), layout_strategy(mesh, context=False, experts=False))
    def never(small, without):
        assert not set(small.split("+")) & {"hsdp", "cp", "cp_allgather", "ep"}
        assert not set(without.split("+")) & {"cp", "cp_allgather", "ep"}

    never()
