"""One rank's training loop (``run_rank``): what ``python -m experiments.train`` runs on every rank, simulated or
real; rank 0 writes ``metrics.jsonl``, ``summary.json``, ``layout.json``, the console and the tracker
(experiments.train's docstring lists the files).
"""

from __future__ import annotations

import contextlib
import json
import time
import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist
from omegaconf import OmegaConf

import core
import shardings
from experiments import peak, resume
from experiments.build import Setup, build, loss, lr_schedule, optimizer, pretrained
from experiments.console import Console, compile_done
from experiments.data import DataState, source
from experiments.progress import Progress
from experiments.tracker import Tracker
from shardings import checkpoint, maybe_disable_local_tensor_mode, unwrap

__all__ = ["checkpoint_dir", "human_bytes", "run_rank"]


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


def checkpoint_dir(cfg: Any, out_dir: str) -> str | None:
    """The run's checkpoint folder, to resume from and (``checkpoint.every`` > 0) save into; ``None``: neither.

    A ``checkpoint.dir`` named without ``every`` still resumes from it (and refuses a resume that changes the
    experiment): whoever names a folder of checkpoints means to continue from it, not to start over beside it."""
    conf = cfg["checkpoint"]
    return conf["dir"] or (str(Path(out_dir, "checkpoints")) if conf["every"] else None)


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
    ckpt_dir = checkpoint_dir(conf, out_dir)
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
            if ckpt_dir and cfg.checkpoint.every and (i % cfg.checkpoint.every == 0 or i == cfg.steps):
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
