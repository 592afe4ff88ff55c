"""The spec language and its lowering: meshes, specs, logical rules, shard_map, runtimes, accounting."""

from shardings.errors import ShardingError
from shardings.mesh import Mesh, NamedSharding, P
from shardings.simulate import per_rank, simulate

__all__ = ["Mesh", "NamedSharding", "P", "ShardingError", "per_rank", "simulate"]
