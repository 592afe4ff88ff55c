"""``python -m experiments.train``: the Hydra training app (what ``make train`` runs).

With no arguments: ``gpt_tiny`` on the standard library's source bytes, layout ``zero3+tp`` on
``Mesh(dp=2, tp=2)``, 4 real processes (gloo). Anything else is an override::

    python -m experiments.train model=gpt_small layout=zero3+tp+sp mesh=fsdp2_tp2 steps=200
    python -m experiments.train -m layout=dp,zero3,zero3+tp+sp mesh=dp4,dp2_tp2   # a sweep
    python -m experiments.train -m precision=fp32,bf16 offload=none,optimizer        # mixed precision, offload
    torchrun --nnodes 2 --nproc-per-node 4 ... -m experiments.train runtime=torchrun mesh=dp2_fsdp2_tp2

Each run's directory (Hydra's) gets ``config.yaml`` (resolved), ``metrics.jsonl`` (one line per
step: loss, grad_norm, tokens, tokens_per_s, comm rows and bytes, memory per rank, data position; under fp16
``loss_scale`` (the scale the next step uses) and ``skipped_steps`` (so far); with ``pp``
also ``pipeline``: schedule, microbatches, planned bubble, saved-activation peaks per rank, and on real
processes the measured bubble per rank),
``summary.json`` (with the precision policy), ``layout.json`` (``shardings.describe_layout``: every parameter
group's spec per role, and a step's collectives), ``status.json`` (``{"status": "ran"}``), ``train.log`` (what the
console showed: experiments.console), TensorBoard event files (experiments.tracker) and, on failure, ``error.log``.
``python -m experiments.report <multirun dir>`` compares the runs of a sweep.
Every rank runs the loop of experiments.train_loop (``run_rank``); this module checks, launches and reports.

A layout with ``pp`` pipelines the model's blocks (its ``stages``) over the mesh axis ``pp`` (each real
process holds and runs only its own stage; ``pipeline.stage_sizes=[3,1]`` overrides the balanced split)::

    python -m experiments.train layout=dp+pp mesh=dp2_pp2 pipeline.schedule=gpipe pipeline.microbatches=4

A sweep keeps going past an impossible combination (``zero3+tp+sp`` on ``mesh=dp4``): that job is
skipped with one line, and its ``status.json`` says ``skipped`` and why. A job that fails while
running records ``failed`` and why; the sweep still runs the rest, then lists what did not run and exits 1
(``sweep.allow_skipped=true`` accepts skipped jobs: experiments.sweep).

``checkpoint.every=N`` saves the whole train state every N steps (``shardings.checkpoint``, into
``checkpoint.dir``, default ``<run dir>/checkpoints``); a job restarted with the same folder resumes
from its latest checkpoint that verifies, under any layout and mesh, and refuses to when the experiment would
change (experiments.resume). ``model.init_from=<dir>`` starts from a Hugging
Face Llama folder (``experiments.export``'s output).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

import shardings
from experiments import resume
from experiments.build import ConfigError, build, model, pretrained
from experiments.config import app_overrides, own_model, register
from experiments.console import Console, error_line
from experiments.data import mismatch
from experiments.sweep import SWEEP_SUMMARY
from experiments.train_loop import checkpoint_dir, human_bytes, run_rank

__all__ = ["app", "human_bytes", "main", "run", "run_rank"]

_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _torchrun_env() -> None:
    """Make torchrun's environment present: given by torchrun, or derived from SLURM via submitit."""
    if all(v in os.environ for v in _ENV):
        return
    if "SLURM_PROCID" in os.environ:  # a task of Hydra's submitit launcher: one process per rank
        import submitit

        submitit.helpers.TorchDistributedEnvironment().export()
        return
    raise ConfigError(
        "runtime=torchrun but this process was not started by torchrun (no RANK/WORLD_SIZE/MASTER_ADDR). "
        "Fix: start it as `torchrun --nproc-per-node N -m experiments.train runtime=torchrun`, "
        "or use runtime=multiprocess."
    )


def run(cfg: DictConfig, out_dir: str) -> dict[str, Any]:
    """Check ``cfg``, write the resolved config, and train under its runtime; return rank 0's summary.

    Raises:
        ConfigError: an impossible combination (raised before any process starts), a model the data cannot feed
            among them (``experiments.data.mismatch``).
        shardings.LaunchError: a rank failed (multiprocess / torchrun).
    """
    if cfg.runtime.kind == "torchrun":
        _torchrun_env()
    if why := mismatch(cfg.data, cfg.model.name, *model(cfg.model)):  # a model of other inputs: before any planning
        raise ConfigError(why)
    setup = build(cfg)
    cfg = setup.conf  # layout=auto: the winner build planned, once; every rank runs it
    if cfg.model.init_from:
        pretrained(cfg.model.init_from, setup)  # a mismatch fails here, before any process starts
    conf = OmegaConf.to_container(cfg, resolve=True)
    ckpt_dir = checkpoint_dir(conf, out_dir)
    if ckpt_dir:
        resume.check(ckpt_dir, conf)  # a resume that would change the experiment stops here, before any process
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    if os.environ.get("RANK", "0") == "0":
        Path(out_dir, "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    world = cfg.runtime.world_size or setup.mesh.size
    if cfg.runtime.kind == "simulate":
        with shardings.simulate(world):
            return run_rank(conf, out_dir, setup)
    with _quiet_elastic():
        return shardings.launch(run_rank, world, conf, out_dir, backend=cfg.runtime.backend,
                                timeout=cfg.runtime.timeout_s)[0]


@contextlib.contextmanager
def _quiet_elastic():
    """torch's elastic launcher logs a failed rank's whole traceback, every line prefixed, and its spawn the peers
    it terminates; the LaunchError it becomes already holds that (the app writes it to error.log, shows one line)."""
    loggers = [logging.getLogger(name) for name in ("torch.distributed.elastic", "torch.multiprocessing")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def _write_status(out_dir: str, status: str, reason: str | None = None) -> None:
    """``status.json``: ``ran``, ``skipped`` (an impossible combination) or ``failed``, and why (rank 0 only)."""
    if os.environ.get("RANK", "0") == "0":
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        Path(out_dir, "status.json").write_text(json.dumps({"status": status, "reason": reason}) + "\n")


def main() -> None:
    """``python -m experiments.train [overrides]``: register the configs, then run the Hydra app (:func:`app`)."""
    register()
    sys.argv[1:] = [*app_overrides(sys.argv[1:]), SWEEP_SUMMARY]  # any Config field without a '+'; a sweep's end
    app()


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def app(cfg: DictConfig) -> float:
    """The Hydra app; returns the final loss (what a Hydra sweeper would minimize).

    One run exits 2 on an impossible combination and 1 when it fails (one ``Error: ... Fix: ...`` line, the full
    trace in ``error.log``). In a sweep such a job is recorded (``status.json``, one line) and the sweep goes on;
    at its end :class:`experiments.sweep.SweepSummary` lists the jobs that did not run and exits nonzero.
    """
    hydra_cfg = HydraConfig.get()
    out_dir, sweeping = hydra_cfg.runtime.output_dir, hydra_cfg.mode == RunMode.MULTIRUN
    job = " ".join(hydra_cfg.overrides.task)
    console = Console(out_dir, enabled=os.environ.get("RANK", "0") == "0")
    console.line(f"run directory: {out_dir}")
    try:
        with console.warnings_shown():
            summary = run(own_model(cfg, hydra_cfg.overrides.task), out_dir)
    except ConfigError as e:
        _write_status(out_dir, "skipped", str(e))
        if sweeping:
            console.line(f"skipped job {hydra_cfg.job.num} ({job}): impossible combination: {e}")
            return float("nan")
        console.line(f"Error: {e}")
        sys.exit(2)
    except Exception as e:
        _write_status(out_dir, "failed", f"{type(e).__name__}: {e}")
        trace = e.worker_traceback if isinstance(e, shardings.LaunchError) else None
        Console(out_dir).line(error_line(e, out_dir, trace))  # every rank's own error (torchrun), on its console
        if sweeping:
            console.line(f"failed job {hydra_cfg.job.num} ({job}): {type(e).__name__}: {e}".splitlines()[0])
            return float("nan")
        sys.exit(1)
    _write_status(out_dir, "ran")
    if not summary["steps"]:
        console.line(f"nothing to do: already trained to step {summary['resumed_from']} (its checkpoint)")
        return float("nan")
    compiled = f", compile {summary['compile_s']:.1f} s" if summary.get("compile_s") is not None else ""
    where = resume.where({"layout": summary["layout"], "mesh": {"sizes": summary["mesh"]}})
    console.line(f"{where}: loss {summary['first_loss']:.3f} -> "
                 f"{summary['final_loss']:.3f}, {summary['tokens_per_s']:,.0f} tok/s{compiled}, comm "
                 f"{human_bytes(summary['comm_bytes_per_step'])}/step, memory "
                 f"{human_bytes(summary['memory_per_rank'])}/rank")
    console.line(f"run directory: {out_dir}")
    return summary["final_loss"]


if __name__ == "__main__":
    main()
