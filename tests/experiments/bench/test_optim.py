"""experiments.bench.optim: every variant runs and is timed against torch's foreach AdamW (a smoke test)."""

from experiments.bench import optim as bench_optim


def test_every_variant_gets_a_row_with_its_ratio():
    rows = bench_optim.run("narrow", repeats=1)
    assert [r["variant"] for r in rows] == ["per_leaf", "foreach", "fused_step", "torch_foreach", "torch_for_loop",
                                            "torch_fused"]
    assert all(r["ms"] > 0 and r["leaves"] == 147 for r in rows)
    assert next(r for r in rows if r["variant"] == "torch_foreach")["vs_torch_foreach"] == 1.0
