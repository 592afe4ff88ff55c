"""A cheaper per-rank loop for simulated ranks: torch 2.13's ``_for_each_rank_run_func``, same results.

Profiled (``experiments.bench.simulate``, cProfile of check_equivalence of zero3+tp+sp+pp on 8 ranks, 27M Python
calls): ``torch.utils._pytree`` inside ``LocalTensorMode``'s per-op loop — the op's arguments unflattened once *per
rank* (663,934 ``unflatten`` calls, ~17% of the profile) — and saving/restoring the RNG state around every rank's
call of every op, random or not (143,199 ``get_state`` calls). This loop does the same work without either:

* each rank's arguments are built from one walk per op of the (tuple, list, dict) nesting aten arguments have
  (:func:`_at_rank`): each rank fills in only its own values of the rank-dependent leaves, each mapped exactly as
  torch maps it (``_map_to_rank_local_val``);
* a new ``LocalTensor``'s metadata is read off its first rank's tensor when every rank's agrees (:func:`_local_meta`);
* the RNG state is saved/restored per rank only for ops that can draw random numbers (tagged
  ``nondeterministic_seeded``, or not an ``OpOverload`` at all); any other op leaves the generators as they
  are, so the state torch would restore is the state they already hold.

Metadata queries (``sym_stride``, ``sym_storage_offset``, ``sym_numel``: most dispatched ops) are read off each
rank's tensor without dispatch. :data:`CALLS` counts the ops x ranks through the loop (a measure of the work that
does not depend on the machine's load).

Two entry points before the loop are replaced as well (profiled: gpt_small's simulated training on 4 ranks):

* ``LocalTensorMode.__torch_dispatch__`` flattens every op's arguments with ``torch.utils._pytree`` to find the
  ``LocalTensor`` among them; :func:`_mode_dispatch` walks the plain (tuple, list, dict) nesting aten arguments
  have instead and then does what torch's does for an aten op (its checks, in its order); any other namespace
  (collectives, ``device_mesh``, ``profiler``) or argument structure goes to torch's.
* A view op's aliasing fix-up (``return_and_correct_aliasing``) reads the new ``LocalTensor``'s sizes, strides and
  offset while no ``LocalTensorMode`` is on the dispatch stack, so each read went through
  ``LocalTensor.__torch_dispatch__``, which enters a fresh mode per call: every rank's RNG state cloned, the random
  functions and ``DeviceMesh`` patched and unpatched, for three reads per view op (20% of the profile).
  :func:`_tensor_dispatch` answers those reads of one ``LocalTensor`` as the mode answers them, with no mode.

Not here: computing ranks whose arguments are the same tensor objects once (tried, removed). Sharing one tensor
between ranks makes ranks alias storage they do not alias under torch, and a write through one rank's view (a
Partial's in-place all-reduce, a foreach optimizer write into a flat buffer's views) must then reach exactly the
views of that rank, which are held by tensors (autograd, DTensors, optimizer state) the loop cannot see; with it
on, 36 tests of the suite failed or were refused, and it saved 2-8% of the time at 16-128 ranks.

Everything else (in-place ops, aliasing, combining the ranks' results, with a split's padding made as torch's loop
makes it: :func:`_split_padding`) is torch's own code, called as torch calls it. :func:`installed` puts the loop in
place for the body of :func:`shardings.simulate` and restores torch's on exit; ``SHARDLAB_SIMULATE_FAST=0`` keeps
torch's (the A/B switch of the bench).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from shardings.runtime.compat import disable_current_modes, local_tensor_internals, python_mode_stack

__all__ = ["CALLS", "installed", "rank_map"]

_lt = local_tensor_internals()
_SEEDED = torch.Tag.nondeterministic_seeded
_random_cache: dict[Any, bool] = {}
CALLS = collections.Counter()  # "rank_ops": ops x ranks through the loop


def _draws_random(func: Any) -> bool:
    """Whether ``func`` may read or advance a random generator (unknown callables: assumed to)."""
    hit = _random_cache.get(func)
    if hit is None:
        hit = not isinstance(func, _lt.OpOverload) or _SEEDED in func.tags
        _random_cache[func] = hit
    return hit


def _at_rank(x: Any) -> Callable[[int], Any] | None:
    """``r -> x`` with each leaf mapped as torch maps it (``_map_to_rank_local_val``: a ``LocalTensor`` to rank ``r``'s
    tensor, a per-rank ``SymInt`` to rank ``r``'s int), through the tuples, lists and dicts aten arguments use; built
    once per op, so each rank only fills in its own values. ``None`` when no leaf depends on the rank (``x`` itself,
    the same object, serves every rank)."""
    t = type(x)
    if t is tuple or t is list or t is dict:
        items = x.items() if t is dict else enumerate(x)
        slots = [(k, at) for k, v in items if (at := _at_rank(v)) is not None]
        if not slots:
            return None
        base = dict(x) if t is dict else list(x)

        def fill(r: int) -> Any:
            out = base.copy()
            for k, at in slots:
                out[k] = at(r)
            return tuple(out) if t is tuple else out
        return fill
    if isinstance(x, _lt.LocalTensor):
        return x._local_tensors.__getitem__
    if isinstance(x, torch.SymInt):
        return functools.partial(_lt._map_to_rank_local_val, x)
    return None


def _plain(x: Any, leaves: list[Any] | None = None) -> bool:
    """Only tuples, lists, dicts and leaves (no named tuple or other pytree node that ``_at_rank`` would miss); the
    leaves met are appended to ``leaves`` (all of them when plain)."""
    t = type(x)
    if t is tuple or t is list:
        return all(_plain(v, leaves) for v in x)
    if t is dict:
        return all(_plain(v, leaves) for v in x.values())
    if leaves is not None:
        leaves.append(x)
    return not isinstance(x, (tuple, list, dict, _lt.AsyncCollectiveTensor))  # torch waits on those first


_aten = torch.ops.aten
_META = {_aten.sym_stride.default: torch.Tensor.stride, _aten.sym_storage_offset.default: torch.Tensor.storage_offset,
         _aten.sym_numel.default: torch.Tensor.numel}  # each rank's answer read off its tensor, not dispatched


def _run(func: Any, ranks: frozenset[int], args: Sequence[Any], kwargs: dict[str, Any], *, alias: bool = True,
         plain: bool = False) -> Any:
    """torch's ``_for_each_rank_run_func``; ``plain``: the caller checked ``_plain((args, kwargs))``."""
    read = _META.get(func)
    if read is not None and not kwargs and len(args) == 1 and type(args[0]) is _lt.LocalTensor \
            and args[0]._ranks == ranks:
        return _lt._combine_rank_results({r: read(t) for r, t in args[0]._local_tensors.items()}, None)
    if func is torch.ops.aten.hash_tensor.default or not (plain or _plain((args, kwargs))):
        return _ORIGINAL(func, ranks, args, kwargs, alias=alias)
    order = sorted(ranks)
    flat_rank_rets = _call(func, order, args, kwargs, _draws_random(func))
    CALLS["rank_ops"] += len(flat_rank_rets)
    if _lt._is_inplace_op(func):
        ret = args[0]
        if isinstance(func, _lt.OpOverload) and torch.Tag.inplace_view in func.tags:
            ret._sync_meta()
        return ret
    padding = _split_padding(args, kwargs, order[0]) if func is torch.ops.aten.split.Tensor else None
    ret = _lt._combine_rank_results(flat_rank_rets, padding)
    return _lt.return_and_correct_aliasing(func, args, kwargs, ret) if alias else ret


def _split_padding(args: Sequence[Any], kwargs: dict[str, Any], first: int) -> torch.Tensor:
    """What torch pads a ``split`` with on ranks that got fewer chunks (splitting a dim shorter than the chunks): an
    empty chunk, zero-sized on the split dim (the third argument, positional or not), shaped like the first rank's
    input, as torch's loop makes it."""
    flat = [*args, *kwargs.values()]
    dim = 0 if len(flat) < 3 else _lt._map_to_rank_local_val(flat[2], first)
    return _lt.module._zero_sized_like(_lt._map_to_rank_local_val(args[0], first), dim)


def _call(func: Any, ranks: list[int], args: Sequence[Any], kwargs: dict[str, Any], random: bool) -> dict:
    """Each rank's result of ``func`` on its own arguments, in rank order (the RNG state as torch keeps it)."""
    lm = _lt.enabled_local_tensor_mode()
    use_per_rank_rng = lm is not None and len(lm._per_rank_rng_states) > 0
    global_rng_state = _lt._get_rng_state() if random and not use_per_rank_rng else None
    args = tuple(args)
    args_at, kwargs_at = _at_rank(args), _at_rank(kwargs)
    flat_rank_rets = {}
    for r in ranks:
        if random:
            if use_per_rank_rng:
                if r in lm._per_rank_rng_states:
                    _lt._set_rng_state(*lm._per_rank_rng_states[r])
            else:
                _lt._set_rng_state(*global_rng_state)
        rank_args = args if args_at is None else args_at(r)
        rank_kwargs = kwargs if kwargs_at is None else kwargs_at(r)
        flat_rank_rets[r] = func(*rank_args, **rank_kwargs)
        if random and use_per_rank_rng:
            lm._per_rank_rng_states[r] = _lt._get_rng_state()
    return flat_rank_rets


_SIZE_OPS = {_aten.sym_size.default: lambda t: tuple(t._size), _aten.dim.default: lambda t: len(t._size)}


def _mode_dispatch(self: Any, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict | None = None) -> Any:
    """``LocalTensorMode.__torch_dispatch__`` for an aten op on plain arguments, without the pytree flatten; the
    same checks in the same order (the rest: torch's)."""
    kwargs = kwargs or {}
    flat: list[Any] = []
    if getattr(func, "namespace", None) != "aten" or not _plain((args, kwargs), flat):
        return _TORCH_MODE_DISPATCH(self, func, types, args, kwargs)
    if any(_lt._check_for_subclass_arg(x) for x in flat):
        return _TORCH_MODE_DISPATCH(self, func, types, args, kwargs)  # torch logs it and returns NotImplemented
    local = [a for a in flat if isinstance(a, _lt.LocalTensor)]
    if not local and (self._disable or any(isinstance(a, torch.Tensor) for a in flat)):
        return func(*args, **kwargs)
    if any(a._ranks > self.ranks for a in local):
        return _TORCH_MODE_DISPATCH(self, func, types, args, kwargs)  # torch's error
    size = _SIZE_OPS.get(func)
    if size is not None:
        return size(args[0])
    return _run(func, self.ranks, args, kwargs, alias=True, plain=True)


def _tensor_dispatch(cls: Any, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict | None = None) -> Any:
    """``LocalTensor.__torch_dispatch__`` (no ``LocalTensorMode`` active): a size, stride, offset or numel read of one
    ``LocalTensor`` answered as the fresh mode torch enters would answer it (:func:`_mode_dispatch`, :func:`_run`),
    without entering one; anything else torch's."""
    if not kwargs and len(args) == 1 and type(args[0]) is _lt.LocalTensor:
        size = _SIZE_OPS.get(func)
        if size is not None:
            return size(args[0])
        read = _META.get(func)
        if read is not None:
            return _lt._combine_rank_results({r: read(t) for r, t in args[0]._local_tensors.items()}, None)
    return _TORCH_TENSOR_DISPATCH.__func__(cls, func, types, args, kwargs)


_ORIGINAL = _lt._for_each_rank_run_func if _lt is not None else None
_TORCH_MODE_DISPATCH = _lt.LocalTensorMode.__torch_dispatch__ if _lt is not None else None
_TORCH_TENSOR_DISPATCH = _lt.LocalTensor.__dict__["__torch_dispatch__"] if _lt is not None else None
_TORCH_META = _lt._compute_local_tensor_meta if _lt is not None else None


def _local_meta(local_tensors: dict[int, torch.Tensor]) -> Any:
    """torch's ``_compute_local_tensor_meta`` (a new ``LocalTensor``'s sizes, strides, dtype...), same result: when
    every rank's tensor has the first one's sizes, strides, dtype, layout and conj/neg bits (nearly always), the
    first one's, read once; otherwise torch's own (per-rank sizes as SymInts, its errors). torch's loops over ranks
    x dims in Python, two dispatch-key reads per rank: 17% of a 64-rank check's profile."""
    it = iter(local_tensors.values())
    first = next(it)
    shape, stride, dtype, layout = first.shape, first.stride(), first.dtype, first.layout
    conj, neg = first.is_conj(), first.is_neg()
    for t in it:
        if t.shape != shape or t.stride() != stride or t.dtype != dtype or t.layout != layout \
                or t.is_conj() != conj or t.is_neg() != neg:
            return _TORCH_META(local_tensors)
    return list(shape), list(stride), first.device, dtype, layout, _lt._get_extra_dispatch_keys(first)


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """Inside, ``LocalTensorMode`` runs each op's ranks with :func:`_run` (torch's loop again on exit)."""
    off = os.environ.get("SHARDLAB_SIMULATE_FAST", "1") == "0"
    if _lt is None or off or _lt.module._for_each_rank_run_func is _run:
        yield
        return
    _lt.module._for_each_rank_run_func = _run
    _lt.module._compute_local_tensor_meta = _local_meta
    _lt.LocalTensorMode.__torch_dispatch__ = _mode_dispatch
    _lt.LocalTensor.__torch_dispatch__ = classmethod(torch.compiler.disable(_tensor_dispatch))
    try:
        yield
    finally:
        _lt.module._for_each_rank_run_func = _ORIGINAL
        _lt.module._compute_local_tensor_meta = _TORCH_META
        _lt.LocalTensorMode.__torch_dispatch__ = _TORCH_MODE_DISPATCH
        _lt.LocalTensor.__torch_dispatch__ = _TORCH_TENSOR_DISPATCH


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
