"""The private torch names shardlab uses, found in one place, with stand-ins where the installed torch lacks them.

torch >= 2.11 is enough for one device and for real processes (:func:`shardings.launch`): those paths need
only what every such torch has, under the names below (functional collectives renamed in 2.13 included).
Simulated ranks (:func:`shardings.simulate`: ``LocalTensorMode`` over the ``"fake"`` process group) need
private names that torch 2.13 has (2.11 lacks ``rank_map``). Where any is missing, ``HAS_SIMULATION`` is
false, ``simulate`` raises :class:`SimulationUnavailable` naming both versions, and the stand-ins below keep
every other path as it was: with no simulated ranks there is no ``LocalTensor`` and no ``LocalTensorMode``.

Every other private torch name shardlab uses (DTensor's internals, the dispatch-mode base, the pytree module
``core.tree`` wraps, functional collectives) is imported here too, and from here everywhere else
(``tests/test_architecture.py`` checks it): a torch release that moves one is fixed in this file. Every layer of
``shardings`` may import this module; it imports nothing of ``shardings`` but ``spec.errors``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode  # shapes without data: the planner's steps (torch >= 2.11)
from torch.distributed.distributed_c10d import _resolve_process_group as resolve_process_group
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, RuntimeSchemaInfo
from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.debug import _clear_sharding_prop_cache as clear_sharding_prop_cache
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._python_dispatch import _disable_current_modes as disable_current_modes  # a compiled graph's call

from shardings.spec.errors import sharding_error

__all__ = [
    "AOT_RUNTIME_MODULE",
    "DTENSOR_GLOBAL_TENSOR_INFO",
    "HAS_SIMULATION",
    "MISSING",
    "SIMULATION_MODULES",
    "SIMULATION_TORCH",
    "DTensorSpec",
    "FakeStore",
    "FakeTensorMode",
    "LocalIntNode",
    "LocalTensor",
    "LocalTensorMode",
    "OpSchema",
    "OpSpec",
    "OpStrategy",
    "RuntimeSchemaInfo",
    "SimulationUnavailable",
    "StridedShard",
    "TensorMeta",
    "TorchDispatchMode",
    "all_gather_single",
    "aot_config_patch",
    "c10d_functional_op",
    "clear_sharding_prop_cache",
    "compiled_graphs",
    "compute_local_shape_and_global_offset",
    "current_graph_task_id",
    "disable_current_modes",
    "disable_torch_function_subclass",
    "dynamo_config_patch",
    "enabled_local_tensor_mode",
    "expand_to_full_mesh_op_strategy",
    "funcol",
    "global_tensor_info",
    "grad_from_edges",
    "implicit_replication",
    "inductor_with",
    "is_traceable_wrapper_subclass",
    "maybe_disable_local_tensor_mode",
    "maybe_run_for_local_tensor",
    "pytree",
    "rank_map",
    "reduce_scatter_single",
    "require_simulation",
    "resolve_process_group",
    "substitute_in_graph",
    "suggest_memory_format",
    "unavailable",
]

SIMULATION_TORCH = "2.13"  # the oldest torch with every name below (the one the suite runs on)
_WANTED = {  # module -> the names simulated ranks take from it
    "torch.distributed._local_tensor": (
        "LocalIntNode",
        "LocalTensor",
        "LocalTensorMode",
        "enabled_local_tensor_mode",
        "maybe_disable_local_tensor_mode",
        "maybe_run_for_local_tensor",
        "rank_map",
    ),
    "torch.testing._internal.distributed.fake_pg": ("FakeStore",),  # importing it registers the "fake" backend
}
SIMULATION_MODULES = frozenset(_WANTED)


class SimulationUnavailable(RuntimeError):
    """Simulated ranks were asked for, and the installed torch lacks what they need."""


def _lookup(wanted: dict[str, tuple[str, ...]]) -> tuple[dict[str, Any], list[str]]:
    """The names of ``wanted`` that exist (name -> object) and the dotted paths of those that do not."""
    found, missing = {}, []
    for module_name, names in wanted.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            module = None
        for name in names:
            if hasattr(module, name):
                found[name] = getattr(module, name)
            else:
                missing.append(f"{module_name}.{name}")
    return found, missing


_FOUND, MISSING = _lookup(_WANTED)
HAS_SIMULATION = not MISSING


def unavailable(what: str, missing: list[str] | None = None, installed: str | None = None) -> SimulationUnavailable:
    """The error for ``what`` needing simulated ranks on a torch that lacks the ``missing`` names (built, not raised):
    by default this torch's version and the names it lacks.

    >>> str(unavailable("shardings.simulate", ["torch.distributed._local_tensor.rank_map"], "2.11.0")).split(". Fix")[0]
    'shardings.simulate needs torch >= 2.13 (torch.distributed._local_tensor.rank_map); installed: 2.11.0'
    """
    return sharding_error(
        f"{what} needs torch >= {SIMULATION_TORCH} ({', '.join(MISSING if missing is None else missing)}); "
        f"installed: {installed or torch.__version__}",
        fix=f"install torch>={SIMULATION_TORCH} (`make install` brings the CPU wheel), or run real ranks with "
        "shardings.launch (gloo) or torchrun",
        cls=SimulationUnavailable,
    )


def require_simulation(what: str) -> None:
    """Raise :class:`SimulationUnavailable` for ``what`` unless the installed torch can simulate ranks."""
    if not HAS_SIMULATION:
        raise unavailable(what)


class _Unavailable:
    """Stands in for a class this torch lacks: nothing is an instance of it, and making one raises."""

    _name = "?"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise unavailable(self._name)


def _stand_in(name: str) -> type:
    return type(name, (_Unavailable,), {"_name": f"torch.distributed._local_tensor.{name}", "__module__": __name__})


def _no_local_tensor_mode() -> None:
    return None


def _run_as_is(func: Callable) -> Callable:
    return func


def _rank_map(cb: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """torch 2.13's ``rank_map`` outside simulated ranks: ``cb`` of this process's rank."""
    if enabled_local_tensor_mode() is not None:  # a LocalTensorMode entered by hand, on a torch that can't simulate
        raise unavailable("rank_map under LocalTensorMode")
    return cb(dist.get_rank())


def _fake_store(*args: Any, **kwargs: Any) -> Any:
    raise unavailable("the fake process group (torch.testing._internal.distributed.fake_pg.FakeStore)")


LocalIntNode: type = _FOUND.get("LocalIntNode") or _stand_in("LocalIntNode")
LocalTensor: type = _FOUND.get("LocalTensor") or _stand_in("LocalTensor")
LocalTensorMode: type = _FOUND.get("LocalTensorMode") or _stand_in("LocalTensorMode")
enabled_local_tensor_mode: Callable[[], Any] = _FOUND.get("enabled_local_tensor_mode", _no_local_tensor_mode)
maybe_disable_local_tensor_mode: Callable[[], contextlib.AbstractContextManager] = _FOUND.get(
    "maybe_disable_local_tensor_mode", contextlib.nullcontext
)
maybe_run_for_local_tensor: Callable[[Callable], Callable] = _FOUND.get("maybe_run_for_local_tensor", _run_as_is)
rank_map: Callable[[Callable[[int], torch.Tensor]], torch.Tensor] = _FOUND.get("rank_map", _rank_map)
FakeStore: Callable[..., Any] = _FOUND.get("FakeStore", _fake_store)


def c10d_functional_op(name: str) -> Any:
    """``torch.ops._c10d_functional.<name>``, or ``None`` where this torch has no such op (``isend`` and
    ``batch_p2p_ops`` are new in 2.13): an op torch lacks is never dispatched, so there is nothing to count."""
    return getattr(torch.ops._c10d_functional, name, None)


# Renamed in 2.13 (the 2.11 names still work there, with a FutureWarning). Same ops on dim 0; 2.11's gather
# wants a contiguous input, which every caller passes.
all_gather_single: Callable[..., torch.Tensor] = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
reduce_scatter_single: Callable[..., torch.Tensor] = (
    getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
)


@contextlib.contextmanager
def implicit_replication() -> Iterator[None]:
    """Inside, a plain tensor that meets a DTensor in an op is taken as replicated on the DTensor's mesh.

    ``torch.distributed.tensor.experimental.implicit_replication``'s flag (DTensor's op dispatcher's, per thread),
    made re-entrant: the experimental context sets it to False on exit, even inside an outer one; this restores
    what it found. Its limit, as torch warns: the plain tensor must hold the same value on every rank (a constant
    made from shapes — a mask, ``arange`` — does; a rank's own data does not), and only ops with a DTensor
    argument see it (two plain tensors stay plain).
    """
    dispatcher = DTensor._op_dispatcher
    before = dispatcher._allow_implicit_replication
    dispatcher._allow_implicit_replication = True
    try:
        yield
    finally:
        dispatcher._allow_implicit_replication = before


def grad_from_edges(edges: Any, inputs: Any, grads: Any) -> tuple[torch.Tensor | None, ...]:
    """``torch.autograd.grad(edges, inputs, grads, allow_unused=True)`` from ``GradientEdge`` outputs (a zero-bubble
    schedule's ``W``), with a clear error where torch cannot.

    torch 2.11's ``autograd.grad`` reads each edge's ``node._input_metadata``, which a custom ``autograd.Function``'s
    node refuses there (a "legacy access pattern" error; 2.13 allows it), and its engine, called directly, does not
    restart from several such edges either (measured with ``make test-torch211``).

    Raises:
        ShardingError: on such a torch, naming the version and the schedules that work there.
    """
    try:
        return torch.autograd.grad(edges, inputs, grads, allow_unused=True)
    except RuntimeError as e:
        if "_input_metadata" not in str(e):
            raise
        raise sharding_error(
            f"a zero-bubble schedule's W (the weight gradients, restarted from the nodes its B recorded) needs torch "
            f">= {SIMULATION_TORCH} when the model has custom autograd Functions; installed: {torch.__version__}",
            fix="use gpipe, 1f1b or interleaved_1f1b on this torch, or install torch>=2.13", cls=RuntimeError,
        ) from e


# -- private torch reached by attribute: each checked on torch 2.11 and 2.13, with a fallback or a clear error --------

AOT_RUNTIME_MODULE = "torch._functorch._aot_autograd.runtime_wrappers"  # a compiled graph's backward node's module


def aot_config_patch(**settings: Any) -> contextlib.AbstractContextManager:
    """``torch._functorch.config.patch(**settings)`` (AOTAutograd's settings); where this torch lacks the module or a
    setting, nothing is patched (a torch without the setting has no such check to relax)."""
    config = getattr(getattr(torch, "_functorch", None), "config", None)
    if config is None or not all(hasattr(config, k) for k in settings):
        return contextlib.nullcontext()
    return config.patch(**settings)


def compiled_graphs() -> int:
    """Graphs dynamo compiled in this process so far (``torch._dynamo.utils.counters["stats"]["unique_graphs"]``; each
    one's backward is compiled with it by AOTAutograd)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def dynamo_config_patch(**settings: Any) -> contextlib.AbstractContextManager:
    """``torch._dynamo.config.patch(**settings)``; where this torch lacks a setting, nothing is patched."""
    config = torch._dynamo.config
    if not all(hasattr(config, k) for k in settings):
        return contextlib.nullcontext()
    return config.patch(**settings)


def inductor_cache_dir() -> str:
    """``torch._inductor.runtime.cache_dir_utils.cache_dir()``: the directory inductor's on-disk caches (FX graph,
    AOTAutograd, kernels) live under, ``TORCHINDUCTOR_CACHE_DIR`` when set, read at each use."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


def inductor_with(decompositions: dict[Any, Callable]) -> Callable:
    """A ``torch.compile`` backend: inductor (``torch._inductor.compile_fx.compile_fx``, what ``backend="inductor"``
    runs) with ``decompositions`` in place of its own for those ops; each is given inductor's own decomposition of
    its op first (``torch._inductor.decomposition.select_decomp_table()``, read at each compile). Checked on torch
    2.13.

    The table is handed over as a :class:`_DecompTable`, which pickles by reference: inductor keys its FX graph cache
    (and so the AOTAutograd cache) on the pickled table, and 612 of its own 1101 entries do not pickle, which made
    every compile bypass both caches (``fxgraph_cache_bypass``: a warm run lowered every graph again)."""
    from torch._inductor.compile_fx import compile_fx

    items = tuple((str(op), fn) for op, fn in decompositions.items())  # "aten.cat.default": an op does not pickle
    digest = hashlib.sha256("".join(inspect.getsource(fn) for _, fn in items).encode()).hexdigest()

    def compile(gm: Any, example_inputs: Any) -> Any:
        return compile_fx(gm, example_inputs, decompositions=_decomp_table(items, digest))

    return compile


class _DecompTable(dict):
    """Inductor's decomposition table with ours (:func:`inductor_with`), pickled as the recipe that rebuilds it:
    our decompositions by op name and reference, and a digest of their source (a changed one misses the cache)."""

    def __init__(self, table: dict, recipe: tuple) -> None:
        super().__init__(table)
        self.recipe = recipe

    def __reduce__(self) -> tuple:
        return _decomp_table, self.recipe


def _decomp_table(items: tuple, digest: str) -> _DecompTable:
    from torch._inductor.decomposition import select_decomp_table

    table = select_decomp_table()
    ops = {name: functools.reduce(getattr, name.split("."), torch.ops) for name, _ in items}
    ours = {ops[name]: functools.partial(fn, table[ops[name]]) for name, fn in items if ops[name] in table}
    return _DecompTable({**table, **ours}, (items, digest))


def suggest_memory_format(x: torch.Tensor) -> torch.memory_format:
    """``torch._prims_common.suggest_memory_format``: the layout an op whose kernel follows its input's memory format
    (``aten.cat``, ``clone``) gives its result. Checked on torch 2.13."""
    from torch._prims_common import suggest_memory_format as suggest

    return suggest(x)


def disable_torch_function_subclass() -> contextlib.AbstractContextManager:
    """``torch._C.DisableTorchFunctionSubclass()``: a ``__torch_function__`` subclass's call runs torch's own."""
    return torch._C.DisableTorchFunctionSubclass()


def current_graph_task_id() -> int:
    """``torch._C._current_graph_task_id()``: -1 outside a backward pass (autograd's engine), else its task's id;
    -1 where this torch lacks it (then a recomputation in backward is not told apart)."""
    get = getattr(torch._C, "_current_graph_task_id", None)
    return get() if get is not None else -1


def substitute_in_graph(original: Any, **kwargs: Any) -> Callable[[Callable], Callable]:
    """``torch._dynamo.decorators.substitute_in_graph(original)``: what dynamo traces in place of a C function it
    cannot; where this torch lacks either (``original`` is ``None``), the function is left as it is."""
    decorators = getattr(torch._dynamo, "decorators", None)
    if original is None or decorators is None or not hasattr(decorators, "substitute_in_graph"):
        return lambda fn: fn
    return decorators.substitute_in_graph(original, **kwargs)


DTENSOR_GLOBAL_TENSOR_INFO = getattr(torch._C, "_DTensor_compute_global_tensor_info", None)  # C in torch 2.13


@substitute_in_graph(DTENSOR_GLOBAL_TENSOR_INFO, skip_signature_check=True)
def global_tensor_info(tensor: torch.Tensor, mesh: Any, placements: Any) -> tuple[list[int], list[int]]:
    """What dynamo runs for DTensor's ``compute_global_tensor_info``: the global shape and stride of a local
    block. torch 2.13 made it a C function, which dynamo cannot trace, and calls it in the backward of
    ``DTensor.to_local`` and in ``DTensor.from_local`` without ``shape``: each such call in a compiled block was a
    graph break (findings §2). This is the Python version torch had before (Shard, Replicate, Partial). Checked
    on torch 2.13; a torch without the C function traces its own Python one and this is not installed."""
    shape, stride = list(tensor.size()), list(tensor.stride())
    for m, placement in enumerate(placements):
        n = mesh.size(m)
        if placement.is_shard():
            dim = placement.dim
            shape[dim] *= n
            stride = [s * n if i != dim and s >= stride[dim] else s for i, s in enumerate(stride)]
        elif not (placement.is_replicate() or placement.is_partial()):
            raise RuntimeError(f"placement type {type(placement)} not supported!")
    return shape, stride
_LOOP_NAMES = ("_for_each_rank_run_func", "_map_to_rank_local_val", "_get_rng_state", "_set_rng_state",
               "_is_inplace_op", "_combine_rank_results", "return_and_correct_aliasing", "AsyncCollectiveTensor",
               "enabled_local_tensor_mode", "OpOverload", "LocalTensor", "_compute_local_tensor_meta",
               "_get_extra_dispatch_keys", "LocalTensorMode", "_check_for_subclass_arg", "_zero_sized_like")


def local_tensor_internals() -> Any:
    """torch 2.13's ``LocalTensorMode`` per-rank loop and the helpers it calls (``module``: the module itself, whose
    ``_for_each_rank_run_func`` :mod:`shardings.runtime.fastlocal` replaces inside ``simulate``); ``None`` where this
    torch lacks any of them (then torch's own loop runs)."""
    import types

    module = importlib.import_module("torch.distributed._local_tensor") if HAS_SIMULATION else None
    if module is None or not all(hasattr(module, n) for n in _LOOP_NAMES):
        return None
    return types.SimpleNamespace(module=module, **{n: getattr(module, n) for n in _LOOP_NAMES})


def python_mode_stack() -> list[Any]:
    """The Python dispatch modes active now, innermost last (``torch.utils._python_dispatch``'s private stack)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return _get_current_dispatch_mode_stack()


# -- DTensor's redistribution planner on a _StridedShard, traced (torch 2.13) ---------------------------------------
# A flattened dim whose inner part is split (``torch.einsum``'s decomposition flattens ``(h, d)`` as ``(d, h)``:
# ``"bshd,hde->bse"`` with heads split on tp) is a ``_StridedShard``. On a mesh of 2+ dims, pricing a redistribution
# of it (the sharding strategy's costs: every candidate is priced) asks ``get_logical_shape`` for its local size,
# which torch 2.13 computes with the default ``offset_mode=FIRST``: the offsets' ``.tolist()`` on the fake tensors
# dynamo traces with makes an unbacked SymInt per element, found in no output, and dynamo refused the whole op
# (``PendingUnbackedSymbolNotFound``: zoo models under zero3+tp+sp with jit=True). The planner uses the size only;
# this is torch's own method asking for no offsets (``_StridedShardOffsetMode.NONE``, which exists for exactly this).

_redistribute = importlib.import_module("torch.distributed.tensor._redistribute")
_placement_types = importlib.import_module("torch.distributed.tensor.placement_types")
_PLANNER = getattr(_redistribute, "DTensorRedistributePlanner", None)
_NO_OFFSETS = getattr(getattr(_placement_types, "_StridedShardOffsetMode", None), "NONE", None)
TORCH_LOGICAL_SHAPE = getattr(_PLANNER, "get_logical_shape", None)  # torch's method, before the one below


def logical_shape_without_offsets(self: Any, src_state: Any, mesh_dim: int, full_tensor_shape: tuple[int, ...]) -> list:
    """``DTensorRedistributePlanner.get_logical_shape``: the tensor's shape as mesh dim ``mesh_dim`` sees it, every
    other mesh dim's split applied (torch 2.13's, with no offsets computed for a ``_StridedShard``)."""
    shape: list = list(full_tensor_shape)
    for entry in src_state.tensor_dim_to_mesh_dim:
        for mdim in entry.mesh_dims:
            if mdim == mesh_dim:
                continue
            placement = src_state.placements[mdim]
            args = (shape[entry.tensor_dim], self.device_mesh.size(mesh_dim=mdim),
                    self.device_mesh._sym_get_coordinate(mdim))
            if isinstance(placement, StridedShard):
                size, _ = placement.local_shard_size_and_offset(*args, offset_mode=_NO_OFFSETS)
            elif isinstance(placement, _placement_types.Shard):
                size, _ = placement.local_shard_size_and_offset(*args)
            else:
                raise ValueError(f"Unsupported placement type: {placement}")
            shape[entry.tensor_dim] = size
    return shape


if TORCH_LOGICAL_SHAPE is not None and _NO_OFFSETS is not None:  # else this torch has neither the method nor the bug
    _PLANNER.get_logical_shape = logical_shape_without_offsets
