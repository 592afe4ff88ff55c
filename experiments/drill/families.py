"""The layout families a drill runs, each a small job of ``experiments.train`` on real gloo ranks."""

from __future__ import annotations

import dataclasses

__all__ = ["FAMILIES", "JOB", "Family"]

# Every drill job: few steps, a checkpoint every 2, a collective that cannot complete raises after 20 s; adamw with
# the drill's kill_optimizer fault planted (experiments.drill.optim).
JOB = ("data.max_bytes=200000", "data.batch_size=8", "progress=false", "optim.name=experiments.drill.optim",
       "optim.warmup_steps=0", "optim.lr=1e-2", "steps=6", "checkpoint.every=2", "checkpoint.keep=3",
       "runtime=multiprocess", "runtime.timeout_s=20")
_MLP = ("model=mlp", "model.name=experiments.drill.mlp", "model.config.dim=32", "model.config.mlp=64")


@dataclasses.dataclass(frozen=True)
class Family:
    """A layout family: its name in the table, the train app's overrides for it, and its world size."""

    name: str
    overrides: tuple[str, ...]
    world: int
    calls: int = 1  # calls of the model's loss (pipelines: of its first stage, one per microbatch) per step per rank
    loss_scale: bool = False  # fp16: a non-finite step is skipped and counted, not an error
    smaller: tuple[str, ...] = ()  # the overrides of a restart on half the ranks (resharded resume); () = none


FAMILIES = {f.name: f for f in (
    Family("zero3+tp", (*_MLP, "layout=zero3+tp", "mesh=dp2_tp2"), 4, smaller=("layout=zero3", "mesh=dp2")),
    Family("dp+pp 1f1b", (*_MLP, "layout=dp+pp", "mesh=dp2_pp2", "pipeline.schedule=1f1b",
                          "pipeline.microbatches=4"), 4, calls=4, smaller=("layout=pp", "mesh=pp2")),
    # ZB-V: two chunks per rank, so 4 blocks for pp=2; zero3 needs a dp axis, so 4 ranks (not 2: zero3 on pp2 alone
    # is refused, "preset 'zero3' needs a mesh axis 'dp' or 'fsdp'").
    Family("zero3+pp zb_v", (*_MLP, "model.config.layers=4", "layout=zero3+pp", "mesh=dp2_pp2",
                             "pipeline.schedule=zb_v", "pipeline.microbatches=4"), 4, calls=4,
           smaller=("layout=pp", "mesh=pp2")),
    Family("zero2+offload fp16", (*_MLP, "layout=zero2", "mesh=dp2", "offload=optimizer", "precision=fp16"), 2,
           loss_scale=True),
    Family("dp+ep moe", ("model=moe_tiny", "model.name=experiments.drill.moe", "layout=dp+ep", "mesh=dp2_ep2"), 4,
           smaller=("layout=dp", "mesh=dp2")),
)}
