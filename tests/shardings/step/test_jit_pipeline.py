"""``train_step(jit=True)`` under ``pp``: each stage's blocks run the compiled block graph, under every schedule.

Compiled steps need real gloo ranks (simulated ranks cannot be compiled, torch 2.13); ``tiny`` gpt shapes and
``jit_backend="aot_eager"`` (the same graphs and forward/backward split as inductor, without code generation) keep
the compile to tens of seconds a launch. The zero-bubble split of a compiled block's backward runs in one process.
Against the single-device reference (accumulation, clipping, 3 AdamW steps): dp+pp with 1F1B, zero3+pp with ZB-H1,
tp+pp with ZB-V, and pp with ZB-H1 under bf16 are cases of tests/shardings/step/test_jit_equivalence.py
(in the launches of its other cases).
"""

import functools
from typing import Any

import pytest
import torch

import core
import shardings
from core import deferred, tree
from models import gpt
from shardings import Mesh, launch
from shardings.pipeline import SCHEDULES
from shardings.pipeline.backward import backward_input, backward_weight
from shardings.step.compiled import WARMUP_STEPS
from shardings.testing import assert_close

CFG = gpt.Config(vocab=256, dim=64, layers=2, heads=4, seq_len=32)
DEEP = gpt.Config(vocab=256, dim=64, layers=4, heads=4, seq_len=32)  # 4 stages for the schedules with 2 per rank


def _local(grads: Any) -> list[torch.Tensor]:
    """This rank's gradient blocks (another stage's block is absent: a meta tensor)."""
    blocks = [x.to_local() if hasattr(x, "to_local") else x for x in tree.leaves(grads)]
    return [x for x in blocks if x.device.type != "meta"]


def _every_schedule(layout: str, mesh: Mesh) -> dict[str, dict]:
    """Per schedule: (graphs, graph breaks) so far after each compiled step, its losses beside an eager twin's, and
    both steps' gradients at the final params. One dynamo cache for all schedules: the block compiles once."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    with deferred.deferred():
        shapes = gpt.init(core.random.key(0), DEEP)
    batch, out = gpt.example_batch(DEEP, 8), {}
    for name in SCHEDULES:
        plan = shardings.pipeline.plan(layout, mesh, shapes, schedule=name, accum_steps=4)
        params = shardings.init(gpt.init, core.random.key(0), DEEP, axes=gpt.axes(DEEP), layout=layout, mesh=mesh,
                                plan=plan)
        make = functools.partial(shardings.train_step, gpt.stages(DEEP), core.optim.adamw(1e-3), layout=layout,
                                 mesh=mesh, accum_steps=4, clip_norm=0.5, plan=plan)
        step, eager = make(jit=True, jit_backend="aot_eager"), make()
        compiled, twin, run = (params, step.init(params)), (params, eager.init(params)), {"counts": [], "losses": []}
        for _ in range(WARMUP_STEPS + 1):  # the last one under fail_on_recompile
            *compiled, metrics = step(*compiled, batch)
            *twin, want = eager(*twin, batch)
            run["counts"].append((counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())))
            run["losses"].append((metrics["loss"], want["loss"]))
        run["grads"] = [_local(s.grads(p, batch)[1]) for s, p in ((step, compiled[0]), (eager, twin[0]))]
        out[name] = run
    return out


@pytest.mark.multiprocess
def test_every_schedule_compiles_one_block_graph_without_breaks_or_recompiles_and_equals_its_eager_twin():
    got = launch(_every_schedule, 4, "dp+pp", Mesh(dp=2, pp=2))
    for rank, runs in enumerate(got):
        for name, run in runs.items():
            # one graph for every block of every stage under every schedule (the same block shapes), none broken,
            # none added after the first schedule's first step
            assert run["counts"] == [(1, 0)] * (WARMUP_STEPS + 1), (rank, name, run["counts"])
            jit_losses, eager_losses = (torch.tensor(x) for x in zip(*run["losses"], strict=True))
            assert_close(jit_losses, eager_losses, terms=8 * DEEP.seq_len, msg=f"{name}: jit vs eager losses")
            jit_grads, eager_grads = run["grads"]
            assert len(jit_grads) == len(eager_grads) > 0, (rank, name)
            for a, b in zip(jit_grads, eager_grads, strict=True):
                assert_close(a, b, terms=8 * DEEP.seq_len, msg=f"rank {rank} {name}: jit vs eager grads")


def test_zero_bubble_split_of_a_compiled_block_runs_its_backward_once_and_equals_the_whole_backward_bitwise():
    def block(w1, w2, x):
        return torch.tanh(x @ w1) @ w2

    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    w1, w2, w3, x = (torch.randn(4, 4, requires_grad=True, generator=torch.Generator().manual_seed(i))
                     for i in range(4))
    runs = []
    y = (compiled(w1, w2, x @ w3) * 2).sin()  # eager ops before and after the compiled node
    node = next(n for n, _ in y.grad_fn.next_functions[0][0].next_functions if n is not None)
    node.register_prehook(lambda g: runs.append(1))
    whole = torch.autograd.grad([y], [x, w1, w2, w3], [torch.ones_like(y)], retain_graph=True)
    runs.clear()
    b, pending = backward_input([y], [torch.ones_like(y)], [x], [w1, w2, w3])
    w = backward_weight(pending, [w1, w2, w3])
    assert len(runs) == 1  # B ran the compiled backward; W re-entered below it with what B computed
    assert all(torch.equal(a, c) for a, c in zip(whole, b + w, strict=True))


def test_terapipe_compiles_a_prefix_graph_per_chunk_position_past_torchs_recompile_limit():
    """TeraPipe under ``jit=True``: the compiled stages' ``prefix_block`` (what each pipeline stage runs) compiles a
    graph per chunk position, so k = 12 chunks need 12 graphs of one function, past torch's recompile limit (8): it
    is raised for that function alone (``compiled.PREFIX_GRAPHS``). Hitting a limit is an error here, never a silent
    eager fallback, and the compiled chunks' loss and gradients equal the whole sequence's eager ones."""
    from shardings.runtime.compat import dynamo_config_patch
    from shardings.step.compiled import compile_loss

    cfg = gpt.Config(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, mlp=64, seq_len=12)
    params = gpt.init(core.random.key(0), cfg)
    batch, k = gpt.example_batch(cfg, 2), 12
    graphs = []

    def counting(gm, example_inputs):  # the eager backend, counting the graphs dynamo hands it
        graphs.append(gm)
        return gm.forward

    compiled = compile_loss(gpt.stages(cfg), counting)
    with dynamo_config_patch(fail_on_recompile_limit_hit=True):
        loss, grads = core.value_and_grad(
            lambda p: compiled.chunked_loss(p, shardings.pipeline.cut(batch, [1] * k), [1 / k] * k))(params)
    want, want_grads = core.value_and_grad(gpt.stages(cfg).loss)(params, batch)
    assert len(graphs) == k
    assert_close(loss, want)
    for g, w in zip(tree.leaves(grads), tree.leaves(want_grads)):
        assert_close(g, w)
