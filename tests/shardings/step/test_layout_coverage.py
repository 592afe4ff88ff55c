"""Coverage a user would expect: the configurations users run, each compared with one device (loss, grads and
params, every rank, every step), random draws of the same kind, and the pieces random draws reach too rarely.

- ``CASES``: the ``make train`` layout and its siblings on Mesh(dp=2, tp=2); 3-D meshes with a real HSDP replica
  axis; every pure data layout on the local path with several buckets and on the DTensor path; cp and ep with
  accumulation, clipping and the ZeRO/HSDP compositions, tp+sp+ep, cp=4. They are the pinned ``@example``s of the
  property test, which draws more cases of the same kind (every preset and composition, cp and ep included);
  docs/equivalence.md's coverage matrix is generated from them (:func:`coverage_matrix`).
- the ``layouts()`` strategy draws every valid composition.

Beside it: tests/shardings/step/test_external_reference.py (torch's DDP and FSDP2 on the same weights),
tests/shardings/residency/test_zero3_regather.py (the DTensor path's ZeRO-3 prefetch order),
tests/shardings/ops/test_vocab_parallel.py (cross-entropy on logits of 1e4) and
tests/shardings/step/test_ep_memory_and_comms.py (ep layouts' bytes per role).
"""

import functools
import itertools
import re
from pathlib import Path

from hypothesis import HealthCheck, example, given, settings

import core
import shardings
from shardings import Mesh
from shardings.spec import layouts
from shardings.testing.strategies import ALL_AXIS_NAMES
from shardings.testing.strategies import layouts as layout_strategy
from tests.shardings.step.layout_cases import (
    CASES,
    CLIP,
    OPTIMIZERS,
    SMALL_BUCKETS,
    cases,
    check,
    coverage_matrix,
    path,
)


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


def _pinned(test):
    for c in reversed(CASES.values()):
        test = example(c)(test)
    return test


# Half the profile's random draws (ci: 12, explore: 150): the suite's longest test (~8 s a case, up to 8 simulated
# ranks); the 32 pinned cases are its fixed coverage, and the random draws go on in ``make test-explore``.
@_pinned
@settings(max_examples=settings.default.max_examples // 2)
@given(cases())
def test_layouts_train_like_one_device(c):
    """Random cases (half the profile's examples, derandomized in ci) and every fixed case in CASES (the
    ``@example``s)."""
    check(c)


# -- the coverage matrix in docs/equivalence.md -----------------------------------------------------------------------


_MATRIX = re.compile(r"<!-- coverage-matrix:begin -->\n(.*?)\n<!-- coverage-matrix:end -->", re.S)


def test_the_coverage_matrix_in_the_docs_is_generated_from_the_cases():
    text = (Path(__file__).resolve().parents[3] / "docs" / "equivalence.md").read_text()
    found = _MATRIX.search(text)
    assert found, "docs/equivalence.md lost its <!-- coverage-matrix --> markers"
    assert found.group(1) == coverage_matrix(), (
        "docs/equivalence.md's coverage matrix is out of date. Fix: replace it with the output of "
        "`python -c 'from tests.shardings.step.layout_cases import coverage_matrix; print(coverage_matrix())'`"
    )


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
