"""The compiled step (``train_step(jit=True)``) trains like one device: the coverage property test's kind of cases,
each compared with the single-device reference (loss, grads and params, every rank, every step of 3 AdamW steps),
under fp32 and under a bf16 policy, and a 1% error planted in the compiled graphs caught.

Compiled steps need real ranks (simulated ranks cannot be compiled, torch 2.13), and a launch costs ~8 s before
each case's compile: the cases are drawn in this process and all run in one launch per world size
(:func:`shardings.testing.check_equivalences`), each compiled afresh with ``jit_backend="aot_eager"`` (the same
dynamo graphs and AOTAutograd split as inductor, without its code generation) on the coverage test's tiny models.
A case whose layout would fall back to the eager step fails (``check_equivalence(jit=True)`` raises the warning).
"""

import dataclasses

import pytest
from hypothesis import Phase, given, settings

import core
from core.precision import Policy
from shardings import Mesh
from shardings.step.compiled import DTENSOR_PRESETS
from shardings.testing import check_equivalences
from tests.shardings.step.test_layout_coverage import CLIP, GPT_2, MOE, OPTIMIZERS, Case, case, cases, terms

pytestmark = pytest.mark.multiprocess

STEPS = 3
MOE_2 = dataclasses.replace(MOE, layers=2, moe_every=2)  # a dense block, then a MoE block: one graph each

# The issue's layouts, accumulation 2 and active clipping (CLIP is below every case's gradient norm:
# test_the_pinned_cases_clip). Two ranks where the layout needs no more (each rank compiles its own graphs, and
# this machine has 2 cores): one launch of 2 ranks, one of 4 (hsdp's replica and shard axes, zero3 beside tp).
PINNED = {
    "dp dp2": case("dp", {"dp": 2}, GPT_2, optimizer="adamw"),
    "zero2 dp2": case("zero2", {"dp": 2}, GPT_2, optimizer="adamw"),
    "zero3 dp2": case("zero3", {"dp": 2}, GPT_2, optimizer="adamw"),
    "tp+sp tp2": case("tp+sp", {"tp": 2}, GPT_2, rows=4, optimizer="adamw"),
    "cp cp2": case("cp", {"cp": 2}, GPT_2, rows=4, optimizer="adamw"),
    "ep ep2": case("ep", {"ep": 2}, MOE_2, optimizer="adamw"),
    "hsdp dp2×fsdp2": case("hsdp", {"dp": 2, "fsdp": 2}, GPT_2, optimizer="adamw"),
    "zero3+tp+sp dp2×tp2": case("zero3+tp+sp", {"dp": 2, "tp": 2}, GPT_2, optimizer="adamw"),
    "dp+pp dp2×pp2 1f1b": case("dp+pp", {"dp": 2, "pp": 2}, GPT_2, optimizer="adamw"),
}


def checks(named: dict[str, Case], **options) -> dict:
    """``check_equivalences``' arguments for each case: 3 AdamW steps of the compiled step, a graph per block."""
    out = {}
    for name, c in named.items():
        batch = c.model.example_batch(c.cfg, c.rows, seed=c.seed, with_ignored=c.ignored)
        out[name] = dict(init=c.model.init, loss=c.model.loss, axes=c.model.axes, cfg=c.cfg, batch=batch,
                         layouts=[c.layout], mesh=Mesh(dict(c.mesh)), steps=STEPS, optimizer=OPTIMIZERS[c.optimizer],
                         accum_steps=c.accum, clip_norm=c.clip, local=c.local, bucket_mb=c.bucket_mb, terms=terms(c),
                         stages=c.model.stages, jit=True, jit_backend="aot_eager")
        out[name].update(options)
    return out


def check(named: dict[str, Case], **options) -> dict:
    """Run every case (one launch per world size) and assert each report's rows: loss, grads, params per step."""
    reports = check_equivalences(checks(named, **options))
    for name, report in reports.items():
        assert report.ok and len(report.rows) == 3 * STEPS * (2 if "precision" in options else 1), name
    return reports


def test_the_issues_layouts_compiled_train_like_one_device():
    """dp, zero2, zero3, hsdp, tp+sp, zero3+tp+sp, cp, ep (MoE) and dp+pp with 1F1B (check_equivalence's default
    schedule): accumulation 2, clipping, 3 AdamW steps."""
    check(PINNED)


DRAWS = max(2, settings.default.max_examples // 12)  # ci: 2 cases, explore: 25 (each one compile: ~30 s idle)
COMPILED_CASES = cases(ranks=(2, 4), presets=DTENSOR_PRESETS).map(lambda c: dataclasses.replace(c, optimizer="adamw"))


def drawn(n: int) -> list[Case]:
    """``n`` cases of distinct layouts drawn by hypothesis under the profile (ci: derandomized), here in this process:
    they then run together, one launch per world size. (Hypothesis' first draws are its simplest; distinct layouts
    keep them from being ``n`` meshes of one preset.)"""
    out: list[Case] = []

    @settings(max_examples=20 * n, database=None, phases=[Phase.generate])
    @given(COMPILED_CASES)
    def collect(c: Case) -> None:
        if len(out) < n and c.layout not in {d.layout for d in out}:
            out.append(c)

    collect()
    return out


def test_random_compiled_layouts_train_like_one_device():
    """Compositions of the presets that compile (``DTENSOR_PRESETS``) on 2 or 4 ranks, tp/cp/ep included, with
    accumulation and clipping on or off, local and DTensor paths, tiny gpt or moe models. A failure names its case
    (``check_equivalences``' error: its layout and mesh); hypothesis does not shrink it (every case is one compile)."""
    check({f"{i}: {c.layout} {dict(c.mesh)}": c for i, c in enumerate(drawn(DRAWS))})


BF16 = Policy.bf16_mixed()  # fp32 params and reduction, bf16 compute
BF16_CASES = {name: PINNED[name] for name in ("zero3 dp2", "tp+sp tp2")}


def test_compiled_layouts_under_bf16_match_the_reference_under_the_same_policy():
    """The bf16 run by the low-precision rule (rtol 8·eps(bf16), no √terms), and its fp32 twin (compute in fp32, the
    policy's casts, gathers and fp32 reduction) by the fp32 rule: the twin's detection limits are fp32's, so it
    catches a 1% error in any gradient leaf (the mutation drill plants one in the compiled blocks:
    tests/mutant_catalog.py, ``jit-block-off-by-one-percent``)."""
    reports = check(BF16_CASES, precision=BF16, terms=None)  # each run's rule picks its terms (bf16: 1)
    for name, report in reports.items():
        layout = PINNED[name].layout
        assert report.limit(f"{layout}@fp32", "grads") <= 0.01, (name, report.table())
        assert report.limit(f"{layout}@fp32", "loss") < 1e-3, (name, report.table())


def test_the_pinned_cases_clip():
    """Clipping is active in every pinned case: the reference's gradient norm is above CLIP (one device, no ranks)."""
    for name, c in PINNED.items():
        batch = c.model.example_batch(c.cfg, c.rows, seed=c.seed, with_ignored=c.ignored)
        grads = core.grad(c.model.loss)(c.model.init(core.random.key(0), c.cfg), batch, c.cfg)
        assert c.clip == CLIP < float(core.optim.global_norm(grads)), name
