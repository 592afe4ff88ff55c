"""shardings.pipeline.run on simulated ranks: loss, grads and params after AdamW steps equal one device's for
GPipe and 1F1B at any pp, microbatches and layers; P2P counted exactly; 1F1B holds pp microbatches' activations."""

import functools

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.utils import _pytree as pytree

import core
import shardings
from shardings import comms, pipeline
from shardings.testing import EquivalenceError, check_runs
from tests.shardings.pipeline.cases import MODELS, microbatches, setup


def _reference_grads(module, cfg, params, batch):
    leaves, spec = pytree.tree_flatten(params)
    leaves = [x.detach().requires_grad_() for x in leaves]
    loss = module.loss(pytree.tree_unflatten(leaves, spec), batch, cfg)
    return loss.detach(), pytree.tree_unflatten(list(torch.autograd.grad(loss, leaves)), spec)


def _pipeline_grads(module, cfg, params, batch, schedule, pp, m):
    mbs, weights = microbatches(batch, m)
    result = pipeline.run(pipeline.build(schedule, pp, m), module.stages(cfg), pipeline.split(params, pp), params,
                          mbs, weights)
    return result.loss, result.grads


def _pipeline_run(module, cfg, batch, optimizer, steps, schedule, pp, m):
    """Per step, the pipeline's {loss, grads, params} (one tree: simulated ranks hold the global values)."""
    params = module.init(core.random.key(0), cfg)
    state, out = optimizer.init(params), []
    for _ in range(steps):
        loss, grads = _pipeline_grads(module, cfg, params, batch, schedule, pp, m)
        updates, state = optimizer.update(grads, state, params)
        params = core.optim.apply_updates(params, updates)
        out.append([{"loss": loss, "grads": grads, "params": params}])
    return out


@settings(max_examples=10, deadline=None)
@given(schedule=st.sampled_from(["gpipe", "1f1b"]), pp=st.sampled_from([2, 4]), m=st.sampled_from([1, 2, 4, 8]),
       extra_layers=st.integers(0, 3), model=st.sampled_from(list(MODELS)))
@example(schedule="gpipe", pp=2, m=4, extra_layers=0, model="gpt")
@example(schedule="1f1b", pp=4, m=8, extra_layers=1, model="gpt")  # 5 layers on 4 stages
@example(schedule="1f1b", pp=2, m=2, extra_layers=1, model="moe")
@example(schedule="gpipe", pp=4, m=1, extra_layers=2, model="mlp")
@example(schedule="1f1b", pp=2, m=4, extra_layers=0, model="gpt_tied")
def test_adamw_steps_equal_one_device_with_clipping(schedule, pp, m, extra_layers, model):
    """3 AdamW steps with global-norm clipping; microbatches are the accumulation (token-weighted)."""
    module, cfg, _, batch = setup(model, pp + extra_layers, 8)
    optimizer, clip = core.optim.adamw(1e-2), 0.5
    clipped = core.optim.chain(core.optim.clip_by_global_norm(clip), optimizer)
    run = functools.partial(_pipeline_run, module, cfg, batch, clipped, 3, schedule, pp, m)
    check_runs({f"{schedule} pp={pp} m={m}": run}, module.init, module.loss, cfg, batch, optimizer=optimizer,
               clip_norm=clip)


@pytest.mark.parametrize("model", list(MODELS))
def test_stages_composed_are_the_models_loss(model):
    module, cfg, params, batch = setup(model, 3, 4)
    assert torch.equal(module.stages(cfg).loss(params, batch), module.loss(params, batch, cfg))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp,m", [(2, 4), (4, 2), (3, 5)])
def test_p2p_is_m_activations_forward_and_m_gradients_back_per_boundary(schedule, pp, m):
    module, cfg, params, batch = setup("gpt", pp, 2 * m)
    mbs, weights = microbatches(batch, m)
    with shardings.simulate(pp), comms() as c:
        result = pipeline.run(pipeline.build(schedule, pp, m), module.stages(cfg), pipeline.split(params, pp), params,
                              mbs, weights)
    one = (2 * m // m) * cfg.seq_len * cfg.dim * 4  # b/m · s · h float32
    for kind, stage in [("F", s) for s in range(pp - 1)] + [("B", s) for s in range(1, pp)]:
        sent = [msg for msg in result.p2p if (msg.kind, msg.stage) == (kind, stage)]
        assert sorted(msg.mb for msg in sent) == list(range(m)) and {msg.nbytes for msg in sent} == {one}
    assert len(result.p2p) == 2 * m * (pp - 1)
    assert c.rows() == [{"kind": "send", "axis": "pp", "count": 2 * m * (pp - 1), "bytes": 2 * m * (pp - 1) * one}]


def test_1f1b_holds_pp_microbatches_where_gpipe_holds_all():
    pp = 2
    peaks = {}
    for m in (2, 4, 8):
        module, cfg, params, batch = setup("gpt", 2, 2 * m)
        mbs, weights = microbatches(batch, m)
        for schedule in ("gpipe", "1f1b"):
            result = pipeline.run(pipeline.build(schedule, pp, m), module.stages(cfg), pipeline.split(params, pp),
                                  params, mbs, weights)
            peaks[schedule, m] = result.saved_peak[0]
    one = peaks["gpipe", 2] / 2  # every microbatch has the same shapes: the same saved bytes
    for m in (2, 4, 8):
        assert peaks["gpipe", m] == m * one
        assert peaks["1f1b", m] == min(pp, m) * one


def test_bad_input_is_refused_before_any_work():
    module, cfg, params, batch = setup("gpt", 2, 4)
    with pytest.raises(ValueError, match="2 blocks cannot fill 4 stages"):
        pipeline.split(params, 4)
    with pytest.raises(ValueError, match="sizes"):
        pipeline.split(params, 2, sizes=[2, 0])
    mbs, weights = microbatches(batch, 2)
    with pytest.raises(ValueError, match="schedule for 2 stages, m=4"):
        pipeline.run(pipeline.build("gpipe", 2, 4), module.stages(cfg), pipeline.split(params, 2), params, mbs, weights)
    broken = pipeline.build("gpipe", 2, 2)
    broken = pipeline.Schedule(broken.name, broken.pp, broken.microbatches, (broken.ranks[0][1:], broken.ranks[1]))
    with pytest.raises(pipeline.ScheduleError):
        pipeline.run(broken, module.stages(cfg), pipeline.split(params, 2), params, mbs, weights)


def test_split_balances_cost_and_prints():
    _, _, params, _ = setup("gpt", 5, 2)
    s = pipeline.split(params, 2)
    assert [len(r) for r in s.ranges] in ([3, 2], [2, 3]) and s.ranges[0].start == 0 and s.ranges[-1].stop == 5
    assert str(s).splitlines()[0].startswith("stage 0: blocks 0..")
    heavy_first = pipeline.split(params, 2, costs=[10, 1, 1, 1, 1])
    assert [len(r) for r in heavy_first.ranges] == [1, 4]
    assert [len(r) for r in pipeline.split(params, 2, sizes=[4, 1]).ranges] == [4, 1]


def test_a_one_percent_error_in_one_microbatch_is_caught():
    module, cfg, _, batch = setup("gpt", 2, 8)
    real_run = pipeline.run

    def planted(schedule, stages, split, params, mbs, weights):
        return real_run(schedule, stages, split, params, mbs, [weights[0] * 1.01, *weights[1:]])

    optimizer = core.optim.adamw(1e-2)
    run = functools.partial(_pipeline_run, module, cfg, batch, optimizer, 2, "1f1b", 2, 4)
    check_runs({"1f1b": run}, module.init, module.loss, cfg, batch, optimizer=optimizer, steps=2)
    with pytest.MonkeyPatch.context() as mp, pytest.raises(EquivalenceError, match="1f1b"):
        mp.setattr(pipeline, "run", planted)
        check_runs({"1f1b": run}, module.init, module.loss, cfg, batch, optimizer=optimizer, steps=2)
