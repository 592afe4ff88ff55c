"""The spec language and its lowering: meshes, specs, logical rules, shard_map, runtimes, accounting."""

from shardings import checkpoint, layouts, module_tp, testing
from shardings.accounting import Comms, comms, memory
from shardings.blockwise import blockwise
from shardings.collectives import all_gather, all_to_all, axis_index, axis_size, pmean, ppermute, psum, psum_scatter
from shardings.context import constrain, current, use
from shardings.distribute import gather, partial_axes, reshard, shard, spec_of
from shardings.errors import ShardingError
from shardings.initialize import init
from shardings.launch import LaunchError, launch
from shardings.layout_view import describe as describe_layout
from shardings.local_einsum import einsum
from shardings.mesh import Mesh, NamedSharding, P
from shardings.ring_attention import attention
from shardings.rules import Rules, annotate, logical_to_spec, logical_to_specs
from shardings.shard_map import shard_map
from shardings.simulate import per_rank, simulate, unwrap
from shardings.train_step import TrainStep, train_step
from shardings.visualize import visualize

__all__ = [
    "Comms",
    "LaunchError",
    "Mesh",
    "NamedSharding",
    "P",
    "Rules",
    "ShardingError",
    "TrainStep",
    "all_gather",
    "all_to_all",
    "annotate",
    "attention",
    "axis_index",
    "axis_size",
    "blockwise",
    "checkpoint",
    "comms",
    "constrain",
    "current",
    "describe_layout",
    "einsum",
    "gather",
    "init",
    "launch",
    "layouts",
    "logical_to_spec",
    "logical_to_specs",
    "memory",
    "module_tp",
    "partial_axes",
    "per_rank",
    "pmean",
    "ppermute",
    "psum",
    "psum_scatter",
    "reshard",
    "shard",
    "shard_map",
    "simulate",
    "spec_of",
    "testing",
    "train_step",
    "unwrap",
    "use",
    "visualize",
]
