"""One layout's side of an equivalence check: train it on simulated or real ranks and collect, per step, every
rank's full loss, gradients and parameters (what :mod:`shardings.testing.equivalence` compares with one device)."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any

import core
from core import tree
from shardings.runtime.simulate import per_rank, simulate
from shardings.spec.distribute import gather
from shardings.step.compiled import CompileFallbackWarning
from shardings.step.initialize import init as sharded_init
from shardings.step.train_step import train_step

__all__ = ["StagesOf", "run_layout", "runners"]


def _rank_values(full_tree: Any) -> list[Any]:
    """One plain tree per rank (ranks must each hold the same full values)."""
    leaves, treedef = tree.flatten(full_tree)
    per = [per_rank(x) for x in leaves]  # copies: a donating step writes the next step into these buffers
    ranks = max(map(len, per), default=1)  # a plain tensor (one value) is every rank's value
    return [tree.unflatten(treedef, [p[r if len(p) > 1 else 0].clone() for p in per]) for r in range(ranks)]


def _sharded_run(init, loss_fn, axes, cfg, batch, optimizer, steps, key, layout, mesh, step_kw):
    """Per step, one ``{"loss", "grads", "params"}`` tree of full values per rank this process holds."""
    optimizer = optimizer() if not isinstance(optimizer, core.optim.GradientTransformation) else optimizer
    where = {"plan": step_kw["plan"]} if "plan" in step_kw else {}  # pp: which rank runs which stage
    params = sharded_init(init, key, cfg, axes=axes, layout=layout, mesh=mesh, **where)
    loss_fn = loss_fn.build() if isinstance(loss_fn, StagesOf) else loss_fn
    with warnings.catch_warnings():
        if step_kw.get("jit"):  # each layout's graphs compiled afresh: another layout's count against no limit
            import torch

            torch.compiler.reset()
            # a check of the compiled step that ran the eager one would check nothing: the fallback is an error
            warnings.simplefilter("error", CompileFallbackWarning)
        return _steps(params, train_step(loss_fn, optimizer, layout=layout, mesh=mesh, axes=axes, **step_kw), batch,
                      steps)


def _steps(params: Any, step: Any, batch: Any, steps: int) -> list[list[Any]]:
    state = step.init(params)
    sync = getattr(step, "gather_stages", lambda t: t)  # pp on real ranks: each block from the rank that owns it
    out = []
    for _ in range(steps):
        scale = step.loss_scale(state)  # fp16: the loss scale the state carries (None otherwise)
        loss, grads, _ = step.grads(params, batch) if scale is None else step.grads(params, batch, scale)
        params, state = step.apply(params, state, grads)
        loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        weights = step.master_weights(params, state)  # the fp32 master under ZeRO-1/2 + policy, not its copy
        out.append(_rank_values({"loss": loss, "grads": gather(sync(grads)), "params": gather(sync(weights))}))
    return out


@dataclasses.dataclass(frozen=True)
class StagesOf:
    """A model's stages, built where the train step runs (a Stages holds lambdas: it does not pickle)."""

    factory: Callable[[Any], Any]
    cfg: Any

    def build(self) -> Any:
        return self.factory(self.cfg)


def _worker(*args: Any) -> list[Any]:
    # One real rank: its own full copies of loss/grads/params per step (plain CPU tensors).
    return [ranks[0] for ranks in _sharded_run(*args)]


def _worker_all(jobs: dict[str, tuple]) -> dict[str, list[Any]]:
    # One real rank running every layout in turn: one process start (and one torch import) for all of them.
    out = {}
    for name, args in jobs.items():
        try:
            out[name] = _worker(*args)
        except Exception as e:  # the launch's error then names the run that raised, not only the rank
            e.add_note(f"while running {name!r} (one launch runs every run of this world size in turn)")
            raise
    return out


def runners(runtime: str, jobs: dict[str, tuple]) -> dict[str, Callable[[], list[list[Any]]]]:
    """Per name, a function returning :func:`run_layout`'s per-step values for ``jobs[name]`` (its arguments after
    ``runtime``). With ``runtime="multiprocess"`` the first call launches one set of real ranks that runs every
    job in sequence (jobs share the mesh): the process start (~8 s) and, under ``jit``, the compiler's warm-up are
    paid once, not per layout."""
    if runtime != "multiprocess" or len(jobs) < 2:
        return {name: functools.partial(run_layout, runtime, *args) for name, args in jobs.items()}
    done: dict[str, list[list[Any]]] = {}

    def run(name: str) -> list[list[Any]]:
        if not done:
            _check_factory(next(iter(jobs.values()))[5])
            from shardings.runtime.launch import launch

            per_rank = launch(_worker_all, next(iter(jobs.values()))[-2].size, jobs)
            done.update({n: [list(step) for step in zip(*(r[n] for r in per_rank))] for n in jobs})
        return done[name]

    return {name: functools.partial(run, name) for name in jobs}


def run_layout(runtime, init, loss_fn, axes, cfg, batch, optimizer, steps, key, layout, mesh, step_kw):
    args = (init, loss_fn, axes, cfg, batch, optimizer, steps, key, layout, mesh, step_kw)
    if runtime == "simulate":
        with simulate(mesh.size):
            return _sharded_run(*args)
    if runtime != "multiprocess":
        raise ValueError(f"check_equivalence: runtime must be 'simulate' or 'multiprocess', got {runtime!r}")
    _check_factory(optimizer)
    from shardings.runtime.launch import launch

    per_rank_steps = launch(_worker, mesh.size, *args)
    return [list(step) for step in zip(*per_rank_steps)]


def _check_factory(optimizer: Any) -> None:
    if isinstance(optimizer, core.optim.GradientTransformation):
        raise TypeError(
            "check_equivalence(runtime='multiprocess') sends the optimizer to other processes, and a "
            "GradientTransformation holds closures that cannot be pickled. Fix: pass a factory, e.g. "
            "optimizer=functools.partial(core.optim.adamw, 1e-3)."
        )
