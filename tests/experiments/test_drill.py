"""``experiments.drill``: the matrix and its table, fp16's loss-scale state across a resume, and a reduced matrix
of real drills, one fault or more per layout family (a reference per family, then two launches each: faulted,
restart).

The full matrix (``make drill``, >= 50 drills) is not run here: it takes many minutes of real processes.
"""

from __future__ import annotations

import json
import random
import shutil

import pytest

from experiments.drill.__main__ import FAULTS, matrix
from experiments.drill.families import FAMILIES
from experiments.drill.harness import Drill, Result, run_drill
from experiments.drill.table import COLUMNS, markdown, write
from experiments.train import run
from shardings import checkpoint
from tests.experiments.conftest import compose_config

FP16_JOB = ["model=mlp", "model.name=experiments.drill.mlp", "model.config.dim=16", "model.config.mlp=32",
            "layout=zero2", "mesh=dp2", "precision=fp16", "runtime=simulate", "steps=4", "checkpoint.every=2",
            "data.max_bytes=200000", "data.batch_size=4", "progress=false", "optim.warmup_steps=0"]


def test_the_full_matrix_has_at_least_50_drills_over_every_family_and_fault():
    drills = matrix(quick=False, seed=0, families=list(FAMILIES), faults=list(FAULTS))
    assert len(drills) >= 50
    assert {d.family.name for d in drills} == set(FAMILIES) and {d.fault for d in drills} == set(FAULTS)
    quick = matrix(quick=True, seed=0, families=list(FAMILIES), faults=list(FAULTS))
    assert [d.family.name for d in quick] == list(FAMILIES)  # one per family


def test_the_table_has_every_column_and_flags_a_failed_drill(tmp_path):
    ok = Result("sigkill", "zero3+tp", 1, "12 ms after step 3 was logged", 0.6, "rank 1 of 4 failed", 2, 1,
                "bitwise", True)
    bad = Result("nan_batch", "dp+pp 1f1b", 0, "step 2's batch", 1.1, "a | b", 0, 1, "differs: losses at steps [3]",
                 False, "resumed unequal")
    csv_file, md_file = write([ok, bad], tmp_path)
    lines = md_file.read_text().splitlines()
    assert lines[0] == "| " + " | ".join(COLUMNS) + " |" and len(lines) == 4 and "a \\| b" in lines[3]
    assert "resumed unequal" in csv_file.read_text().splitlines()[2]
    assert markdown([ok]).splitlines()[2].endswith("| bitwise | True |")


def _records(out) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def test_fp16_skips_a_nan_batch_and_its_loss_scale_survives_a_resume(tmp_path):
    ref, resumed = tmp_path / "uninterrupted", tmp_path / "resumed"
    run(compose_config("train", [*FP16_JOB, f"model.config.drill_dir={tmp_path}", "model.config.fault=nan_batch",
                                 "model.config.fault_step=2"]), str(ref))
    steps = _records(ref)
    assert [steps[s]["skipped_steps"] for s in (1, 2, 3, 4)] == [0, 1, 1, 1]  # step 2's NaN batch: skipped
    assert steps[2]["loss_scale"] == steps[1]["loss_scale"] / 2  # and the scale halved
    saved, _ = checkpoint.load(ref / "checkpoints" / "step_2")
    assert saved["['opt_state'].loss_scale.skipped"] == 1

    shutil.copytree(ref / "checkpoints" / "step_2", resumed / "checkpoints" / "step_2")
    (resumed / "drill").mkdir()
    run(compose_config("train", [*FP16_JOB, f"model.config.drill_dir={resumed / 'drill'}", "model.config.fault=none",
                                 "model.config.fault_step=0",  # the same fields: the same key paths
                                 "checkpoint.allow_changes=true"]), str(resumed))  # only the fault's fields differ
    got = _records(resumed)
    for s in (3, 4):  # the scale and the skip counter came back from the checkpoint, not from their defaults
        assert (got[s]["loss"], got[s]["loss_scale"], got[s]["skipped_steps"]) == (
            steps[s]["loss"], steps[s]["loss_scale"], steps[s]["skipped_steps"])


@pytest.fixture(scope="module")
def drills_root(tmp_path_factory):
    return tmp_path_factory.mktemp("drills")  # a family's uninterrupted run is made once, for all its drills here


@pytest.mark.multiprocess
@pytest.mark.parametrize(("family", "fault", "rank", "step"), [  # one fault (or more) per family
    ("zero3+tp", "sigkill_resize", 1, 3),  # killed between steps, restarted on 2 ranks as zero3: a resharded resume
    ("dp+pp 1f1b", "save_written", 3, 4),  # pipeline ranks each write their own stage: the save killed on one
    ("dp+pp 1f1b", "kill_backward", 0, 3),  # inside a step: the first stage's backward, just after its recv
    ("zero3+pp zb_v", "kill_optimizer", 3, 4),  # inside a step: the optimizer update of a last-stage rank's shard
    ("zero2+offload fp16", "nan_batch", 1, 3),  # the loss scale skips the step and counts it: no restart
    ("dp+ep moe", "sigstop", 2, 2),  # a hang in a wait without deadline: the watchdog names rank 2 and ends it
])  # (a NaN batch without a loss scale: tests/shardings/step/test_finite.py; a SIGKILL: test_resume.py)
def test_a_reduced_drill_matrix_loses_nothing(drills_root, family, fault, rank, step):
    result = run_drill(Drill(FAMILIES[family], fault, rank, step, delay_ms=random.Random(0).randrange(50)),
                       drills_root, f"{family}_{fault}".replace(" ", "_"))
    assert result.ok, result.row()
    if fault == "nan_batch":  # skipped, counted, and the job ran on
        assert result.error.startswith("none: step skipped (skipped_steps 1")
        return
    resized = fault == "sigkill_resize"
    assert result.equal == ("within tolerance" if resized else "bitwise")
    assert result.steps_lost is not None and result.exit_s is not None
