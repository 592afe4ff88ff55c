"""experiments.bench.terapipe on a tiny model: a row per k with each rank's measured idle fraction beside the plan's
bubble (p-1)/(m·k+p-1), the chunk sizes the rule chose, and Gantt charts that name the chunks (no timings)."""

import pytest

from experiments.bench import terapipe

PP = terapipe.PP


@pytest.mark.multiprocess
def test_a_row_per_chunk_count_with_the_planned_bubble_and_charts(tmp_path, monkeypatch):
    monkeypatch.setattr(terapipe, "CONFIG", dict(vocab=64, dim=32, layers=4, heads=4, kv_heads=2, mlp=64))
    rows = terapipe.measure([1, 2, 4], m=2, rows=2, seq=16, steps=1, schedule="1f1b", rule="equal", gantt=tmp_path)
    assert [r["k"] for r in rows] == [1, 2, 4]
    for r in rows:
        fractions = [r[f"rank{q}"] for q in range(PP)]
        assert all(0 < f < 1 for f in fractions)
        assert r["planned"] == round((PP - 1) / (2 * r["k"] + PP - 1), 3)
        assert r["sizes"] == "/".join([str(16 // r["k"])] * r["k"])
        assert r["stage0_chunks_held"] == min(PP + r["k"] - 1, 2 * r["k"])  # 1F1B's k - 1 more warm-up chunks
        assert (tmp_path / f"terapipe_1f1b_k{r['k']}_measured.png").stat().st_size > 0
