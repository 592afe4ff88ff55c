"""Interleaved 1F1B: Megatron's order, round-robin chunks, the bubble divided by v, v times the messages; the
split into pp * v stages; equivalence with one device for it and the zero-bubble schedules."""

import functools

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import core
from shardings import comms, pipeline, simulate
from shardings.pipeline.check import check
from shardings.pipeline.interleaved import interleaved_1f1b
from shardings.pipeline.schedule import ScheduleError, one_f_one_b, timeline
from shardings.testing import check_runs
from tests.shardings.pipeline.cases import microbatches as _microbatches
from tests.shardings.pipeline.cases import setup as _setup


@given(pp=st.integers(1, 5), groups=st.integers(1, 4), v=st.integers(1, 4))
def test_bubble_is_1f1bs_divided_by_v(pp, groups, v):
    m = pp * groups
    schedule = interleaved_1f1b(pp, m, v)
    check(schedule)
    assert schedule.stages == pp * v and [schedule.rank_of(s) for s in range(pp * v)] == list(range(pp)) * v
    # 1F1B's idle slots per rank, 2 (p - 1), each now a chunk's (1/v of a stage's): the idle time divided by v
    assert schedule.bubble() == (pp - 1) / (v * m + pp - 1)
    def makespan(s):
        return max(t + 1 for row in timeline(s) for t, _ in row)

    assert makespan(schedule) - 2 * v * m == 2 * (pp - 1) == makespan(one_f_one_b(pp, m)) - 2 * m
    for r, actions in enumerate(schedule.ranks):
        assert {a.stage for a in actions} == {c * pp + r for c in range(v)}


def test_megatrons_order_and_v_1_is_1f1b():
    forwards = [(a.stage, a.mb) for a in interleaved_1f1b(2, 4, 2).ranks[0] if a.kind == "F"]
    # microbatches in groups of pp through chunk 0 (stage 0), then chunk 1 (stage 2)
    assert forwards == [(0, 0), (0, 1), (2, 0), (2, 1), (0, 2), (0, 3), (2, 2), (2, 3)]
    backwards = [(a.stage, a.mb) for a in interleaved_1f1b(2, 4, 2).ranks[0] if a.kind == "B"]
    assert backwards == [(2, 0), (2, 1), (0, 0), (0, 1), (2, 2), (2, 3), (0, 2), (0, 3)]
    for pp in (1, 2, 4):
        assert interleaved_1f1b(pp, 2 * pp, 1).ranks == one_f_one_b(pp, 2 * pp).ranks


def test_megatrons_constraint_and_bad_virtual_stages_are_refused():
    with pytest.raises(ScheduleError, match=r"microbatches=6 is not a multiple of pp=4 .* Fix: use microbatches=4 or "
                                            r"8"):
        pipeline.build("interleaved_1f1b", 4, 6)
    with pytest.raises(ScheduleError, match=r"virtual_stages=0. Fix: pass an integer virtual_stages >= 1"):
        pipeline.build("interleaved_1f1b", 2, 4, virtual_stages=0)
    with pytest.raises(ScheduleError, match=r"'1f1b' runs 1 stage\(s\) per rank, got virtual_stages=2"):
        pipeline.build("1f1b", 2, 4, virtual_stages=2)
    assert pipeline.build("interleaved_1f1b", 2, 4).stages_per_rank == 2  # the default v


@pytest.mark.parametrize("v", [1, 2, 3])
def test_v_times_the_messages_and_the_split_into_pp_v_stages(v):
    pp, m = 2, 4
    module, cfg, params, batch = _setup("gpt", pp * v, 2 * m)
    split = pipeline.split(params, pp * v)
    assert [len(r) for r in split.ranges] == [1] * (pp * v)
    mbs, weights = _microbatches(batch, m)
    with simulate(pp), comms() as c:
        result = pipeline.run(interleaved_1f1b(pp, m, v), module.stages(cfg), split, params, mbs, weights)
    assert len(result.p2p) == 2 * m * (pp * v - 1)  # 1F1B's 2 m (pp - 1), times about v
    assert c.rows()[0]["count"] == 2 * m * (pp * v - 1)


def _run(module, cfg, batch, optimizer, steps, name, pp, m, v):
    params = module.init(core.random.key(0), cfg)
    schedule = pipeline.build(name, pp, m, **({"virtual_stages": v} if name == "interleaved_1f1b" else {}))
    state, out = optimizer.init(params), []
    mbs, weights = _microbatches(batch, m)
    for _ in range(steps):
        result = pipeline.run(schedule, module.stages(cfg), pipeline.split(params, schedule.stages), params, mbs,
                              weights)
        updates, state = optimizer.update(result.grads, state, params)
        params = core.optim.apply_updates(params, updates)
        out.append([{"loss": result.loss, "grads": result.grads, "params": params}])
    return out


@settings(max_examples=8, deadline=None)
@given(name=st.sampled_from(["interleaved_1f1b", "zb_h1", "zb_v"]), pp=st.integers(1, 3), groups=st.integers(1, 3),
       v=st.integers(1, 3), extra_layers=st.integers(0, 1), model=st.sampled_from(["gpt", "gpt_tied", "mlp", "moe"]))
@example(name="interleaved_1f1b", pp=2, groups=2, v=2, extra_layers=0, model="gpt")
@example(name="zb_h1", pp=3, groups=2, v=1, extra_layers=1, model="gpt_tied")
@example(name="zb_v", pp=2, groups=2, v=2, extra_layers=0, model="moe")
def test_new_schedules_equal_one_device_with_clipping(name, pp, groups, v, extra_layers, model):
    """2 AdamW steps with global-norm clipping; m = pp * groups microbatches (Megatron's constraint)."""
    m, v = pp * groups, {"interleaved_1f1b": v, "zb_h1": 1, "zb_v": 2}[name]
    module, cfg, _, batch = _setup(model, pp * v + extra_layers, 2 * m)
    optimizer, clip = core.optim.adamw(1e-2), 0.5
    clipped = core.optim.chain(core.optim.clip_by_global_norm(clip), optimizer)
    run = functools.partial(_run, module, cfg, batch, clipped, 2, name, pp, m, v)
    check_runs({f"{name} pp={pp} m={m} v={v}": run}, module.init, module.loss, cfg, batch, optimizer=optimizer,
               clip_norm=clip, steps=2)
