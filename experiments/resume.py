"""What a resume may change: the layout and the mesh (resharding), never the experiment.

A checkpoint holds the run's resolved config (``config.resolved``). A run that resumes from it is checked
against it first, key by key: a key that defines the training — the steps (the learning-rate schedule spans
them), the optimizer and its schedule, the data and its batches, the model, the precision, the seed — must not
differ, or the losses after the resume would continue a different experiment than the one saved. How the run
is laid out (layout, mesh, pipeline, runtime, jit, offload, accumulation, checkpointing, the console) may
differ: the state is resharded on load, and the console says from what to what.
"""

from __future__ import annotations

import json
from typing import Any

from experiments.build import ConfigError
from shardings import checkpoint

__all__ = ["TRAINING_KEYS", "changed_keys", "check", "saved_config", "where"]

# The top-level config keys that define the experiment (every field under them counts). One home: the check
# and the docs (docs/checkpoints.md) read this tuple.
TRAINING_KEYS = ("steps", "optim", "data", "model.name", "model.config", "precision", "seed")

_ALLOW = "checkpoint.allow_changes=true"


def _flat(conf: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(conf, dict):
        return {k: v for key, sub in conf.items() for k, v in _flat(sub, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): conf}


def _defining(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in TRAINING_KEYS)


def changed_keys(saved: dict[str, Any], now: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{key: (saved value, value now)}`` for each training-defining key that differs (absent: ``None``).

    >>> changed_keys({"steps": 4, "layout": "dp"}, {"steps": 6, "layout": "zero3"})
    {'steps': (4, 6)}
    """
    a, b = _flat(saved), _flat(now)
    keys = sorted(k for k in a.keys() | b.keys() if _defining(k))
    return {k: (a.get(k), b.get(k)) for k in keys if a.get(k) != b.get(k)}


def saved_config(ckpt_dir: str) -> tuple[dict[str, Any] | None, int] | None:
    """The resolved config the newest checkpoint under ``ckpt_dir`` was saved with (``None`` in an old one), and
    its step; ``None`` when there is no checkpoint."""
    found = checkpoint.saved_values(ckpt_dir)
    if found is None:
        return None
    values, step = found
    text = values.get("['config']['resolved']")
    return (json.loads(text) if text else None), step


def where(conf: dict[str, Any]) -> str:
    """``'zero3+tp on dp2_tp2'``: a config's layout and mesh, as the console shows them."""
    mesh = "_".join(f"{axis}{size}" for axis, size in conf["mesh"]["sizes"].items())
    return f"{conf['layout']} on {mesh}"


def check(ckpt_dir: str, conf: dict[str, Any]) -> tuple[dict[str, Any], int] | None:
    """Refuse to resume from ``ckpt_dir`` when ``conf`` changes a training-defining key of the saved run.

    Args:
        ckpt_dir: the run's checkpoint root.
        conf: the resolved config the run would resume under.

    Returns:
        ``(saved config, step)`` of the checkpoint to resume, or ``None`` when there is none (or it predates the
        recorded config).

    Raises:
        ConfigError: the differing keys, saved and now, and the flag that accepts them.
    """
    found = saved_config(ckpt_dir)
    if found is None or found[0] is None:
        return None
    saved, step = found
    changes = changed_keys(saved, conf)
    if changes and not conf.get("checkpoint", {}).get("allow_changes"):
        listed = "; ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in changes.items())
        raise ConfigError(
            f"resuming {ckpt_dir} (step {step}) would change the experiment it saved: {listed}. A layout or mesh "
            f"may change (the state is resharded), these may not. Fix: restore the saved values, start a new run "
            f"(another checkpoint.dir or run directory), or pass {_ALLOW} to continue with the changed keys."
        )
    return saved, step
