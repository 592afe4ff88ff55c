"""shardlab's sharding layer: parallelism declared as specs, lowered to DTensor placements and collectives.

The public surface is this module (``shardings.P``, ``shardings.train_step``, ...). The code lives in
subpackages by concern, and imports between them go one way — each may import only those before it::

    spec → runtime → comm → residency → ops → pipeline → step → checkpoint → testing → planner

``runtime/compat.py`` (every private torch name) is below them all. Code outside ``shardings`` imports from here
and the public subpackages re-exported here (``pipeline``, ``testing``, ``checkpoint``, ``layouts``).
``tests/test_architecture.py`` checks both on the source; docs/internals.md walks through the subpackages.
"""

from shardings import checkpoint, pipeline, planner, testing
from shardings.comm.accounting import Comms, comms, memory
from shardings.comm.collectives import (
    all_gather,
    all_to_all,
    axis_index,
    axis_size,
    pmean,
    ppermute,
    psum,
    psum_scatter,
)
from shardings.comm.peak_memory import PeakMemory, peak_memory
from shardings.comm.shard_map import shard_map
from shardings.ops import module_tp
from shardings.ops.blockwise import blockwise
from shardings.ops.local_einsum import einsum
from shardings.ops.ring_attention import attention
from shardings.ops.vocab_parallel import embedding, nll
from shardings.planner import plan
from shardings.runtime.compat import maybe_disable_local_tensor_mode, rank_map
from shardings.runtime.launch import LaunchError, launch
from shardings.runtime.simulate import per_rank, simulate, simulated, simulated_calls, unwrap
from shardings.spec import layouts
from shardings.spec.context import constrain, current, use
from shardings.spec.distribute import from_callback, gather, partial_axes, reshard, shard, spec_of
from shardings.spec.errors import ShardingError, sharding_error
from shardings.spec.layouts import Layout
from shardings.spec.mesh import Mesh, NamedSharding, P
from shardings.spec.placeholder import resolve
from shardings.spec.rules import Rules, annotate, logical_to_spec, logical_to_specs
from shardings.spec.visualize import visualize
from shardings.step.batching import check_batch_rows
from shardings.step.compiled import DEFAULT_JIT_BACKEND, CompileFallbackWarning
from shardings.step.finite import NonFiniteGradError
from shardings.step.initialize import init, param_specs
from shardings.step.layout_view import describe as describe_layout
from shardings.step.train_step import TrainStep, default_token_count, train_step

__all__ = [
    "DEFAULT_JIT_BACKEND",
    "Comms",
    "CompileFallbackWarning",
    "LaunchError",
    "Layout",
    "Mesh",
    "NamedSharding",
    "NonFiniteGradError",
    "P",
    "PeakMemory",
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
    "check_batch_rows",
    "checkpoint",
    "comms",
    "constrain",
    "current",
    "default_token_count",
    "describe_layout",
    "einsum",
    "embedding",
    "from_callback",
    "gather",
    "init",
    "launch",
    "layouts",
    "logical_to_spec",
    "logical_to_specs",
    "maybe_disable_local_tensor_mode",
    "memory",
    "module_tp",
    "nll",
    "param_specs",
    "partial_axes",
    "peak_memory",
    "per_rank",
    "pipeline",
    "plan",
    "planner",
    "pmean",
    "ppermute",
    "psum",
    "psum_scatter",
    "rank_map",
    "reshard",
    "resolve",
    "shard",
    "shard_map",
    "sharding_error",
    "simulate",
    "simulated",
    "simulated_calls",
    "spec_of",
    "testing",
    "train_step",
    "unwrap",
    "use",
    "visualize",
]
