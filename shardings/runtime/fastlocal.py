"""A cheaper per-rank loop for simulated ranks: torch 2.13's ``_for_each_rank_run_func``, same results.

Profiled (``experiments.bench.simulate``, cProfile of check_equivalence of zero3+tp+sp+pp on 8 ranks, 27M Python
calls): ``torch.utils._pytree`` inside ``LocalTensorMode``'s per-op loop — the op's arguments unflattened once *per
rank* (663,934 ``unflatten`` calls, ~17% of the profile) — and saving/restoring the RNG state around every rank's
call of every op, random or not (143,199 ``get_state`` calls). This loop does the same work without either:

* each rank's arguments are built by a direct walk of the (tuple, list, dict) nesting aten arguments have,
  each leaf mapped exactly as torch maps it (``_map_to_rank_local_val``);
* the RNG state is saved/restored per rank only for ops that can draw random numbers (tagged
  ``nondeterministic_seeded``, or not an ``OpOverload`` at all); any other op leaves the generators as they
  are, so the state torch would restore is the state they already hold.

**Equal ranks computed once.** Every op still ran once per simulated rank, most of it Python. But an aten op
(not a random one) is a pure function of its arguments, so ranks whose arguments are the *same objects* (each
``LocalTensor``'s rank tensor the same tensor, each rank-dependent int equal) get one call, and its result is that
one tensor on all of them (:func:`_groups`). Sharing propagates: pipeline stages that every ``pp`` coordinate runs,
replicated parameters, activations after a gather. It starts at factories (``zeros``: one tensor for every rank) and
at collectives, whose equal results (the same bits) are merged (:func:`_merge_equal`). Writes stay exact:

* before an op writes a ``LocalTensor`` whose classes of ranks are split by the op's other arguments (a shared
  ``zeros`` accumulator, each rank adding its own gradient), each class gets its own copy of the tensor
  (:func:`_unshare`); a tensor that something else views (storage use count, reference count) is written on
  copies and then once into itself when all classes computed the same bits, else the op raises (never a silent
  wrong value); the in-place collectives give each rank its own output first;
* an op that writes a plain tensor, a random op, and every op while another Python dispatch mode sees the ops
  (a memory counter counts each storage once: sharing would change its sums) run once per rank, as before.

The sharing is opt-in, ``SHARDLAB_SIMULATE_SHARE=1`` (the loop above runs without it): with it on, 38 tests of the
suite failed at integration (a shared tensor's storage freed under a Partial's reduction, "access the data pointer
on an invalid python storage"), so it stays off by default until those pass. Metadata queries (``sym_stride``,
``sym_storage_offset``, ``sym_numel``: most dispatched ops) are read off each distinct tensor without dispatch.
:data:`CALLS` counts ops and rank calls (a measure of the work that does not depend on the machine's load).

Everything else (in-place ops, split's padding, aliasing, combining the ranks' results) is torch's own code,
called as torch calls it. :func:`installed` puts the loop in place for the body of :func:`shardings.simulate`
and restores torch's on exit; ``SHARDLAB_SIMULATE_FAST=0`` keeps torch's (the A/B switch of the bench).
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from shardings.runtime.compat import (
    disable_current_modes,
    local_tensor_internals,
    python_mode_stack,
    storage_use_count,
)

__all__ = ["CALLS", "installed", "rank_map"]

_lt = local_tensor_internals()
_SEEDED = torch.Tag.nondeterministic_seeded
_random_cache: dict[Any, bool] = {}
_writes_cache: dict[Any, tuple[tuple[int, str], ...]] = {}
CALLS = collections.Counter()  # "rank_ops": ops x ranks through the loop, "calls": the calls it made for them
_SHARE = [False]  # SHARDLAB_SIMULATE_SHARE=1: equal ranks computed once (installed() sets it)


def _draws_random(func: Any) -> bool:
    """Whether ``func`` may read or advance a random generator (unknown callables: assumed to)."""
    hit = _random_cache.get(func)
    if hit is None:
        hit = not isinstance(func, _lt.OpOverload) or _SEEDED in func.tags
        _random_cache[func] = hit
    return hit


def _to_rank(x: Any, r: int, leaf: Any) -> Any:
    """``x`` with every leaf mapped by ``leaf(v, r)``, through the tuples, lists and dicts aten arguments use."""
    t = type(x)
    if t is tuple or t is list:
        return t(_to_rank(v, r, leaf) for v in x)
    if t is dict:
        return {k: _to_rank(v, r, leaf) for k, v in x.items()}
    return leaf(x, r)


def _plain(x: Any) -> bool:
    """Only tuples, lists, dicts and leaves (no named tuple or other pytree node that ``_to_rank`` would miss)."""
    t = type(x)
    if t is tuple or t is list:
        return all(_plain(v) for v in x)
    if t is dict:
        return all(_plain(v) for v in x.values())
    return not isinstance(x, (tuple, list, dict, _lt.AsyncCollectiveTensor))  # torch waits on those first


def _written(func: Any) -> tuple[tuple[int, str], ...]:
    """The (position, name) of each argument ``func`` writes (``Tensor(a!)``: in-place ``self``, ``out=``)."""
    hit = _writes_cache.get(func)
    if hit is None:
        hit = tuple((i, a.name) for i, a in enumerate(func._schema.arguments)
                    if a.alias_info is not None and a.alias_info.is_write)
        _writes_cache[func] = hit
    return hit


def _collect(x: Any, tensors: list[dict], ints: list[dict]) -> None:
    """The per-rank dicts in ``x``: each ``LocalTensor``'s tensors, each rank-dependent int's values."""
    t = type(x)
    if t is tuple or t is list:
        for v in x:
            _collect(v, tensors, ints)
    elif t is dict:
        for v in x.values():
            _collect(v, tensors, ints)
    elif isinstance(x, _lt.LocalTensor):
        tensors.append(x._local_tensors)
    elif isinstance(x, torch.SymInt) and isinstance(x.node, _lt.LocalIntNode):
        ints.append(x.node._local_ints)


def _groups(ranks: frozenset[int], args: Any, kwargs: Any) -> list[list[int]]:
    """The ranks in classes whose arguments are the same: the same tensor objects, the same ints. An op is a pure
    function of its arguments, so one call serves a class (a rank's arguments are otherwise only shared values)."""
    tensors: list[dict] = []
    ints: list[dict] = []
    _collect(args, tensors, ints)
    _collect(kwargs, tensors, ints)
    order = sorted(ranks)
    if not tensors and not ints:
        return [order]
    classes: dict[tuple, list[int]] = {}
    for r in order:
        key = (*[id(d[r]) for d in tensors], *[d[r] for d in ints])
        members = classes.get(key)
        if members is None:
            classes[key] = [r]
        else:
            members.append(r)
    return list(classes.values())


def _observed() -> bool:
    """Whether a Python dispatch mode other than ``LocalTensorMode`` sees this op (a memory counter counts each
    storage once: shared tensors would change its sums), so nothing is shared. Below us: the mode stack; above us:
    a ``__torch_dispatch__`` frame among the few that lead here (dynamo's wrappers sit between them)."""
    if python_mode_stack():
        return True
    f = sys._getframe(2)
    for _ in range(8):
        if f is None:
            return False
        if f.f_code.co_name == "__torch_dispatch__" and f.f_code not in _OURS:
            return True
        f = f.f_back
    return False


def _shared_copy(t: torch.Tensor) -> torch.Tensor:
    """A tensor on a copy of ``t``'s storage with ``t``'s exact geometry (offset, sizes, strides)."""
    return torch.empty((0,), dtype=t.dtype, device=t.device).set_(
        t.untyped_storage().clone(), t.storage_offset(), t.size(), t.stride())


def _unshare(func: Any, local: dict[int, torch.Tensor], groups: list[list[int]], pending: list) -> None:
    """Copy-on-write: before ``func`` writes ``local`` (one LocalTensor's tensors) class by class, give each class
    its own tensor where classes share one. A tensor nothing else views is simply copied. One that is viewed (a
    copy would hide the write from its views) is written on copies too, listed in ``pending``: :func:`_settle`
    writes the result back into it when every class computed the same bits, and raises otherwise."""
    owner: dict[int, int] = {}  # id(tensor) -> class index
    storage: dict[int, int] = {}  # storage address -> id(tensor)
    viewed: dict[int, list] = {}  # id(tensor) -> its pending entry
    for i, members in enumerate(groups):
        t = local[members[0]]
        first = owner.setdefault(id(t), i)
        if first == i:
            if t.untyped_storage().nbytes() and storage.setdefault(t.untyped_storage().data_ptr(), id(t)) != id(t):
                raise _conflict(func, "two views of one storage")
            continue
        entry = viewed.get(id(t))
        if entry is None:
            holders = sum(v is t for v in local.values())
            if storage_use_count(t) == 2 and sys.getrefcount(t) == holders + 2:  # + t here, + getrefcount's
                _rebind(local, members, _shared_copy(t))
                continue
            entry = viewed[id(t)] = [local, t, [groups[first]]]
            pending.append(entry)
            _rebind(local, groups[first], _shared_copy(t))
        entry[2].append(members)
        _rebind(local, members, _shared_copy(t))


def _rebind(local: dict[int, torch.Tensor], members: list[int], t: torch.Tensor) -> None:
    for r in members:
        local[r] = t


def _settle(func: Any, pending: list) -> None:
    """Each viewed tensor that :func:`_unshare` had written on copies: the classes' copies hold the same bits
    (the same inputs), so it is written once, and its ranks hold it again; else an error (nothing written to it)."""
    for local, t, classes in pending:
        copies = [local[members[0]] for members in classes]
        same = copies[0].size() == t.size() and copies[0].stride() == t.stride() \
            and all(_same_bits(copies[0], c) for c in copies[1:])
        for members in classes:
            _rebind(local, members, t)
        if not same:
            raise _conflict(func, "different values into a tensor that other tensors view")
        t.copy_(copies[0])


def _conflict(func: Any, what: str) -> RuntimeError:
    return RuntimeError(f"simulated ranks: {func} writes {what} that ranks with different arguments share "
                        "(shardings.runtime.fastlocal computes equal ranks once). Fix: run with "
                        "SHARDLAB_SIMULATE_SHARE=0 and report this op")


_aten = torch.ops.aten
_META = {_aten.sym_stride.default: torch.Tensor.stride, _aten.sym_storage_offset.default: torch.Tensor.storage_offset,
         _aten.sym_numel.default: torch.Tensor.numel}  # each rank's answer read off its tensor, not dispatched


def _meta(read: Any, local: dict[int, torch.Tensor]) -> Any:
    """``read`` of each rank's tensor, once per distinct tensor, combined as torch combines the ranks' results."""
    seen: dict[int, Any] = {}
    out = {}
    for r, t in local.items():
        v = seen.get(id(t))
        out[r] = v if v is not None else seen.setdefault(id(t), read(t))
    return _lt._combine_rank_results(out, None)


def _run(func: Any, ranks: frozenset[int], args: Sequence[Any], kwargs: dict[str, Any], *, alias: bool = True) -> Any:
    read = _META.get(func)
    if read is not None and not kwargs and len(args) == 1 and type(args[0]) is _lt.LocalTensor \
            and args[0]._ranks == ranks:
        return _meta(read, args[0]._local_tensors)
    if func is torch.ops.aten.split.Tensor or func is torch.ops.aten.hash_tensor.default or not _plain((args, kwargs)):
        return _ORIGINAL(func, ranks, args, kwargs, alias=alias)
    random = _draws_random(func)
    written = [] if random else [w for i, name in _written(func)
                                 for w in _listed(args[i] if i < len(args) else kwargs.get(name))]
    if random or not _SHARE[0] or _observed() or any(type(w) is not _lt.LocalTensor for w in written):
        groups = [[r] for r in sorted(ranks)]  # a plain tensor written: once per rank, as torch does
    else:
        groups = _groups(ranks, args, kwargs)
    pending: list = []
    if len(groups) > 1 and _SHARE[0]:  # without sharing nothing was shared: torch's own aliasing stands
        for w in written:
            if type(w) is _lt.LocalTensor:
                _unshare(func, w._local_tensors, groups, pending)
    flat_rank_rets = _call(func, groups, args, kwargs, random)
    _settle(func, pending)
    CALLS["rank_ops"] += len(flat_rank_rets)
    CALLS["calls"] += len(groups)
    if _lt._is_inplace_op(func):
        ret = args[0]
        if isinstance(func, _lt.OpOverload) and torch.Tag.inplace_view in func.tags:
            ret._sync_meta()
        return ret
    ret = _lt._combine_rank_results(flat_rank_rets, None)
    return _lt.return_and_correct_aliasing(func, args, kwargs, ret) if alias else ret


def _listed(x: Any) -> list[Any]:
    """The tensors in a written argument (``Tensor(a!)`` or ``Tensor(a!)[]``; ``None`` for an absent ``out``)."""
    return [v for v in x if isinstance(v, torch.Tensor)] if isinstance(x, (list, tuple)) else \
        [x] if isinstance(x, torch.Tensor) else []


def _call(func: Any, groups: list[list[int]], args: Sequence[Any], kwargs: dict[str, Any], random: bool) -> dict:
    """Each class's result, computed once on its first rank's arguments, for every rank (in rank order)."""
    lm = _lt.enabled_local_tensor_mode()
    use_per_rank_rng = lm is not None and len(lm._per_rank_rng_states) > 0
    global_rng_state = _lt._get_rng_state() if random and not use_per_rank_rng else None
    leaf = _lt._map_to_rank_local_val
    flat_rank_rets = {}
    for members in groups:
        r = members[0]
        if random:
            if use_per_rank_rng:
                if r in lm._per_rank_rng_states:
                    _lt._set_rng_state(*lm._per_rank_rng_states[r])
            else:
                _lt._set_rng_state(*global_rng_state)
        rank_args, rank_kwargs = _to_rank(tuple(args), r, leaf), _to_rank(kwargs, r, leaf)
        ret = func(*rank_args, **rank_kwargs)
        for m in members:
            flat_rank_rets[m] = ret
        if random and use_per_rank_rng:
            lm._per_rank_rng_states[r] = _lt._get_rng_state()
    if 1 < len(groups) < len(flat_rank_rets):
        flat_rank_rets = {r: flat_rank_rets[r] for r in sorted(flat_rank_rets)}
    return flat_rank_rets


_ORIGINAL = _lt._for_each_rank_run_func if _lt is not None else None


_TORCH_META = _lt.module._compute_local_tensor_meta if _lt is not None else None


def _local_meta(local_tensors: dict[int, torch.Tensor]) -> Any:
    """torch's ``_compute_local_tensor_meta`` (a new ``LocalTensor``'s sizes, strides, dtype...: a Python loop over
    ranks and dims) over the distinct tensors only, when ranks share them and every size and stride agrees."""
    distinct = {}
    for r, t in local_tensors.items():
        distinct.setdefault(id(t), (r, t))
    if len(distinct) == len(local_tensors):
        return _TORCH_META(local_tensors)
    meta = _TORCH_META(dict(distinct.values()))
    if any(isinstance(v, torch.SymInt) for v in (*meta[0], *meta[1])):  # sizes differ by rank: every rank's
        return _TORCH_META(local_tensors)
    return meta


_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` hold the same bits in the same geometry (-0.0 is not 0.0, a NaN equals its own bits)."""
    if a.shape != b.shape or a.stride() != b.stride() or a.dtype != b.dtype or a.dtype.is_complex:
        return False
    if a.dtype.is_floating_point:
        bits = _BITS[a.element_size()]
        return torch.equal(a.view(bits), b.view(bits))
    return torch.equal(a, b)


def _merge_equal(local: dict[int, torch.Tensor]) -> None:
    """Ranks of ``local`` (a collective's fresh results) whose tensors hold the same bits share one tensor, so the
    ops after it run once for them. A tensor is replaced only where nothing else holds or views it."""
    holders = collections.Counter(map(id, local.values()))  # (no loop variable left holding the last tensor)
    reps: list[torch.Tensor] = []
    for r in list(local):  # not items(): its iterator would hold a reference to each tensor
        t = local[r]
        for c in reversed(reps):
            if c is t:
                break
            if _same_bits(c, t):
                if storage_use_count(t) == 2 and sys.getrefcount(t) == holders[id(t)] + 2:  # + t, + the call
                    holders[id(t)] -= 1
                    local[r] = c
                break
        else:
            reps.append(t)


def _collective(fn: Any, *, writes_first: bool) -> Any:
    """``fn`` (one of torch's simulated collectives) with sharing kept: the tensors it writes (its first argument,
    for the in-place ones) get one tensor per rank first, and its results are merged where equal after."""

    def run(*args: Any, **kwargs: Any) -> Any:
        if not _SHARE[0] or _observed():  # run <- LocalTensorMode.__torch_dispatch__ <- the mode above, if any
            return fn(*args, **kwargs)
        outs = [t for t in (args[0] if isinstance(args[0], (list, tuple)) else (args[0],))
                if isinstance(t, _lt.LocalTensor)] if writes_first else []
        pending: list = []
        for t in outs:
            _unshare(fn, t._local_tensors, [[r] for r in t._local_tensors], pending)
        ret = fn(*args, **kwargs)
        _settle(fn, pending)
        for t in outs if writes_first else (ret,):
            _merge_equal(t._local_tensors)
        return ret

    return run


_FUNCTIONAL = ("_local_functional_all_gather_into_tensor", "_local_functional_reduce_scatter_tensor",
               "_local_functional_all_to_all_single", "_local_functional_shard_dim_alltoall")
_IN_PLACE = ("_local_broadcast_", "_local_all_reduce_", "_local_allreduce_coalesced_",
             "_local_reduce_scatter_tensor_coalesced_", "_local_allgather_base_", "_local_reduce_scatter_base_",
             "_local_all_gather_", "_local_allgather_into_tensor_coalesced_", "_local_gather_", "_local_scatter_",
             "_local_alltoall_", "_local_alltoall_base_", "_local_recv_")
# the __torch_dispatch__ frames that lead to _run without another mode in between (under dynamo's disable wrapper)
_OURS = (frozenset({inspect.unwrap(_lt.module.LocalTensorMode.__torch_dispatch__).__code__,
                    inspect.unwrap(_lt.module.LocalTensor.__torch_dispatch__.__func__).__code__})
         if _lt is not None else frozenset())


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """Inside, ``LocalTensorMode`` runs each op's ranks with :func:`_run` (torch's loop again on exit)."""
    off = os.environ.get("SHARDLAB_SIMULATE_FAST", "1") == "0"
    if _lt is None or off or _lt.module._for_each_rank_run_func is _run:
        yield
        return
    _lt.module._for_each_rank_run_func = _run
    _lt.module._compute_local_tensor_meta = _local_meta
    _SHARE[0] = os.environ.get("SHARDLAB_SIMULATE_SHARE", "0") == "1"  # opt-in: see the module docstring
    c10d = _lt._c10d
    saved = {name: getattr(c10d, name) for name in (*_FUNCTIONAL, *_IN_PLACE)}
    for name, fn in saved.items():
        setattr(c10d, name, _collective(fn, writes_first=name in _IN_PLACE))
    try:
        yield
    finally:
        _lt.module._for_each_rank_run_func = _ORIGINAL
        _lt.module._compute_local_tensor_meta = _TORCH_META
        for name, fn in saved.items():
            setattr(c10d, name, fn)


def rank_map(mode: Any, cb: Any) -> Any:
    """``mode.rank_map(cb)``: a ``LocalTensor`` of ``cb(r)`` per rank. When ``mode`` is the only Python dispatch
    mode, ``cb`` runs with no mode at all: torch's ``rank_map`` only flags the mode disabled, and each of ``cb``'s
    plain-tensor ops still enters its ``__torch_dispatch__`` (a pytree flatten, then a plain call) — most of a
    simulated einsum's time. Under any other mode (a memory or comm counter) torch's way, so that mode sees every op.
    """
    if _lt is None or os.environ.get("SHARDLAB_SIMULATE_FAST", "1") == "0" or python_mode_stack() != [mode]:
        return mode.rank_map(cb)
    with mode.disable(), disable_current_modes():
        return _lt.module.LocalTensor({r: cb(r) for r in mode.ranks})
