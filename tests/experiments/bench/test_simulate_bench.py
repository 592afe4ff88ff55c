"""``python -m experiments.bench.simulate`` at its smallest setting prints its table with the documented columns, and
the check it times passes (4 simulated ranks: dp1 × pp2 × tp2); the train comparison's row is its ratio."""

from experiments.bench import simulate


def test_smallest_setting_prints_the_table(capsys):
    simulate.main(["--worlds", "4", "--no-train"])
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("| world"))
    assert [c.strip() for c in header.strip("|").split("|")] == ["world", "mesh", "seconds", "cpu_seconds", "equal"]
    row = [c.strip() for c in lines[lines.index(header) + 2].strip("|").split("|")]
    assert row[0] == "4" and row[1] == "dp1 x pp2 x tp2" and row[4] == "yes"
    assert float(row[2]) > 0 and float(row[3]) > 0


def test_train_row_is_the_ratio(monkeypatch):
    measured = {"simulate": 30.0, "multiprocess": 120.0}
    monkeypatch.setattr(simulate, "_tokens_per_s", lambda runtime, steps: measured[runtime])
    assert simulate.train_row(2) == {"simulated_tok_s": 30.0, "real_tok_s": 120.0, "ratio": 0.25}
