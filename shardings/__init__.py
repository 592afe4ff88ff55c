"""The spec language and its lowering: meshes, specs, logical rules, shard_map, runtimes, accounting."""

from shardings.context import constrain, current, use
from shardings.distribute import gather, partial_axes, reshard, shard, spec_of
from shardings.errors import ShardingError
from shardings.mesh import Mesh, NamedSharding, P
from shardings.rules import Rules, annotate, logical_to_spec, logical_to_specs
from shardings.simulate import per_rank, simulate, unwrap
from shardings.visualize import visualize

__all__ = [
    "Mesh",
    "NamedSharding",
    "P",
    "Rules",
    "ShardingError",
    "annotate",
    "constrain",
    "current",
    "gather",
    "logical_to_spec",
    "logical_to_specs",
    "partial_axes",
    "per_rank",
    "reshard",
    "shard",
    "simulate",
    "spec_of",
    "unwrap",
    "use",
    "visualize",
]
