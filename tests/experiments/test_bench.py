"""experiments.bench --quick: dp vs DDP on 4 gloo ranks computes the same loss and fills the table."""

import csv

import pytest

from experiments import bench


@pytest.mark.multiprocess
def test_quick_dp_vs_ddp_same_loss_and_a_csv_row(tmp_path):
    out = tmp_path / "bench.csv"
    (row,) = bench.main(["--quick", "--pairs", "dp", "--csv", str(out)])
    assert row["pair"] == "dp vs DDP" and row["loss_ours"] == row["loss_native"]
    assert row["ours_ms"] > 0 and row["native_ms"] > 0 and row["ours_comm_bytes"] == row["native_comm_bytes"]
    (written,) = list(csv.DictReader(out.open()))
    assert written["pair"] == "dp vs DDP"
