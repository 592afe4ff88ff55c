"""``python -m experiments.train``: the Hydra training app (what ``make train`` runs).

With no arguments: ``gpt_tiny`` on the standard library's source bytes, layout ``zero3+tp`` on
``Mesh(dp=2, tp=2)``, 4 real processes (gloo). Anything else is an override::

    python -m experiments.train model=gpt_small layout=zero3+tp+sp mesh=fsdp2_tp2 steps=200
    python -m experiments.train -m layout=dp,zero3,zero3+tp+sp mesh=dp4,dp2_tp2   # a sweep
    torchrun --nnodes 2 --nproc-per-node 4 ... -m experiments.train runtime=torchrun mesh=dp2_fsdp2_tp2

Each run's directory (Hydra's) gets ``config.yaml`` (resolved), ``metrics.jsonl`` (one line per
step: loss, grad_norm, tokens, tokens_per_s, comm rows and bytes, memory per rank, data position)
and ``summary.json``. ``python -m experiments.report <multirun dir>`` compares the runs of a sweep.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import hydra
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

import core
import shardings
from experiments.build import ConfigError, build, optimizer
from experiments.config import register
from experiments.data import DataState, Packed, load_corpus
from shardings.initialize import init as sharded_init
from shardings.train_step import train_step

__all__ = ["human_bytes", "main", "run", "run_rank"]

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


def _record(step: int, metrics: dict[str, Any], seconds: float, state: DataState) -> dict[str, Any]:
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
        "memory_per_rank": sum(memory.values()),
        "data_position": state.position,
    }


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0  # simulate: the fake group's rank is 0


def run_rank(conf: dict[str, Any], out_dir: str) -> dict[str, Any]:
    """One rank's training loop (all ranks run it); rank 0 writes metrics and shows the progress bar.

    Args:
        conf: the resolved config as a plain dict.
        out_dir: the run directory.

    Returns:
        The run's summary (final loss, mean tokens/s, mean comm bytes per step by kind, memory per rank).
    """
    cfg = OmegaConf.create(conf)
    setup = build(cfg)
    m, mcfg = setup.model, setup.model_cfg
    axes = m.axes(mcfg)
    params = sharded_init(m.init, core.random.key(cfg.seed), mcfg, axes=axes, layout=setup.layout, mesh=setup.mesh)
    step = train_step(functools.partial(m.loss, cfg=mcfg), optimizer(cfg.optim, cfg.steps), layout=setup.layout,
                      mesh=setup.mesh, axes=axes, accum_steps=cfg.accum_steps, clip_norm=cfg.optim.clip_norm)
    opt_state = step.init(params)
    data = Packed(load_corpus(cfg.data.source, cfg.data.max_bytes, cfg.data.seed), setup.seq_len,
                  cfg.data.batch_size, cfg.data.seed)
    state, records = DataState(0), []
    main = _is_main()
    bar = tqdm(total=cfg.steps, desc=setup.layout.name, disable=not (main and cfg.progress), file=sys.stderr)
    with contextlib.ExitStack() as stack:
        log = stack.enter_context(open(Path(out_dir, "metrics.jsonl"), "w")) if main else None
        stack.callback(bar.close)
        for i in range(1, cfg.steps + 1):
            start = time.perf_counter()
            batch, state = data.next_sharded(state, setup.layout, setup.mesh)
            params, opt_state, metrics = step(params, opt_state, batch)
            records.append(_record(i, metrics, time.perf_counter() - start, state))
            if log is not None:
                log.write(json.dumps(records[-1]) + "\n")
                log.flush()
            r = records[-1]
            bar.set_postfix_str(f"loss {r['loss']:.3f} | {r['tokens_per_s']:,.0f} tok/s | comm "
                                f"{human_bytes(r['comm_bytes'])}/step | mem {human_bytes(r['memory_per_rank'])}/rank")
            bar.update()
    summary = _summary(records, setup)
    if main:
        Path(out_dir, "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _summary(records: list[dict[str, Any]], setup: Any) -> dict[str, Any]:
    timed = records[1:] or records  # the first step pays for warm-up (plans, meshes, allocator)
    by_kind: dict[str, float] = {}
    for r in records:
        for row in r["comm"]:
            by_kind[row["kind"]] = by_kind.get(row["kind"], 0) + row["bytes"] / len(records)
    return {
        "layout": setup.layout.name,
        "mesh": setup.mesh.shape,
        "steps": len(records),
        "first_loss": records[0]["loss"],
        "final_loss": records[-1]["loss"],
        "tokens_per_s": sum(r["tokens"] for r in timed) / sum(r["seconds"] for r in timed),
        "comm_bytes_per_step": sum(r["comm_bytes"] for r in records) / len(records),
        "comm_bytes_by_kind": by_kind,
        "memory": records[-1]["memory"],
        "memory_per_rank": records[-1]["memory_per_rank"],
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
        ConfigError: an impossible combination (raised before any process starts).
        shardings.LaunchError: a rank failed (multiprocess / torchrun).
    """
    if cfg.runtime.kind == "torchrun":
        _torchrun_env()
    build(cfg)
    conf = OmegaConf.to_container(cfg, resolve=True)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    if os.environ.get("RANK", "0") == "0":
        Path(out_dir, "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    world = cfg.runtime.world_size or build(cfg).mesh.size
    if cfg.runtime.kind == "simulate":
        with shardings.simulate(world):
            return run_rank(conf, out_dir)
    return shardings.launch(run_rank, world, conf, out_dir, backend=cfg.runtime.backend,
                            timeout=cfg.runtime.timeout_s)[0]


register()


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float:
    """The Hydra entry point; returns the final loss (what a Hydra sweeper would minimize)."""
    try:
        summary = run(cfg, HydraConfig.get().runtime.output_dir)
    except (ConfigError, shardings.LaunchError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2 if isinstance(e, ConfigError) else 1)
    print(f"{summary['layout']} on {summary['mesh']}: loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f}, "
          f"{summary['tokens_per_s']:,.0f} tok/s, comm {human_bytes(summary['comm_bytes_per_step'])}/step, "
          f"memory {human_bytes(summary['memory_per_rank'])}/rank")
    return summary["final_loss"]


if __name__ == "__main__":
    main()
