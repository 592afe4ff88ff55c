"""The layout planner: which layout and mesh for this model on that cluster, predicted exactly and ranked.

:func:`plan` enumerates the candidates the preset and schedule registries allow (layouts × mesh factorizations ×
microbatches × schedules × remat × precision × offload), estimates each in microseconds, runs the best on fake
tensors as rank 0 of the cluster's world (the real train step: exact comm bytes, peak memory, FLOPs), and ranks
them by predicted step time on a :class:`Cluster`. ``docs/planner.md`` walks through it.
"""

from shardings.planner.candidates import Candidate, Space, enumerate_candidates
from shardings.planner.cluster import Cluster, Link
from shardings.planner.cost import Timing, step_time
from shardings.planner.fake_step import Measured, measure
from shardings.planner.memory import StepMemory
from shardings.planner.model_profile import row_tokens
from shardings.planner.prediction import Prediction
from shardings.planner.ranking import Fit, Ranking, Row
from shardings.planner.search import peak_by_role, plan

__all__ = [
    "Candidate",
    "Cluster",
    "Fit",
    "Link",
    "Measured",
    "Prediction",
    "Ranking",
    "Row",
    "Space",
    "StepMemory",
    "Timing",
    "enumerate_candidates",
    "measure",
    "peak_by_role",
    "plan",
    "row_tokens",
    "step_time",
]
