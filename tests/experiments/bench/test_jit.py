"""experiments.bench.jit: the jitted step is one graph and follows eager; the native rows run on the same loss.

The compiled rows compile with ``--jit-backend aot_eager``: the same dynamo graphs (what the graph counts check) and
AOTAutograd's forward/backward split, without inductor's C++ code generation, which took most of these tests' time
(the three compiling tests: 270 s under inductor, 56 s under aot_eager, on the shared 2-core machine at load ~9).
Nothing checked here depends on inductor's kernels; that inductor is what the bench runs unless told otherwise is
checked without compiling (:func:`test_the_cli_compiles_with_inductor_unless_told`).
"""

import pytest
import torch
from torch._dynamo.utils import counters

import core
import models.gpt as gpt
import shardings
from core import optim
from experiments.bench import jit as bench_jit
from experiments.bench import jit_sharded as bench_jit_sharded
from experiments.bench import rows
from shardings.testing import assert_close

CFG = gpt.Config(vocab=64, dim=32, layers=1, heads=4, mlp=64, seq_len=16)
QUICK = "aot_eager"  # the tests' compile backend (module docstring)


def _inductor_events() -> int:
    """How many times inductor has compiled (or looked up) a graph in this process: unchanged under aot_eager."""
    return sum(counters["inductor"].values())


# torch 2.11's dynamo cannot trace Tensor.requires_grad_() (core.transforms' grad): the step compiles as 7-10
# graphs there, so "one graph" is a claim about torch >= 2.13 (measured with make test-torch211).
whole_graph = pytest.mark.skipif(torch.__version__ < (2, 13), reason="torch < 2.13 compiles core.jit's step as "
                                 "several graphs (it cannot trace Tensor.requires_grad_()); needs torch >= 2.13")


@whole_graph
def test_jitted_step_is_one_graph_and_matches_eager_for_two_steps():
    """Compared by the project's rule (``shardings.testing.assert_close``) with the step's reduction length, the
    batch's 64 tokens, not bitwise: AOTAutograd's decompositions (and inductor's fusions, in the bench) may round
    differently from eager; a wrong graph (a missed grad, a stale update) is off by ~lr = 1e-2.
    """
    opt = optim.adamw(1e-2, weight_decay=0.1)
    step = bench_jit.make_step(CFG, opt)
    params = gpt.init(core.random.key(0), CFG)
    eager = jitted = (params, opt.init(params))
    compiled = core.jit(step, backend=QUICK)
    torch._dynamo.reset()
    graphs, inductor = counters["stats"]["unique_graphs"], _inductor_events()
    for seed in range(2):
        batch = gpt.example_batch(CFG, 4, seed=seed)
        *eager, eager_loss = step(*eager, batch)
        with bench_jit.whole_step_tracing():
            *jitted, jitted_loss = compiled(*jitted, batch)
        assert_close(jitted_loss, eager_loss, terms=64)
    assert counters["stats"]["unique_graphs"] - graphs == 1  # forward, backward and update: no break, no recompile
    assert _inductor_events() == inductor  # compiled by the backend asked for
    assert_close(jitted, eager, terms=64)  # structure and every leaf
    assert not torch.equal(jitted[0]["embed"], params["embed"])  # the step did update


def test_whole_step_tracing_refuses_an_active_mesh():
    refused = pytest.raises(RuntimeError, match="mesh is active")
    with shardings.simulate(2), shardings.use(shardings.Mesh(dp=2)), refused, bench_jit.whole_step_tracing():
        pass
    assert not hasattr(shardings.current, "_dynamo_marked_constant")


MICRO = rows._Config(dict(vocab=64, dim=32, layers=1, heads=4, kv_heads=2, mlp=64, seq_len=16), 4)


def _check_rows(rows, names):
    """The rows of one run: the named variants, one loss by the tolerance rule, ratios of this run's step times."""
    by = {r["variant"]: r for r in rows}
    assert list(by) == names
    tokens = MICRO.batch * MICRO.model["seq_len"]
    for r in rows:  # the bench raises past the rule; the rounded values still agree by it
        assert_close(torch.tensor(r["loss"]), torch.tensor(by["eager"]["loss"]), terms=tokens)
        assert r["step_ms"] > 0
        for col, ref in (("vs_native", "native"), ("vs_compiled", "native_compile")):
            if ref in by:  # step_ms and the ratio are rounded separately
                assert r[col] == pytest.approx(r["step_ms"] / by[ref]["step_ms"], rel=0.05, abs=2e-3)
            else:
                assert r[col] == ""
    assert by["native"]["vs_native"] == 1.0
    return by


def test_native_rows_run_beside_shardlabs_with_the_same_loss(monkeypatch, tmp_path):
    monkeypatch.setitem(bench_jit.CONFIGS, "micro", MICRO)
    out = tmp_path / "bench_jit.csv"
    argv = ["--configs", "micro", "--steps", "2", "--warmup", "1", "--rounds", "2", "--no-compile", "--csv", str(out)]
    rows = bench_jit.main(argv)
    _check_rows(rows, ["eager", "native"])
    assert all(r["rounds"] == 2 for r in rows)
    assert out.read_text().splitlines()[0].startswith("config,device,variant")


def test_a_native_row_computing_another_loss_is_refused(monkeypatch):
    forward = bench_jit.native_gpt.NativeGpt.forward
    monkeypatch.setitem(bench_jit.CONFIGS, "micro", MICRO)
    monkeypatch.setattr(bench_jit.native_gpt.NativeGpt, "forward", lambda self, batch: forward(self, batch) * 1.001)
    with pytest.raises(RuntimeError, match="step-1 loss of native"):
        bench_jit.run("micro", "cpu", steps=1, warmup=1, peak_tflops=1.0, compile=False)


@whole_graph
def test_compiled_rows_native_and_shardlab_share_the_loss_and_ratios(monkeypatch):
    """torch.compile of the native model and core.jit of shardlab's step, in the same run as the eager rows."""
    monkeypatch.setitem(bench_jit.CONFIGS, "micro", MICRO)
    inductor = _inductor_events()
    rows = bench_jit.run("micro", "cpu", steps=2, warmup=1, peak_tflops=1.0, jit_backend=QUICK)
    assert _inductor_events() == inductor  # neither core.jit nor torch.compile of the native model used inductor
    by = _check_rows(rows, ["eager", "native", "jit", "native_compile"])
    assert by["jit"]["graphs"] == 1 and by["native_compile"]["graphs"] >= 1
    assert by["native_compile"]["vs_compiled"] == 1.0
    assert [r["jit_backend"] for r in rows] == ["", "", QUICK, QUICK]


class _Parsed(Exception):
    """Raised by a stand-in ``run``: the CLI got as far as handing its options to the rows."""


def test_the_cli_compiles_with_inductor_unless_told(monkeypatch):
    """What the benchmark measures by default, checked without compiling: the ``--jit-backend`` both ``run``
    functions receive (the single-device rows', and the sharded rows' that hands it to the launched worker)."""
    seen = []

    def rows(config, **options):
        seen.append(("rows", options["jit_backend"]))
        return []

    def sharded(config, **options):
        seen.append(("sharded", options["jit_backend"]))
        raise _Parsed

    monkeypatch.setattr(bench_jit, "run", rows)
    monkeypatch.setattr(bench_jit_sharded, "run", sharded)
    for told in ([], ["--jit-backend", QUICK]):
        with pytest.raises(_Parsed):
            bench_jit.main(["--configs", "tiny", "--sharded", "zero3", *told])
    assert seen == [("rows", "inductor"), ("sharded", "inductor"), ("rows", QUICK), ("sharded", QUICK)]


@pytest.mark.multiprocess
def test_sharded_rows_one_rank_against_fsdp2_share_the_loss(monkeypatch, tmp_path):
    """--sharded: train_step on one rank (eager, jit=True) and FSDP2 (eager, compiled blocks), one step-1 loss."""
    monkeypatch.setitem(bench_jit.CONFIGS, "micro", MICRO)
    argv = ["--configs", "micro", "--steps", "2", "--warmup", "2", "--no-compile", "--csv", str(tmp_path / "b.csv")]
    rows = bench_jit_sharded.run("micro", ["zero3", "zero3+tp+sp"], "cpu", steps=2, warmup=2, peak_tflops=1.0,
                                 jit_backend=QUICK)
    by = {r["variant"]: r for r in rows}
    assert list(by) == ["train_step/zero3", "train_step/zero3/jit", "train_step/zero3+tp+sp",
                        "train_step/zero3+tp+sp/jit", "fsdp2", "fsdp2/compiled_blocks"]
    tokens = MICRO.batch * MICRO.model["seq_len"]
    for r in rows:  # run() raised past the rule (fp32 on the CPU: rtol 1e-4); the rounded values agree by it too
        assert_close(torch.tensor(r["loss"]), torch.tensor(by["fsdp2"]["loss"]), terms=tokens)
    assert by["fsdp2"]["vs_native"] == 1.0 and by["fsdp2/compiled_blocks"]["vs_compiled"] == 1.0
    assert by["train_step/zero3/jit"]["graphs"] >= 1 and by["train_step/zero3"]["graphs"] == 0
    assert {r["variant"]: r["jit_backend"] for r in rows if r["jit_backend"]} == {
        "train_step/zero3/jit": QUICK, "train_step/zero3+tp+sp/jit": QUICK, "fsdp2/compiled_blocks": QUICK}
    rows = bench_jit.main([*argv, "--sharded", "zero3"])  # the CLI: the single-device rows, then the sharded ones
    assert [r["variant"] for r in rows] == ["eager", "native", "train_step/zero3", "fsdp2"]
