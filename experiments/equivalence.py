"""``python -m experiments.equivalence model=... layout=... mesh=... steps=N``: one layout vs one device.

Runs ``shardings.testing.equivalence.check_equivalence`` on simulated ranks (``mesh``'s size) for
the model's ``example_batch``, and prints per-step max abs/rel differences of loss, grads and
params against the single-device reference. Exit code 0 when every comparison is within the
tolerance rule of ``shardings.testing`` (docs/equivalence.md), 1 otherwise (the first failing and the worst key
path are named), 2 for a configuration that cannot run. The optimizer runs at a constant ``optim.lr`` (no
warmup), so every compared step moves the parameters. Overrides use Hydra's syntax and the ``train`` app's groups::

    python -m experiments.equivalence model=gpt_tiny layout=zero3+tp+sp mesh=dp2_tp2 steps=3
    python -m experiments.equivalence model=gpt_tiny layout=dp+pp mesh=dp2_pp2 pipeline.schedule=gpipe \
        pipeline.microbatches=4

``model.name`` may be a dotted module path with the model interface (``Config``, ``init``,
``axes``, ``loss``, ``example_batch``, and ``stages`` for a layout with ``pp``): that is how a custom
model is checked. Its ``Config`` gets its own defaults and the ``model.config.*`` fields given with it, nothing of
the default model's::

    python -m experiments.equivalence model.name=mypkg.my_model model.config.classes=6 layout=zero3+tp mesh=dp2_tp2
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from hydra import compose, initialize
from hydra.errors import HydraException

from experiments.build import ConfigError, build, optimizer
from experiments.config import app_overrides, own_model, register
from shardings.testing import check_equivalence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Compose the ``equivalence`` config from ``argv`` overrides, check, print the table; return the exit code.

    >>> main(["model=mlp", "layout=zero3", "mesh=dp2", "steps=2"])  # doctest: +SKIP
    0
    """
    overrides = app_overrides(sys.argv[1:] if argv is None else argv)
    register()
    try:
        with initialize(version_base="1.3", config_path=None):
            cfg = own_model(compose("equivalence", overrides=overrides), overrides)
        setup = build(cfg, batch_size=cfg.batch_size)
    except (ConfigError, HydraException) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    model, model_cfg, plan = setup.model, setup.model_cfg, setup.plan
    report = check_equivalence(
        model.init, model.loss, model.axes, model_cfg,
        model.example_batch(model_cfg, cfg.batch_size, seed=cfg.seed),
        layouts=[setup.layout], mesh=setup.mesh, steps=cfg.steps,
        optimizer=optimizer(cfg.optim, cfg.steps, schedule=False), accum_steps=setup.microbatches,
        clip_norm=cfg.optim.clip_norm, seed=cfg.seed, raise_on_failure=False,
        stages=model.stages if plan else None,  # the pipelined side runs the model's stages, its reference the loss
        schedule=plan.schedule if plan else None,
    )
    how = f", {plan.schedule.name} over {plan.microbatches} microbatches" if plan else ""
    print(f"{cfg.model.name} under {setup.layout.name!r} on {setup.mesh!r}{how}, {cfg.steps} steps vs one device:")
    print(report.table())
    if report.ok:
        print("OK: loss, grads and params match the single-device reference within tolerance.")
        return 0
    first = next(r for r in report.rows if not r.ok)
    worst = report.worst()
    print(f"FAIL: first at step {first.step}, {first.quantity} {first.worst_path} "
          f"(max abs {first.max_abs:.3e}); worst: step {worst.step}, {worst.quantity} {worst.worst_path} "
          f"(max abs {worst.max_abs:.3e}).")
    return 1


if __name__ == "__main__":
    sys.exit(main())
