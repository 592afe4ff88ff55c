"""``python -m experiments.equivalence model=... layout=... mesh=... steps=N``: layouts vs one device.

Runs ``shardings.testing.check_equivalence`` for the model's ``example_batch`` on ``mesh``'s ranks, simulated
(``runtime=simulate``, the default) or real gloo processes (``runtime=multiprocess``), and prints per-step max
abs/rel differences of loss, grads and params against the single-device reference. Several layouts share one
reference run (``layouts=[dp,zero3]``, or ``layout=dp,zero3`` with or without ``-m``); ``precision=bf16`` (or
``fp16``) checks each layout under that policy and its fp32 twin; ``jit=true`` checks the compiled step
(``runtime=multiprocess``; ``jit_backend=aot_eager`` compiles quickly). Exit code 0 when every comparison is within the
tolerance rule of ``shardings.testing`` (docs/equivalence.md), 1 otherwise (the first failing and the worst key
path are named), 2 for a configuration that cannot run. The optimizer runs at a constant ``optim.lr`` (no
warmup), so every compared step moves the parameters. Overrides use Hydra's syntax and the ``train`` app's groups::

    python -m experiments.equivalence model=gpt_tiny layout=zero3+tp+sp mesh=dp2_tp2 steps=3
    python -m experiments.equivalence model=gpt_tiny layout=dp+pp mesh=dp2_pp2 pipeline.schedule=gpipe \
        pipeline.microbatches=4
    python -m experiments.equivalence model=gpt_tiny layouts=[dp,zero3,zero3+tp] mesh=dp2_tp2 precision=bf16
    python -m experiments.equivalence model=gpt_tiny layout=zero3 mesh=dp2 runtime=multiprocess jit=true

``model.name`` may be a dotted module path with the model interface (``Config``, ``init``,
``axes``, ``loss``, ``example_batch``, and ``stages`` for a layout with ``pp``): that is how a custom
model is checked. Its ``Config`` gets its own defaults and the ``model.config.*`` fields given with it, nothing of
the default model's::

    python -m experiments.equivalence model.name=mypkg.my_model model.config.classes=6 layout=zero3+tp mesh=dp2_tp2
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence
from typing import Any

from hydra import compose, initialize
from hydra.errors import HydraException
from omegaconf import open_dict

from experiments.build import ConfigError, Setup, build, optimizer
from experiments.config import app_overrides, own_model, register, usage
from shardings.testing import check_equivalence

__all__ = ["main"]

_MULTIRUN = ("-m", "--multirun")


def main(argv: Sequence[str] | None = None) -> int:
    """Compose the ``equivalence`` config from ``argv`` overrides, check, print the table; return the exit code.

    >>> main(["model=mlp", "layouts=[dp,zero3]", "mesh=dp2", "steps=2"])  # doctest: +SKIP
    0
    """
    args = [a for a in (sys.argv[1:] if argv is None else argv) if a not in _MULTIRUN]  # -m: layouts in one call
    register()
    if {"-h", "--help"} & set(args):
        with initialize(version_base="1.3", config_path=None):
            print(usage(__doc__, compose("equivalence")))
        return 0
    overrides = app_overrides([_layout_list(a) for a in args])
    try:
        with initialize(version_base="1.3", config_path=None):
            cfg = own_model(compose("equivalence", overrides=overrides), overrides)
        setups = [build(_with_layout(cfg, name), batch_size=cfg.batch_size) for name in cfg.layouts or [cfg.layout]]
        report, how = _check(cfg, setups)
    except (ConfigError, HydraException) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    names = ", ".join(repr(s.layout.name) for s in setups)
    print(f"{cfg.model.name} under {names} on {setups[0].mesh!r}{how}, {cfg.steps} steps vs one device:")
    print(report.table())
    if report.ok:
        print("OK: loss, grads and params match the single-device reference within tolerance.")
        return 0
    first = next(r for r in report.rows if not r.ok)
    worst = report.worst()
    several = len({r.layout for r in report.rows}) > 1  # (a bf16 layout's fp32 twin is another)
    under = (lambda r: f"{r.layout} ") if several else (lambda r: "")
    print(f"FAIL: first at step {first.step}, {under(first)}{first.quantity} {first.worst_path} "
          f"(max abs {first.max_abs:.3e}); worst: step {worst.step}, {under(worst)}{worst.quantity} "
          f"{worst.worst_path} (max abs {worst.max_abs:.3e}).")
    return 1


def _layout_list(override: str) -> str:
    """``layout=dp,zero3`` (Hydra's sweep syntax) as ``layouts=[dp,zero3]``: one call, one reference run."""
    key, _, value = override.partition("=")
    return f"layouts=[{value}]" if key == "layout" and "," in value else override


def _with_layout(cfg: Any, name: str) -> Any:
    out = cfg.copy()
    with open_dict(out):
        out.layout = name
    return out


def _check(cfg: Any, setups: list[Setup]) -> tuple[Any, str]:
    """One ``check_equivalence`` call for every layout; the report and how the pipeline ran (for the header)."""
    first = setups[0]
    model, model_cfg = first.model, first.model_cfg
    micro = {s.layout.name: s.microbatches for s in setups}
    if len(set(micro.values())) > 1:
        raise ConfigError(f"layouts={list(micro)} run {micro} microbatches a step: one call checks its layouts at "
                          "one count. Fix: set accum_steps (or pipeline.microbatches) so they agree, or check them "
                          "in separate calls.")
    runtime = cfg.runtime.kind
    if runtime not in ("simulate", "multiprocess"):
        raise ConfigError(f"runtime={runtime}: the check starts its own ranks. Fix: runtime=simulate or "
                          "runtime=multiprocess.")
    if cfg.jit and runtime != "multiprocess":
        raise ConfigError("jit=true: simulated ranks cannot be compiled. Fix: add runtime=multiprocess.")
    plan = next((s.plan for s in setups if s.plan is not None), None)
    per_block = plan is not None or (cfg.jit and callable(getattr(model, "stages", None)))
    report = check_equivalence(
        model.init, model.loss, model.axes, model_cfg,
        model.example_batch(model_cfg, cfg.batch_size, seed=cfg.seed),
        layouts=[s.layout for s in setups], mesh=first.mesh, steps=cfg.steps,
        optimizer=functools.partial(optimizer, cfg.optim, cfg.steps, False),  # a factory: pickled to real ranks
        accum_steps=first.microbatches, clip_norm=cfg.optim.clip_norm, seed=cfg.seed, raise_on_failure=False,
        stages=model.stages if per_block else None,  # the pipelined (or compiled) side runs the model's stages
        schedule=plan.schedule if plan else None, precision=first.precision, runtime=runtime, jit=cfg.jit,
        **({"jit_backend": cfg.jit_backend} if cfg.jit_backend else {}),
    )
    how = f", {plan.schedule.name} over {plan.microbatches} microbatches" if plan else ""
    how += f", {first.precision.compute_dtype} compute (and its fp32 twin)" if first.precision else ""
    return report, how + (", real processes" if runtime == "multiprocess" else "") + (", compiled" if cfg.jit else "")


if __name__ == "__main__":
    sys.exit(main())
