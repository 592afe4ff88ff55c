"""``train_step(jit=True)``: the compiled step compiles once, equals its eager twin, and says no (its equivalence
with the single-device reference: tests/shardings/step/test_jit_equivalence.py).

Compiled steps run on real gloo ranks only (simulated ranks cannot be compiled, torch 2.13). Compiling costs
most of these tests' time, so they use the ``tiny`` gpt and ``jit_backend="aot_eager"``: the same dynamo graphs
and AOTAutograd forward/backward split as inductor, without inductor's code generation (tens of seconds per
rank on this 2-core box; the inductor path is the bench's, ``python -m experiments.bench --jit``). Each test is
one launch that runs all its cases in sequence.
"""

import dataclasses
import functools
import warnings
import weakref
from typing import Any

import pytest
import torch

import core
import shardings
from models import gpt, moe
from shardings import Mesh, launch
from shardings.runtime.compat import TorchDispatchMode, inductor_cache_dir
from shardings.spec.errors import ShardingError
from shardings.step.compiled import RANK_CACHES, WARMUP_STEPS, CompileFallbackWarning
from shardings.testing import assert_close

pytestmark = pytest.mark.multiprocess

CFG = gpt.Config(vocab=256, dim=64, layers=2, heads=4, seq_len=32)
MOE = moe.Config(vocab=256, dim=64, layers=2, heads=4, seq_len=32, experts=4, top_k=2)  # block 0 dense, 1 MoE


class _Received(TorchDispatchMode):
    """The most bytes of received buffers (``all_to_all_single``'s results: ppermute, all_to_all) alive at once,
    compiled graphs included (they run under the mode, as under ``shardings.comms()``): what a step keeps of what it
    received, e.g. ring attention's K/V blocks saved from forward for backward."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def _free(self, size: int) -> None:
        self.live -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops._c10d_functional.all_to_all_single.default:
            storage = out.untyped_storage()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, storage.nbytes())
        return out


def _counted_steps(layout: str, mesh: Mesh, steps: int, model: Any = gpt, cfg: Any = CFG) -> dict:
    """After each of ``steps`` compiled steps: (graphs compiled so far, graph breaks so far), the collectives it
    counted beside the eager step's (``count_comms``, on by default), the most received bytes each held at once
    (:class:`_Received`), and its loss beside an eager twin's; then the error a shorter batch raises."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    params = shardings.init(model.init, core.random.key(0), cfg, axes=model.axes(cfg), layout=layout, mesh=mesh)
    make = functools.partial(shardings.train_step, model.stages(cfg), core.optim.adamw(1e-3), layout=layout, mesh=mesh,
                             accum_steps=2, clip_norm=0.5)
    step, eager = make(jit=True, jit_backend="aot_eager"), make()
    batch, out = model.example_batch(cfg, 8), {"counts": [], "comms": [], "received": [], "losses": []}
    out["cache"] = (torch.distributed.get_rank(), step.compiled.cache, inductor_cache_dir())  # where inductor writes
    compiled, twin = (params, step.init(params)), (params, eager.init(params))
    for _ in range(steps):
        with _Received() as held:
            *compiled, metrics = step(*compiled, batch)
        with _Received() as eager_held:
            *twin, want = eager(*twin, batch)
        out["counts"].append((counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())))
        out["comms"].append((metrics["comm"], want["comm"]))
        out["received"].append((held.peak, eager_held.peak))
        out["losses"].append((metrics["loss"], want["loss"]))
    try:
        step(*compiled, model.example_batch(dataclasses.replace(cfg, seq_len=16), 8))
        out["error"] = "no error"
    except ShardingError as e:
        out["error"] = str(e)
    return out


def _counts_and_errors() -> dict:
    out = {layout: _counted_steps(layout, mesh, WARMUP_STEPS + 1)  # the last one under fail_on_recompile
           for layout, mesh in (("dp", Mesh(dp=2)), ("zero3", Mesh(dp=2)), ("tp+sp", Mesh(tp=2)), ("cp", Mesh(cp=2)))}
    out["ep"] = _counted_steps("ep", Mesh(ep=2), WARMUP_STEPS + 1, moe, MOE)
    # a layout that falls back: offload on the DTensor path
    mesh, layout = Mesh(tp=2), "tp+offload_optimizer"
    params = shardings.init(gpt.init, core.random.key(0), CFG, axes=gpt.axes(CFG), layout=layout, mesh=mesh)
    step = shardings.train_step(gpt.stages(CFG), core.optim.adamw(1e-3), layout=layout, mesh=mesh, jit=True,
                                count_comms=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = step.init(params)
        for _ in range(2):
            params, state, metrics = step(params, state, gpt.example_batch(CFG, 8))
    out["fallback"] = [str(w.message) for w in caught if issubclass(w.category, CompileFallbackWarning)]
    out["fallback_loss"] = metrics["loss"]
    return out


def test_one_graph_per_block_no_recompiles_a_shape_change_error_and_the_fallback_warning():
    ranks = launch(_counts_and_errors, 2)
    got = ranks[0]
    for layout in ("dp", "zero3", "tp+sp", "cp", "ep"):
        run = got[layout]
        # every block shares one graph (embedding and head stay eager, as torchtitan's); none breaks, none is added.
        # ep's model has two kinds of block (dense, MoE): one graph each
        graphs = 2 if layout == "ep" else 1
        assert run["counts"] == [(graphs, 0)] * len(run["counts"]), (layout, run["counts"])
        error = run["error"]
        assert "['tokens']" in error and "(8, 32)" in error and "(8, 16)" in error and "Fix:" in error, error
        # metrics["comm"] equals the eager step's because the programs run the same collectives: the local path's
        # run eagerly around the graphs, the DTensor path's tp/sp/cp/ep ones inside them, counted as the graphs run
        # (comms() ignores compile internals; a ppermute is one by its op, as eager's recorded_as says:
        # accounting._all_to_all). cp included: ring attention's backward re-sends K/V with dK/dV in one message, so
        # the compiled step neither merges that re-send with forward's nor saves what forward received
        # (shardings/ops/ring_attention.py, _pack)
        for jit, eager in run["comms"]:
            assert jit == eager, (layout, jit, eager)
        # and it holds no more of what it received at once than eager does (under cp with K/V sent alone in
        # backward: 96 KiB against eager's 64, the received blocks kept from forward for backward)
        # Asserted on cp, the family whose saved blocks were at stake: under ep the dispatch and combine buffers'
        # lifetimes vary step to step on either side (a fresh clone measured 40 then 80 KiB compiled, 40 then 80
        # eager, in opposite steps), so there the per-step order is no property of the program
        received = run["received"]
        if layout == "cp":
            assert all(jit <= eager for jit, eager in received), (layout, received)
        if layout in ("cp", "ep"):  # ring sends, expert dispatch: the measure sees them
            assert all(eager > 0 for _, eager in received), (layout, received)
        jit_losses, eager_losses = (torch.tensor(x) for x in zip(*run["losses"], strict=True))
        assert_close(jit_losses, eager_losses, terms=8 * CFG.seq_len, msg=f"{layout}: jit vs eager losses")
    # each rank's step points inductor (TORCHINDUCTOR_CACHE_DIR, read at each compile) at a directory of that rank
    # and mesh alone, no rank at another's: inductor's FX graph / AOTAutograd cache keys omit the rank a traced
    # DTensor graph bakes in (a Shard's offset), so on a shared warm cache one rank would load another's code
    # (shardings.step.compiled.rank_compile_cache). Checked directly, beside
    # the zoo's warm run (which sees it only while inductor's caches are hit, docs/performance.md)
    for layout in ("dp", "cp"):
        where = [r[layout]["cache"] for r in ranks]
        for rank, cache, inductor_dir in where:
            mesh = "Mesh_dp_2" if layout == "dp" else "Mesh_cp_2"
            assert cache == inductor_dir and inductor_dir.endswith(f"/{RANK_CACHES}/{mesh}/rank{rank}"), where
        assert where[0][2] != where[1][2], where
    # a layout that does not compile runs eagerly, said once with the warning's class, and still trains
    assert len(got["fallback"]) == 1 and "runs eagerly" in got["fallback"][0], got["fallback"]
    assert 0 < got["fallback_loss"] < 10


def test_jit_under_simulated_ranks_is_a_clear_error():
    mesh = Mesh(dp=2)
    with shardings.simulate(2):
        params = shardings.init(gpt.init, core.random.key(0), CFG, axes=gpt.axes(CFG), layout="dp", mesh=mesh)
        step = shardings.train_step(functools.partial(gpt.loss, cfg=CFG), core.optim.adamw(1e-3), layout="dp",
                                    mesh=mesh, jit=True)
        with pytest.raises(ShardingError, match=r"compile needs real ranks.*Fix: .*shardings.launch"):
            step(params, step.init(params), gpt.example_batch(CFG, 4))



def test_a_recompile_after_the_warm_up_steps_is_a_sharding_error():
    # one process, no collectives: the guard itself. A dtype change passes the shape check and recompiles.
    from shardings.step.compiled import Compiled

    compiled = Compiled(lambda params, batch: (params["w"] * batch["x"]).sum(), "aot_eager", Mesh(dp=1))
    params = {"w": torch.ones(3, dtype=torch.float64)}
    for _ in range(WARMUP_STEPS):
        with compiled.running({"x": torch.ones(3)}):
            assert compiled.loss_fn(params, {"x": torch.ones(3)}).item() == 3.0
    with pytest.raises(ShardingError, match=r"(?s)recompiled at step 2.*dtype mismatch.*Fix: keep every input"), \
            compiled.running({"x": torch.ones(3)}):
        compiled.loss_fn(params, {"x": torch.ones(3, dtype=torch.float64)})


@pytest.mark.parametrize(("stages", "graphs"), [(True, 1), (False, 1)])
def test_the_step_counts_the_graphs_it_compiled(stages, graphs):
    # one process, no collectives: a 2-block Stages compiles one block graph for both blocks (its backward with it),
    # a loss without blocks one graph; warm steps compile none (what the run's "compiling ..." line reports)
    from shardings.step.compiled import Compiled

    torch._dynamo.reset()
    loss = gpt.stages(CFG) if stages else functools.partial(gpt.loss, cfg=CFG)
    compiled = Compiled(loss, "aot_eager", Mesh(dp=1))
    params = gpt.init(core.random.key(0), CFG)
    leaves = [x.requires_grad_() for x in core.tree.leaves(params)]
    batch = gpt.example_batch(CFG, 2)
    for _ in range(WARMUP_STEPS + 1):
        with compiled.running(batch):
            grads = torch.autograd.grad(compiled.loss_fn(params, batch), leaves)
    assert compiled.graphs == graphs and all(g is not None for g in grads)
