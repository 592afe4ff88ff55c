"""The experiment tracker: each run's scalars and its config as TensorBoard event files in its run directory.

``tracker=true`` (the default; ``tracker=false`` turns it off) writes, through ``torch.utils.tensorboard``, one
point per step of ``loss``, ``lr``, ``grad_norm``, ``tokens_per_s``, ``comm/<axis>`` (bytes sent per rank on that
mesh axis), ``memory/held_per_rank`` and ``memory/peak_per_rank`` (measured, where the run measures it), and
under fp16 ``loss_scale`` and ``skipped_steps``; at the end the resolved config as hparams with the final loss
and tokens/s as their metrics. ``tensorboard --logdir multirun/<date>`` then compares a sweep's runs.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Tracker", "hparams", "scalars"]


def scalars(record: dict[str, Any], lr: float) -> dict[str, float]:
    """The tags and values one ``metrics.jsonl`` record logs.

    >>> scalars({"loss": 2.0, "grad_norm": 1.0, "tokens_per_s": 9.0, "memory_per_rank": 8,
    ...          "comm": [{"axis": "dp", "bytes": 4}, {"axis": "dp", "bytes": 2}]}, 0.1)["comm/dp"]
    6.0
    """
    out = {"loss": record["loss"], "lr": lr, "grad_norm": record["grad_norm"], "tokens_per_s": record["tokens_per_s"],
           "memory/held_per_rank": record["memory_per_rank"]}
    for row in record["comm"]:
        out[f"comm/{row['axis']}"] = out.get(f"comm/{row['axis']}", 0.0) + row["bytes"]
    for key, tag in (("peak_memory", "memory/peak_per_rank"), ("loss_scale", "loss_scale"),
                     ("skipped_steps", "skipped_steps")):
        if record.get(key) is not None:
            out[tag] = record[key]
    return {k: float(v) for k, v in out.items() if v is not None}


def hparams(conf: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """The resolved config flattened to ``{"optim.lr": 0.003, ...}`` with values TensorBoard's hparams take
    (numbers, strings, bools; anything else as its string)."""
    out: dict[str, Any] = {}
    for key, value in conf.items():
        if isinstance(value, dict) and value:
            out |= hparams(value, f"{prefix}{key}.")
        else:
            out[prefix + key] = value if isinstance(value, int | float | str | bool) else str(value)
    return out


class Tracker:
    """TensorBoard event files in ``out_dir``; disabled (another rank, or ``tracker=false``): does nothing."""

    def __init__(self, out_dir: str, enabled: bool = True) -> None:
        self.writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter  # tensorboard: imported only when tracking

            self.writer = SummaryWriter(log_dir=out_dir)

    def step(self, step: int, record: dict[str, Any], lr: float) -> None:
        if self.writer is not None:
            for tag, value in scalars(record, lr).items():
                self.writer.add_scalar(tag, value, step)

    def close(self, conf: dict[str, Any], summary: dict[str, Any]) -> None:
        """Log ``conf`` as hparams with the run's final loss and tokens/s, then flush and close."""
        if self.writer is None:
            return
        metrics = {f"hparam/{k}": float(summary[k]) for k in ("final_loss", "tokens_per_s") if k in summary}
        if metrics:
            self.writer.add_hparams(hparams(conf), metrics, run_name=".")  # ".": this run's folder, not a new one
        self.writer.close()
