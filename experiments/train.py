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
import time
import warnings
from pathlib import Path
from typing import Any

import hydra
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

import core
import shardings
from experiments import peak, resume
from experiments.build import ConfigError, Setup, build, loss, lr_schedule, model, optimizer, pretrained
from experiments.config import app_overrides, own_model, register
from experiments.console import Console, compile_done, error_line
from experiments.data import DataState, mismatch, source
from experiments.progress import Progress
from experiments.sweep import SWEEP_SUMMARY
from experiments.tracker import Tracker
from shardings import checkpoint, maybe_disable_local_tensor_mode, unwrap

__all__ = ["app", "human_bytes", "main", "run", "run_rank"]

_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def human_bytes(n: float) -> str:
    """``1536 -> '1.5 KiB'``.

    >>> human_bytes(3 * 2**20)
    '3.0 MiB'
    """
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _loss_scale(step: Any, opt_state: Any) -> dict[str, Any]:
    """Under fp16's dynamic loss scaling: the scale the next step uses and the steps skipped so far (else nothing)."""
    scale = step.loss_scale(opt_state)
    if scale is None:
        return {}
    return {"loss_scale": float(unwrap(scale)), "skipped_steps": int(unwrap(opt_state.loss_scale.skipped))}


def _record(step: int, metrics: dict[str, Any], seconds: float, state: DataState,
            scaling: dict[str, Any]) -> dict[str, Any]:
    memory = metrics["memory"]
    return {
        "step": step,
        "loss": metrics["loss"],
        "grad_norm": metrics["grad_norm"],
        "tokens": metrics["tokens"],
        "seconds": seconds,
        "tokens_per_s": metrics["tokens"] / seconds,
        "comm_bytes": metrics["comm_bytes"],
        "comm": metrics["comm"],
        "memory": memory,
        "memory_per_rank": sum(v for k, v in memory.items() if k != "host"),  # host: where some of it lives
        "data_position": state.position,
        **scaling,  # loss_scale, skipped_steps (fp16)
        **({"pipeline": metrics["pipeline"]} if "pipeline" in metrics else {}),  # schedule, bubble_planned, ...
    }


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0  # simulate: the fake group's rank is 0


def _train_state(params: Any, opt_state: Any, data: DataState, key: Any, conf: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint holds. The resolved config is one JSON string, so a run resumed under another
    layout or mesh (other config keys) still matches the saved structure; the model part is also kept
    as values, for ``experiments.export``."""
    model = {"name": conf["model"]["name"], "config": conf["model"]["config"]}
    return {"params": params, "opt_state": opt_state, "data": {"position": data.position}, "rng": key,
            "config": {"model": model, "resolved": json.dumps(conf)}}


def _earlier_records(out_dir: str, upto: int) -> list[dict[str, Any]]:
    """``metrics.jsonl``'s records of steps ``<= upto`` (a resumed run drops those after its checkpoint)."""
    file = Path(out_dir, "metrics.jsonl")
    if not upto or not file.exists():
        return []
    records = [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
    return [r for r in records if r["step"] <= upto]


def _ckpt_dir(cfg: Any, out_dir: str) -> str | None:
    """Where the run's checkpoints go (``None``: it saves none)."""
    return (cfg["checkpoint"]["dir"] or str(Path(out_dir, "checkpoints"))) if cfg["checkpoint"]["every"] else None


def run_rank(conf: dict[str, Any], out_dir: str, setup: Setup | None = None) -> dict[str, Any]:
    """One rank's training loop (all ranks run it); rank 0 writes metrics, the console and the tracker.

    With ``checkpoint.every=N`` the whole train state is saved every N steps and at the last one,
    and a run whose checkpoint folder already holds one resumes from the latest by itself (a damaged
    one is skipped with a warning naming it and why: the newest that verifies is used).

    Args:
        conf: the resolved config as a plain dict.
        out_dir: the run directory.
        setup: ``build``'s result for ``conf`` when it was made in this process (simulated ranks); a real
            process builds its own (a Setup holds the model module, which does not travel to another process).

    Returns:
        The run's summary (final loss, mean tokens/s, mean comm bytes per step by kind, memory per rank).
    """
    main = _is_main()
    console = Console(out_dir, enabled=main)
    with console.warnings_shown():
        return _train(conf, out_dir, setup or build(OmegaConf.create(conf)), console)


def _train(conf: dict[str, Any], out_dir: str, setup: Setup, console: Console) -> dict[str, Any]:
    cfg = OmegaConf.create(conf)
    m, mcfg = setup.model, setup.model_cfg
    axes = m.axes(mcfg)
    key = core.random.key(cfg.seed)
    params = shardings.init(m.init, key, mcfg, axes=axes, layout=setup.layout, mesh=setup.mesh, plan=setup.plan)
    step = shardings.train_step(loss(setup, cfg.jit), optimizer(cfg.optim, cfg.steps), layout=setup.layout,
                                mesh=setup.mesh, axes=axes, accum_steps=setup.microbatches, plan=setup.plan,
                                clip_norm=cfg.optim.clip_norm, precision=setup.precision, jit=cfg.jit,
                                donate=True)  # the loop never reads a step's inputs again
    ckpt_dir = _ckpt_dir(conf, out_dir)
    start = 0
    if ckpt_dir and checkpoint.latest(ckpt_dir):
        like = _train_state(step.stored(params), step.init(params), DataState(0), key, conf)
        with warnings.catch_warnings():
            if not console.enabled:  # rank 0 says which checkpoint was skipped, once
                warnings.simplefilter("ignore", checkpoint.CheckpointWarning)
            saved, start = checkpoint.resume(ckpt_dir, like=like)  # the newest that verifies
        params, opt_state, data_state = saved["params"], saved["opt_state"], DataState(saved["data"]["position"])
        was = json.loads(saved["config"]["resolved"])
        console.line(f"resumed from step {start} ({Path(ckpt_dir, f'step_{start}')}), saved under "
                     f"{resume.where(was)}, now {resume.where(conf)}")
    else:
        if cfg.model.init_from:
            with maybe_disable_local_tensor_mode():  # whole tensors, read once; init shards them
                whole = pretrained(cfg.model.init_from, setup)
            params = shardings.init(lambda _key, _cfg: whole, key, mcfg, axes=axes, layout=setup.layout,
                                    mesh=setup.mesh, plan=setup.plan)
        opt_state, data_state = step.init(params), DataState(0)
        params = step.stored(params)  # zero1/2 under a policy: the compute copy (the fp32 master is in opt_state)
    data, what = source(cfg.data, setup.seq_len, getattr(mcfg, "vocab", None))
    console.line(what)
    main, lr = console.enabled, lr_schedule(cfg.optim, cfg.steps)
    records = _earlier_records(out_dir, start) if main else []
    bar = Progress(cfg.steps, initial=start, desc=setup.layout.name, enabled=main and cfg.progress,
                   every=cfg.progress_every, log=console.log)
    tracker = Tracker(out_dir, enabled=main and cfg.tracker)
    compile_s = None
    measurable, unmeasured = peak.measures(cfg.jit)
    if unmeasured and start < cfg.steps:
        console.line(unmeasured)
    with contextlib.ExitStack() as stack:
        log = stack.enter_context(open(Path(out_dir, "metrics.jsonl"), "w")) if main else None
        if log is not None:
            log.writelines(json.dumps(r) + "\n" for r in records)
        stack.callback(bar.close)
        for i in range(start + 1, cfg.steps + 1):
            compiling = cfg.jit and i == start + 1  # torch.compile traces and compiles the step's graphs now
            if compiling:
                console.begin(f"compiling step {i}'s graphs (jit=true) ...")
            t0 = time.perf_counter()
            if setup.layout.pipelined:  # the global batch (whole tensors), placed by the step on its stage mesh
                with maybe_disable_local_tensor_mode():
                    batch, data_state = data.next(data_state)
            else:
                batch, data_state = data.next_sharded(data_state, setup.layout, setup.mesh)
            measure = i == cfg.steps and measurable  # the last step (peak.py: what is measured)
            try:
                with peak.measured(measure, (params, opt_state, batch), setup.mesh.size) as peaks:
                    params, opt_state, metrics = step(params, opt_state, batch)
            except shardings.NonFiniteGradError as e:  # name the step: the loop is what knows it
                raise e.at_step(i) from None
            seconds = time.perf_counter() - t0
            if compiling:
                compile_s = seconds
                console.end(compile_done(step.compiled.graphs if step.compiled else 0, seconds))
            records.append(_record(i, metrics, seconds, data_state, _loss_scale(step, opt_state)))
            if peaks:  # this rank's and every rank's measured peak
                records[-1] |= {"peak_memory": peaks[dist.get_rank() if dist.is_initialized() else 0],
                                "peak_memory_ranks": peaks}
            if log is not None:
                log.write(json.dumps(records[-1]) + "\n")
                log.flush()
            tracker.step(i, records[-1], float(lr(i - 1)))
            if ckpt_dir and (i % cfg.checkpoint.every == 0 or i == cfg.steps):
                t0 = time.perf_counter()
                state = _train_state(params, opt_state, data_state, key, conf)
                saved_to = checkpoint.save(ckpt_dir, state, step=i, keep=cfg.checkpoint.keep).path
                console.line(f"checkpoint saved: step {i} -> {saved_to} ({time.perf_counter() - t0:.1f} s)")
            r = records[-1]
            speed = "compiling" if compiling else f"{r['tokens_per_s']:,.0f} tok/s"
            bar.update(f"loss {r['loss']:.3f} | {speed} | comm "
                       f"{human_bytes(r['comm_bytes'])}/step | mem {human_bytes(r['memory_per_rank'])}/rank")
    summary = {**_summary(records, setup, start + 1), "resumed_from": start, "compile_s": compile_s}
    if unmeasured:
        summary["peak_memory_note"] = unmeasured
    elif main and records and records[-1].get("peak_memory_ranks"):  # the peak by role (peak.parts)
        saved = (records[-1].get("pipeline") or {}).get("saved_peak")
        summary["peak_parts"], summary["peak_parts_source"] = peak.parts(
            setup, optimizer(cfg.optim, cfg.steps), cfg.data.batch_size, records[-1]["memory"],
            max(records[-1]["peak_memory_ranks"]), max(saved) if saved else None)
    tracker.close(conf, summary)
    if main:
        Path(out_dir, "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        # The step at a glance, for experiments.report's layout_<i>.png: specs per role and a step's collectives.
        view = shardings.describe_layout(params, axes, setup.layout, setup.mesh,
                                         comm=records[-1]["comm"] if records else None, plan=setup.plan)
        Path(out_dir, "layout.json").write_text(json.dumps(view.to_dict(), indent=1) + "\n")
        if setup.plan is not None and step.last is not None:  # pp: the last step's schedule as planned and as it ran
            from experiments import gantt  # matplotlib: only for pipeline runs

            gantt.save(Path(out_dir, gantt.TIMELINE), setup.plan.schedule, step.last)
    return summary


def _summary(records: list[dict[str, Any]], setup: Any, first: int = 1) -> dict[str, Any]:
    if not records:  # restarted after its last step, elsewhere than its first run dir: nothing to report
        return {"layout": setup.layout.name, "mesh": setup.mesh.shape, "steps": 0}
    # A process's first step pays for warm-up (plans, meshes, allocator; under jit the compile), the measured one
    # for its dispatch mode (experiments.peak): not throughput.
    timed = [r for r in records if r["step"] not in (1, first) and "peak_memory" not in r] or records
    by_kind: dict[str, float] = {}
    for r in records:
        for row in r["comm"]:
            by_kind[row["kind"]] = by_kind.get(row["kind"], 0) + row["bytes"] / len(records)
    return {
        "layout": setup.layout.name,
        "mesh": setup.mesh.shape,
        "precision": str(setup.precision or core.precision.Policy()),
        "steps": len(records),
        "first_loss": records[0]["loss"],
        "final_loss": records[-1]["loss"],
        "tokens_per_s": sum(r["tokens"] for r in timed) / sum(r["seconds"] for r in timed),
        "comm_bytes_per_step": sum(r["comm_bytes"] for r in records) / len(records),
        "comm_bytes_by_kind": by_kind,
        "memory": records[-1]["memory"],
        "memory_per_rank": records[-1]["memory_per_rank"],
        "peak_memory_ranks": records[-1].get("peak_memory_ranks"),  # measured over the last step (experiments.peak)
    }


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
    ckpt_dir = _ckpt_dir(conf, out_dir)
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
