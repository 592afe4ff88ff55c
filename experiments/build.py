"""From a composed config to the objects a run needs, with every impossible combination caught first.

:func:`build` does all the checking a run can do without a process group — model config, layout
presets, mesh axes, world size, divisibility of heads/batch/sequence, and with ``pp`` the pipeline
(schedule, microbatches, blocks per stage), the precision policy and what is offloaded to host memory
(``offload``: layout presets or the model's ``remat``) — so a bad combination fails at start, with one
message, before any process is started. It resolves the layout string once and makes the run's pipeline plan
once; :class:`Setup` carries both to ``shardings.init`` and ``shardings.train_step``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any, NamedTuple

import core
import models
from core import deferred, tree
from experiments.auto import auto
from shardings import Mesh, check_batch_rows, layouts, logical_to_spec, param_specs, pipeline
from shardings.planner import row_tokens

__all__ = ["ConfigError", "Setup", "build", "loss", "lr_schedule", "model", "optimizer", "pretrained"]

_RUNTIMES = ("simulate", "multiprocess", "torchrun")


class ConfigError(ValueError):
    """A configuration that cannot run; the message says which settings clash and ends with the fix."""


class Setup(NamedTuple):
    """What a run is made of, resolved and checked."""

    model: ModuleType  # the model module (Config, init, axes, loss, ...)
    model_cfg: Any  # its Config instance
    layout: layouts.Layout  # resolved once, offload presets included
    mesh: Mesh
    seq_len: int  # tokens per row of the data
    microbatches: int = 1  # per step: accum_steps, or with pp the pipeline plan's
    plan: pipeline.Plan | None = None  # with pp: the run's pipeline plan (schedule, microbatches, split); None without
    precision: core.precision.Policy | None = None  # None: fp32 throughout (no policy)
    conf: Any = None  # the config as resolved: with layout=auto, the planner's winner's layout, mesh and pipeline


def loss(setup: Setup, jit: bool = False) -> Callable[[Any, Any], Any]:
    """The loss a train step takes: the model's ``stages(cfg)`` under ``pp`` (and under ``jit``, where the model
    declares them: each block is compiled on its own), else its ``loss`` bound to its config."""
    if setup.layout.pipelined or (jit and hasattr(setup.model, "stages")):
        return setup.model.stages(setup.model_cfg)
    return functools.partial(setup.model.loss, cfg=setup.model_cfg)


_INTERFACE = ("Config", "init", "axes", "loss", "example_batch")


def model(conf: Any) -> tuple[ModuleType, Any]:
    """The model module and its ``Config`` a ``model`` config node names (``ConfigError`` if it cannot)."""
    return _model(conf)


def _import(key: str, hint: str, interface: tuple[str, ...]) -> ModuleType:
    """The module a dotted ``key=path`` names, which must have ``interface``'s attributes (else ``ConfigError``)."""
    name = key.split("=", 1)[1]
    try:
        module = importlib.import_module(name)
    except ImportError as e:
        raise ConfigError(f"{key}: cannot import it ({e}). Fix: {hint}, importable from sys.path "
                          "(PYTHONPATH).") from None
    missing = [a for a in interface if not hasattr(module, a)]
    if missing:
        raise ConfigError(f"{key}: the module has no {missing}. Fix: {hint}.")
    return module


def _model(conf: Any) -> tuple[ModuleType, Any]:
    name = conf.name
    hint = (f"use one of {models.names()} or a module path like `mypkg.my_model` (or a top-level `my_model`) whose "
            f"module has {'/'.join(_INTERFACE)}")
    if name in models.names():
        module = models.get(name)
    else:  # a module importable from sys.path, dotted or not (a built-in name wins over a module of that name)
        module = _import(f"model.name={name}", hint, _INTERFACE)
    try:
        return module, module.Config(**dict(conf.config))
    except (TypeError, ValueError) as e:
        fields = [f.name for f in dataclasses.fields(module.Config)]
        raise ConfigError(f"model.config: {e}. Fix: set only fields of {name}.Config: {fields}.") from None


def _world_size(runtime: Any, mesh: Mesh) -> int:
    if runtime.kind not in _RUNTIMES:
        raise ConfigError(f"runtime.kind={runtime.kind!r} is unknown. Fix: use one of {_RUNTIMES}.")
    world = runtime.world_size if runtime.world_size is not None else mesh.size
    if runtime.kind == "torchrun" and "WORLD_SIZE" in os.environ:
        world = int(os.environ["WORLD_SIZE"])
    if world != mesh.size:
        raise ConfigError(
            f"mesh {mesh!r} has {mesh.size} ranks but the runtime has {world} (runtime={runtime.kind}). "
            f"Fix: choose mesh sizes that multiply to {world}, or run with {mesh.size} ranks."
        )
    return world


def _divisible(what: str, size: int, parts: int, setting: str, why: str) -> None:
    if size % parts:
        raise ConfigError(
            f"{what}={size} is not divisible by {parts} ({why}). Fix: set {setting} to a multiple of {parts}."
        )


def build(cfg: Any, *, batch_size: int | None = None, seq_len: int | None = None) -> Setup:
    """Resolve and check a composed ``train``/``equivalence`` config; raise one :class:`ConfigError` if it cannot run.

    Args:
        cfg: the composed config (``model``, ``layout``, ``mesh``, optional ``runtime`` and ``data``).
        batch_size: the global batch (default ``cfg.data.batch_size``).
        seq_len: tokens per row (default ``cfg.data.seq_len``, else the model config's ``seq_len``; a config without
            one, an image model: its tokens per row, measured by ``shardings.planner.row_tokens``).

    Returns:
        A :class:`Setup`; with ``layout=auto`` the planner's winner (``experiments.auto.auto``: it prints the ranked
        table), whose resolved config is ``Setup.conf``.

    >>> build(compose("train", ["model=mlp", "layout=dp", "mesh=dp4"])).mesh  # doctest: +SKIP
    Mesh(dp=4)
    """
    module, model_cfg = _model(cfg.model)
    cfg = auto(cfg, module, model_cfg)  # the one place layout=auto is resolved; callers read the winner in Setup.conf
    offload = cfg.get("offload") or {}
    if offload.get("activations"):
        model_cfg = _offload_activations(module, model_cfg)
    precision = _precision(cfg.get("precision"))
    parts = [p.strip() for p in str(cfg.layout).split("+")]  # the offload presets join the user's spelling
    spelled = "+".join([*parts, *(f"offload_{r}" for r in ("optimizer", "params") if offload.get(r)
                                  and f"offload_{r}" not in parts)])
    data = cfg.get("data")
    batch_size = batch_size if batch_size is not None else data.batch_size
    seq_len = seq_len or (data.seq_len if data is not None else None) or row_tokens(module, model_cfg)  # ViT: measured
    accum = cfg.get("accum_steps", 1)
    try:
        layout = layouts.get(spelled)  # the run's one resolution (an unknown preset: the nearest name)
        mesh = Mesh(dict(cfg.mesh.sizes))
        if "runtime" in cfg:
            _world_size(cfg.runtime, mesh)
        if layout.pipelined:
            _check_stages_declared(module)
        layouts.resolve(layout, mesh)  # validated once: init and train_step pass it straight through
        with deferred.deferred():  # shapes only: nothing is drawn
            shapes = module.init(core.random.key(0), model_cfg)
        for role in layouts.PARAM_ROLES:
            param_specs(module.axes(model_cfg), shapes, layout, mesh, role=role)
        batch = logical_to_spec(("batch", "seq"), layout.role("batch"), mesh)
        acts = logical_to_spec(("batch", "seq", "embed"), layout.role("activations"), mesh)
    except ValueError as e:  # ShardingError and friends already name spec, mesh and fix
        raise ConfigError(f"layout={spelled} mesh={dict(cfg.mesh.sizes)}: {e}") from None
    _check_checkpointing(cfg.get("checkpoint"))
    plan = _pipeline_plan(module, model_cfg, layout, mesh, shapes, cfg.get("pipeline") or {}, accum)
    micro = plan.microbatches if plan is not None else accum
    dp = mesh.axis_size(batch.dim_axes()[0])
    check_batch_rows(batch_size, dp, micro, per="pipeline microbatches" if plan is not None else
                     "accumulation steps", setting="data.batch_size", cls=ConfigError)
    _divisible("seq_len", seq_len, mesh.axis_size(acts.dim_axes()[1]), "data.seq_len",
               f"layout {layout.name!r} splits the sequence over {acts.dim_axes()[1]}")
    return Setup(module, model_cfg, layout, mesh, seq_len, micro, plan, precision, cfg)


def _pipeline_plan(module: ModuleType, model_cfg: Any, layout: layouts.Layout, mesh: Mesh, shapes: Any, pipe: Any,
                   accum: int) -> pipeline.Plan | None:
    """The run's pipeline plan (``None`` without ``pp``), made once from the ``pipeline`` settings; a bad setting
    fails here, named by its config key."""
    if not layout.pipelined:
        return None
    name, virtual, pp = pipe.get("schedule"), pipe.get("virtual_stages"), mesh.axis_size("pp")
    micro = _microbatches(pipe.get("microbatches"), accum)
    sizes = list(pipe.get("stage_sizes") or []) or None
    blocks = module.stages(model_cfg).blocks
    chunks = dict(seq_chunks=pipe.get("seq_chunks") or 1, chunk_sizes=pipe.get("chunk_sizes") or "terapipe")
    where = f"pipeline.schedule={name} pipeline.virtual_stages={virtual} pipeline.seq_chunks={chunks['seq_chunks']}"
    try:
        stages = pp * pipeline.stages_per_rank(name, virtual)
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None
    _check_stages(len(shapes[blocks]), pp, stages, sizes)
    try:  # the schedule's own checks (interleaved: m a multiple of pp), before any work
        return pipeline.plan(layout, mesh, shapes, schedule=name, microbatches=micro, accum_steps=accum,
                             virtual_stages=virtual, stage_sizes=sizes, blocks=blocks, **chunks)
    except ValueError as e:
        raise ConfigError(f"{where} pipeline.microbatches={micro}: {e}") from None


def _precision(conf: Any) -> core.precision.Policy | None:
    """The ``precision`` group's policy; ``None`` when everything is float32 and nothing is scaled (the reference)."""
    if conf is None:
        return None
    text = f"params={conf.params},compute={conf.compute},reduce={conf.reduce}"
    try:
        policy = core.precision.Policy.from_string(text)
    except ValueError as e:
        raise ConfigError(f"precision: {e}") from None
    if conf.loss_scale is not None:
        policy = dataclasses.replace(policy, loss_scale=core.precision.DynamicLossScale() if conf.loss_scale else None)
    return None if policy == core.precision.Policy() or policy == core.precision.Policy(loss_scale=None) else policy


def _offload_activations(module: ModuleType, model_cfg: Any) -> Any:
    """``offload.activations``: the model's blocks save their activations to host memory (``remat="offload"``)."""
    if "remat" not in {f.name for f in dataclasses.fields(model_cfg)}:
        raise ConfigError(f"offload=activations: model {module.__name__} has no remat setting to offload its "
                          "saved activations with. Fix: use a model with one (gpt_tiny, gpt_small, moe_tiny), "
                          "or offload=none.")
    return dataclasses.replace(model_cfg, remat="offload")


def _check_stages_declared(module: ModuleType) -> None:
    """A layout with ``pp`` needs a model that declares its stages (``layouts.get`` checked the presets)."""
    if not callable(getattr(module, "stages", None)):
        raise ValueError(f"model {module.__name__} declares no pipeline stages (a stages(cfg) function). "
                         "Fix: use a model with stages (gpt, moe, mlp), or a layout without pp.")


def _check_stages(blocks: int, pp: int, stages: int, sizes: list[int] | None) -> None:
    if blocks < stages:
        raise ConfigError(f"the model has {blocks} blocks (layers), too few for pp={pp} × {stages // pp} stage(s) per "
                          f"rank = {stages} pipeline stages (each needs at least one). Fix: set model.config.layers "
                          f"to {stages} or more, or use a mesh with a smaller pp (or fewer stages per rank).")
    if sizes is not None and (len(sizes) != stages or sum(sizes) != blocks or min(sizes) < 1):
        raise ConfigError(f"pipeline.stage_sizes={sizes} must be {stages} positive counts adding up to the model's "
                          f"{blocks} blocks. Fix: e.g. pipeline.stage_sizes=null (balanced), or give one count per "
                          "stage.")


def _microbatches(microbatches: int | None, accum: int) -> int | None:
    """``pipeline.microbatches``, checked (``None``: the pipeline plan's default)."""
    if microbatches is None:
        return None
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ConfigError(f"pipeline.microbatches={microbatches!r} is not a positive int. "
                          "Fix: set it to e.g. the pp size or more, or null for the default.")
    if accum > 1 and accum != microbatches:
        raise ConfigError(f"with pp, accum_steps={accum} and pipeline.microbatches={microbatches} both set the "
                          "microbatches per step. Fix: set only pipeline.microbatches.")
    return microbatches


def _check_checkpointing(conf: Any) -> None:
    if conf is None:
        return
    if conf.every < 0:
        raise ConfigError(f"checkpoint.every={conf.every} is negative. Fix: save every N > 0 steps, or 0 for never.")
    if conf.keep < 1:
        raise ConfigError(f"checkpoint.keep={conf.keep} keeps nothing. Fix: keep at least 1 checkpoint.")


def pretrained(directory: str, setup: Setup) -> Any:
    """Whole-tensor parameters of ``setup``'s model from a Hugging Face Llama folder (``model.init_from``).

    The folder's params must have the configured model's structure and shapes, and its config the
    same architecture (a difference in e.g. ``rope_theta`` would silently change the model).

    Raises:
        ConfigError: not a gpt model, an unreadable folder, a key path or shape that differs from
            the configured model's, or a differing architecture field.

    >>> params = pretrained("hf/gpt", build(cfg))  # doctest: +SKIP
    """
    from experiments.export import from_hf_dir
    from models import gpt

    where = f"model.init_from={directory!r}"
    if setup.model is not gpt:
        raise ConfigError(f"{where}: a Hugging Face Llama folder holds a gpt, not {setup.model.__name__}. "
                          "Fix: use model=gpt_tiny/gpt_small (or model.name=gpt), or drop model.init_from.")
    try:
        params, hf_cfg = from_hf_dir(directory)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"{where}: cannot read it ({type(e).__name__}: {e}). "
                          "Fix: pass a folder written by `python -m experiments.export`.") from None
    with deferred.deferred():
        want = setup.model.init(core.random.key(0), setup.model_cfg)  # shapes only
    got = {tree.keystr(p): x for p, x in tree.leaves_with_path(params)}
    for path, leaf in tree.leaves_with_path(want):
        key = tree.keystr(path)
        if key not in got or tuple(got[key].shape) != tuple(leaf.shape):
            have = f"has shape {tuple(got[key].shape)}" if key in got else "has no such parameter"
            raise ConfigError(f"{where}: params{key} {have}, the configured model needs {tuple(leaf.shape)}. "
                              "Fix: set model.config to the folder's config.json architecture.")
    extra = sorted(set(got) - {tree.keystr(p) for p, _ in tree.leaves_with_path(want)})
    if extra:
        raise ConfigError(f"{where}: params{extra[0]} is not a parameter of the configured model. "
                          "Fix: set model.config to the folder's config.json architecture.")
    for name in ("heads", "n_kv_heads", "d_head", "rope_theta", "norm_eps", "tie_embeddings"):
        theirs, ours = getattr(hf_cfg, name), getattr(setup.model_cfg, name)
        if theirs != ours:
            raise ConfigError(f"{where}: its {name} is {theirs!r}, the configured model's is {ours!r}. "
                              "Fix: set model.config to the folder's config.json architecture.")
    return params


def lr_schedule(conf: Any, steps: int) -> core.optim.Schedule:
    """The ``optim`` group's warmup-cosine learning rate over ``steps`` (what :func:`optimizer` uses; the tracker
    logs it)."""
    warmup = min(conf.warmup_steps, max(steps - 1, 0))
    return core.optim.warmup_cosine(conf.lr, warmup, max(steps, warmup + 1), end=conf.lr * conf.end_ratio)


def optimizer(conf: Any, steps: int, schedule: bool = True) -> core.optim.GradientTransformation:
    """The ``optim`` group's optimizer with its warmup-cosine schedule over ``steps`` (or a constant ``lr``).

    ``optim.name`` is ``adamw``, ``sgd``, or a dotted module path whose module has ``optimizer(conf, lr)``
    returning a ``core.optim.GradientTransformation`` (``conf``: the ``optim`` node; ``lr``: the schedule)."""
    lr = lr_schedule(conf, steps)
    makers = {
        "adamw": functools.partial(core.optim.adamw, b1=conf.b1, b2=conf.b2, weight_decay=conf.weight_decay),
        "sgd": functools.partial(core.optim.sgd, momentum=conf.momentum, weight_decay=conf.weight_decay),
    }
    hint = f"use one of {sorted(makers)} or a module path like `mypkg.my_optim` whose module has optimizer(conf, lr)"
    if "." in conf.name:
        return _import(f"optim.name={conf.name}", hint, ("optimizer",)).optimizer(conf, lr if schedule else conf.lr)
    if conf.name not in makers:
        raise ConfigError(f"optim.name={conf.name!r} is unknown. Fix: {hint}.")
    return makers[conf.name](lr if schedule else conf.lr)
