"""Offloaded roles and activations: the same results as without offload, bitwise in fp32, and the counted host
transfers are exactly the bytes of what was offloaded.

On this CPU-only machine host and device are one memory; ``core.offload`` still copies, so the code path, the
results and the counts are those of a GPU run (where the copies are pinned and ``non_blocking``).
"""

import functools

import pytest
import torch

import core
import shardings
from models import gpt
from shardings import Mesh
from shardings.comm import accounting

CFG = gpt.Config(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, mlp=64, seq_len=16)
BATCH = gpt.example_batch(CFG, 8)


def _train(layout, mesh, steps=2, cfg=CFG):
    """Per step: loss, full params, full optimizer state, host rows; and the step, params and state at the end."""
    with shardings.simulate(mesh.size):
        params = shardings.init(gpt.init, core.random.key(0), cfg, axes=gpt.axes(cfg), layout=layout, mesh=mesh)
        step = shardings.train_step(functools.partial(gpt.loss, cfg=cfg), core.optim.adamw(1e-2), layout=layout,
                                    mesh=mesh, accum_steps=2, clip_norm=0.5)
        state = step.init(params)
        out = []
        for _ in range(steps):
            before = params
            params, state, metrics = step(params, state, BATCH)
            host = {r["kind"]: r["bytes"] for r in metrics["comm"] if r["axis"] == "host"}
            full = lambda t: [x.clone() for x in shardings.per_rank(t)] if isinstance(t, torch.Tensor) else t
            out.append({"loss": metrics["loss"], "params": core.tree.map(full, shardings.gather(params)),
                        "state": core.tree.map(full, shardings.gather(state)), "host": host,
                        "expect": _expected(step, before, metrics)})
    return out


def _expected(step, params, metrics):
    """d2h/h2d bytes the layout's host roles should move in one step, from the bytes those roles hold."""
    host = step.layout.host
    with torch.no_grad():
        placements = step.plan(params).placements["opt_state"]  # the update's param blocks
        blocks = accounting.memory([x.redistribute(x.device_mesh, pl) for x, pl in zip(core.tree.leaves(params),
                                                                                       placements)])
    stored = accounting.memory(params)
    d2h = (metrics["memory"]["grads"] + blocks if "opt_state" in host else 0) + (stored if "params" in host else 0)
    h2d = (blocks if "opt_state" in host else 0) + (stored if "params" in host else 0)
    return {k: v for k, v in {"d2h": d2h, "h2d": h2d}.items() if v}


@pytest.mark.parametrize(("base", "offload", "mesh"), [
    ("zero2", "offload_optimizer", Mesh(dp=4)),
    ("dp", "offload_optimizer+offload_params", Mesh(dp=2)),
    ("zero3", "offload_optimizer+offload_params", Mesh(dp=4)),
    ("zero3+tp+sp", "offload_optimizer", Mesh(dp=2, tp=2)),
    ("zero1+tp", "offload_params", Mesh(dp=2, tp=2)),
])
def test_offloaded_layouts_equal_their_device_twins_bitwise_and_move_exactly_their_bytes(base, offload, mesh):
    want, got = _train(base, mesh), _train(f"{base}+{offload}", mesh)
    for w, g in zip(want, got):
        assert w["loss"] == g["loss"]
        for a, b in zip(core.tree.leaves((w["params"], w["state"])), core.tree.leaves((g["params"], g["state"]))):
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
        assert w["host"] == {} and g["host"] == g["expect"] and g["host"]["d2h"] > 0


def test_offload_optimizer_needs_an_elementwise_optimizer():
    not_elementwise = core.optim.chain(core.optim.clip_by_global_norm(1.0), core.optim.adamw(1e-3))
    with shardings.simulate(2), pytest.raises(ValueError, match=r"elementwise optimizer.*Fix: .*adamw"):
        shardings.train_step(functools.partial(gpt.loss, cfg=CFG), not_elementwise, layout="zero2+offload_optimizer",
                             mesh=Mesh(dp=2))


def test_a_role_that_cannot_live_on_the_host_is_refused():
    from shardings.spec.layouts import Layout

    with pytest.raises(ValueError, match=r"\['grads'\] cannot live in host memory.*Fix: "):
        Layout(host=frozenset({"grads"}))


def _activation_run(remat, layers=2):
    cfg = gpt.Config(vocab=64, dim=32, layers=layers, heads=4, kv_heads=2, mlp=64, seq_len=16, remat=remat)
    with shardings.simulate(2):
        mesh = Mesh(dp=2)
        mesh.device_mesh  # noqa: B018  (built outside comms())
        params = shardings.init(gpt.init, core.random.key(0), cfg, axes=gpt.axes(cfg), layout="dp", mesh=mesh)
        step = shardings.train_step(functools.partial(gpt.loss, cfg=cfg), core.optim.adamw(1e-3), layout="dp",
                                    mesh=mesh)
        _, grads, _ = step.grads(params, BATCH)
        with shardings.comms() as c:
            step.grads(params, BATCH)
        full = [x.clone() for g in core.tree.leaves(shardings.gather(grads)) for x in shardings.per_rank(g)]
    return full, {r["kind"]: r["bytes"] for r in c.rows() if r["axis"] == "host"}


def test_activations_saved_on_host_give_the_same_grads_and_come_back_byte_for_byte():
    want, none = _activation_run(False)
    got, moved = _activation_run("offload")
    assert all(torch.equal(a, b) for a, b in zip(want, got)) and none == {}
    assert moved["d2h"] == moved["h2d"] > 0  # every saved tensor went to the host and came back
    _, deeper = _activation_run("offload", layers=4)
    assert deeper["d2h"] == 2 * moved["d2h"]  # only the blocks' activations: per block, the same bytes
