"""Pure, optax-shaped optimizers whose states are pytrees that shard like the params.

>>> opt = chain(clip_by_global_norm(1.0), adamw(warmup_cosine(3e-4, 100, 1000), weight_decay=0.1))
>>> state = opt.init(params)
>>> updates, state = opt.update(grads, state, params)
>>> params = apply_updates(params, updates)
"""

from core.optim.aliases import adamw, sgd
from core.optim.base import (
    EmptyState,
    GradientTransformation,
    ScalarOrSchedule,
    Schedule,
    apply_updates,
    chain,
    global_norm,
)
from core.optim.schedules import constant, linear, warmup_cosine
from core.optim.transforms import (
    ScaleByAdamState,
    ScaleByScheduleState,
    TraceState,
    add_decayed_weights,
    clip_by_global_norm,
    scale,
    scale_by_adam,
    scale_by_learning_rate,
    scale_by_schedule,
    trace,
)

__all__ = [
    "EmptyState",
    "GradientTransformation",
    "ScalarOrSchedule",
    "ScaleByAdamState",
    "ScaleByScheduleState",
    "Schedule",
    "TraceState",
    "adamw",
    "add_decayed_weights",
    "apply_updates",
    "chain",
    "clip_by_global_norm",
    "constant",
    "global_norm",
    "linear",
    "scale",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_schedule",
    "sgd",
    "trace",
    "warmup_cosine",
]
