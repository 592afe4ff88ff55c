"""One drill: a fault struck into a job on real gloo ranks, the job restarted, and both held against a run that
never stopped.

The uninterrupted run of a family is made once (:func:`reference`) and shared by all of its drills. A drill
(:func:`run_drill`) starts the same job with a fault planted and waits for it to fail: from outside, a watcher
thread SIGKILLs or SIGSTOPs one rank a random delay after the job logged a given step; from inside
(:mod:`.faults`), a ``checkpoint.save`` hook SIGKILLs a rank or raises a disk error at a commit moment, one
step's loss turns NaN, or a rank SIGKILLs itself inside a step (in forward, in backward, or in the optimizer
update). The job's error must
name what struck (the rank, or the step and leaf). Then the job is restarted in the same folder
(``sigkill_resize``: on half the ranks), resumes from its newest checkpoint that verifies, and must end with the
reference's loss at every step and its final checkpoint's tensors, bitwise (within the tolerance rule on another
world size). Under fp16 a NaN batch must instead be skipped and counted.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch
from hydra import compose, initialize

import shardings
from experiments.config import app_overrides, own_model, register
from experiments.drill.families import JOB, Family
from experiments.drill.faults import DISK_ERRORS, IN_MODEL, IN_OPTIMIZER, IN_SAVE, STRUCK, mark_struck
from experiments.train import run
from shardings import checkpoint
from shardings.testing import assert_close

__all__ = ["EXTERNAL", "RESIZE", "Drill", "Result", "pick", "reference", "run_drill"]

# Faults the watcher sends from outside, once a step is logged; SIGSTOP hangs the rank (its peers must time out
# naming it: shardings.runtime.watchdog).
EXTERNAL = {"sigkill": signal.SIGKILL, "sigstop": signal.SIGSTOP, "sigkill_resize": signal.SIGKILL}
RESIZE = ("sigkill_resize",)  # restarted on half the ranks (the family's `smaller`): a resharded resume
_STEPS = 6  # families.JOB's steps
_WAIT_S = 120.0  # a faulted job still running this long after its fault: hung (runtime.timeout_s is 20)


@dataclasses.dataclass(frozen=True)
class Drill:
    """A fault in a family's job: which, on which rank, and when (after step ``step`` is logged, plus
    ``delay_ms``; an in-save fault strikes the save of step ``step``)."""

    family: Family
    fault: str
    rank: int
    step: int
    delay_ms: int = 0

    @property
    def when(self) -> str:
        if self.fault in IN_SAVE:
            return f"save of step {self.step} ({'files written' if self.fault != 'save_manifest' else 'manifest'})"
        if self.fault == "nan_batch":
            return f"step {self.step}'s batch"
        if self.fault in IN_MODEL + IN_OPTIMIZER:  # a kill inside the step (a model's: in its first microbatch)
            return f"inside step {self.step}, in {self.fault.removeprefix('kill_')}"
        return f"{self.delay_ms} ms after step {self.step} was logged"


@dataclasses.dataclass
class Result:
    """A drill's row of the table."""

    fault: str
    layout: str
    rank: int
    when: str
    exit_s: float | None  # from the fault until every rank had exited (the launcher raised)
    error: str  # the first line of the job's error (the launcher names the first rank that failed and why)
    resumed_from: int | None
    steps_lost: int | None  # steps logged before the fault that the restart had to run again
    equal: str  # "bitwise" | "differs: ..." | "-" (no restart)
    ok: bool
    problem: str = ""  # why not ok

    def row(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _compose(overrides: list[str]) -> Any:
    register()
    overrides = app_overrides(overrides)
    with initialize(version_base="1.3", config_path=None):
        return own_model(compose("train", overrides=overrides), overrides)


def _job(family: Family, drill_dir: str, fault: str = "none", rank: int = 0, step: int = 0,
         smaller: bool = False) -> Any:
    fields = [f"model.config.drill_dir={drill_dir}", f"model.config.fault={fault}", f"model.config.fault_rank={rank}",
              f"model.config.fault_step={step}", f"model.config.fault_calls={family.calls}"]
    instead = {o.split("=")[0]: o for o in family.smaller} if smaller else {}
    overrides = [instead.get(o.split("=")[0], o) for o in family.overrides]
    # The restart (fault=none) resumes what a faulted run saved: only the fault's own model fields differ.
    accept = ["checkpoint.allow_changes=true"] if fault == "none" else []
    return _compose([*overrides, *JOB, *fields, *accept])


def _losses(out: Path) -> dict[int, float]:
    file = out / "metrics.jsonl"
    lines = file.read_text().splitlines() if file.exists() else []
    return {r["step"]: r["loss"] for r in map(json.loads, filter(None, lines))}


def _final_state(out: Path) -> dict[str, Any]:
    saved, _ = checkpoint.load(out / "checkpoints" / f"step_{_STEPS}")
    return saved


def reference(family: Family, root: Path) -> Path:
    """The family's uninterrupted run (made once under ``root``)."""
    out = root / "reference" / family.name.replace(" ", "_")
    if not (out / "checkpoints" / f"step_{_STEPS}").is_dir():
        shutil.rmtree(out, ignore_errors=True)
        (out / "drill").mkdir(parents=True)
        run(_job(family, str(out / "drill")), str(out))
    return out


def _watch(drill: Drill, out: Path, drill_dir: Path, stop: threading.Event) -> None:
    """Send the external fault once step ``drill.step`` is logged and ``delay_ms`` has passed."""
    pid_file = drill_dir / f"pid_rank{drill.rank}"
    while not stop.is_set():
        if len(_losses(out)) >= drill.step and pid_file.exists():
            time.sleep(drill.delay_ms / 1000)
            mark_struck(str(drill_dir), f"{drill.fault} rank {drill.rank}")
            try:
                os.kill(int(pid_file.read_text()), EXTERNAL[drill.fault])
            except ProcessLookupError:  # the job ended first: nothing struck
                (drill_dir / STRUCK).unlink()
            return
        stop.wait(0.005)


def _close(a: Any, b: Any) -> bool:
    try:
        assert_close(torch.as_tensor(a), torch.as_tensor(b))
    except AssertionError:
        return False
    return True


def _compare(got: Path, want: Path, resharded: bool = False) -> str:
    """``bitwise``: losses and final tensors; on another world size (other reductions) ``within tolerance``: the losses
    by ``shardings.testing``'s rule."""
    same = _close if resharded else lambda a, b: a == b
    lw, lg = _losses(want), _losses(got)
    bad = [s for s in lw if s not in lg or not same(lg[s], lw[s])]
    if bad:
        return f"differs: losses at steps {bad}"
    if resharded:  # the losses, as tests/experiments/test_resume.py does: after Adam steps on other reductions the
        return "within tolerance"  # params drift past the rule's ulps (zero3+tp -> zero3: max 5e-7 on values ~0.09)
    a, b = _final_state(got), _final_state(want)
    bad = [k for k in b if isinstance(b[k], torch.Tensor) and not torch.equal(a[k], b[k])]
    return f"differs: {len(bad)} tensors, first {bad[0]}" if bad else "bitwise"


def _must_name(drill: Drill) -> str:
    """What the job's error must say: the rank that was struck, or the step and the leaf of a NaN batch."""
    if drill.fault == "sigstop":
        return f"rank {drill.rank} (silent"  # a peer timed out and the watchdog named the silent rank
    if drill.fault == "nan_batch":
        return f"at step {drill.step}: the gradient of"
    if drill.fault in DISK_ERRORS:
        return f"rank {drill.rank} of {drill.family.world} raised CheckpointError: saving step_{drill.step}"
    return f"rank {drill.rank} of {drill.family.world}"


def _records(out: Path) -> dict[int, dict[str, Any]]:
    return {r["step"]: r for r in map(json.loads, filter(None, (out / "metrics.jsonl").read_text().splitlines()))}


def _skipped(drill: Drill, out: Path, result: Result) -> Result:
    """fp16's NaN batch: the job must run on, the loss scale skipping the step and counting it."""
    records = _records(out)
    at, before = records[drill.step], records.get(drill.step - 1, {"skipped_steps": 0, "loss_scale": None})
    result.error = f"none: step skipped (skipped_steps {at['skipped_steps']}, loss_scale {at['loss_scale']})"
    result.ok = at["skipped_steps"] == before["skipped_steps"] + 1
    result.problem = "" if result.ok else f"step {drill.step} was not counted as skipped: {at}"
    return result


def run_drill(drill: Drill, root: Path, name: str) -> Result:
    """Strike ``drill``'s fault into its job under ``root/name``, restart it, and compare with the reference."""
    family, out = drill.family, root / name
    want = reference(family, root)
    shutil.rmtree(out, ignore_errors=True)
    drill_dir = out / "drill"
    drill_dir.mkdir(parents=True)
    result = Result(drill.fault, family.name, drill.rank, drill.when, None, "", None, None, "-", False)
    stop = threading.Event()
    if drill.fault in EXTERNAL:
        threading.Thread(target=_watch, args=(drill, out, drill_dir, stop), daemon=True).start()
    inside = drill.fault if drill.fault not in EXTERNAL else "none"
    try:
        run(_job(family, str(drill_dir), inside, drill.rank, drill.step), str(out))
        error = None
    except shardings.LaunchError as e:
        error = e
    ended = time.time()
    stop.set()
    struck = drill_dir / STRUCK
    if error is None and struck.exists() and drill.fault == "nan_batch" and family.loss_scale:
        return _skipped(drill, out, result)
    result.error = str(error).splitlines()[0] if error else ""
    if error is None or not struck.exists():
        result.problem = "the job ended without the fault striking" if error is None else "it failed, unstruck"
        return result
    result.exit_s = round(ended - float(struck.read_text().split()[0]), 2)
    logged = max(_losses(out), default=0)
    struck_save = out / "checkpoints" / f"step_{drill.step}"
    taken = drill.fault in IN_SAVE and checkpoint.latest(out / "checkpoints") == str(struck_save)
    resize = drill.fault in RESIZE
    summary = run(_job(family, str(drill_dir), smaller=resize), str(out))  # the restart: no fault
    result.resumed_from = summary["resumed_from"]
    result.steps_lost = logged - result.resumed_from
    result.equal = _compare(out, want, resharded=resize)
    problems = [f"the save of step {drill.step}, killed mid-way, was taken for a complete checkpoint" if taken else "",
                "resumed unequal" if result.equal.startswith("differs") else "",
                "" if _must_name(drill) in result.error else f"the error does not say {_must_name(drill)!r}",
                "the job hung past its timeout" if result.exit_s > _WAIT_S else ""]
    result.problem = "; ".join(p for p in problems if p)
    result.ok = not result.problem
    return result


def pick(family: Family, fault: str, rng: random.Random) -> Drill:
    """A drill of ``fault`` on ``family`` at a random rank and moment."""
    if fault in IN_SAVE:
        return Drill(family, fault, 0 if fault == "save_manifest" else rng.randrange(family.world),
                     rng.choice(range(2, _STEPS + 1, 2)))
    if fault in IN_MODEL:  # pipelines: a rank of the first stage (pp is the mesh's minor axis: even ranks)
        ranks = range(0, family.world, 2 if family.calls > 1 else 1)
        return Drill(family, fault, rng.choice(ranks), rng.randrange(2, _STEPS + 1))
    if fault in IN_OPTIMIZER:  # every rank updates its own shard
        return Drill(family, fault, rng.randrange(family.world), rng.randrange(2, _STEPS + 1))
    return Drill(family, fault, rng.randrange(family.world), rng.randrange(1, _STEPS), rng.randrange(0, 200))
