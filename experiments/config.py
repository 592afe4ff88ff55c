"""Structured configs for the experiment apps, registered in Hydra's ConfigStore.

Groups (pick one member each on the command line, ``group=member``):

- ``model``: ``mlp``, ``gpt_tiny``, ``gpt_small``, ``moe_tiny``.
- ``mesh``: sizes by axis name, major to minor (``dp4``, ``dp2_tp2``, ``fsdp2_tp2``, ...).
- ``optim``: ``adamw``, ``sgd``. ``data``: ``stdlib`` (the Python standard library's source, as
  bytes), ``random`` (uniform bytes: nothing to learn, for throughput). ``runtime``: ``simulate``,
  ``multiprocess``, ``torchrun``.
- ``precision``: ``fp32`` (default), ``bf16`` (fp32 master weights and reduction, bf16 compute),
  ``fp16`` (the same in fp16, with dynamic loss scaling) — a ``core.precision.Policy``.
- ``offload``: ``none`` (default), ``optimizer`` (optimizer state and update in host memory: the layout
  gains ``+offload_optimizer``), ``params`` (``+offload_params``), ``activations`` (the model's
  ``remat="offload"``: saved activations go to host memory until backward).

``layout`` is a plain string field: a preset of ``shardings.layouts`` or a ``+`` composition of them, in any
order, as in Python (``layout=zero3+tp+sp``, ``layout=sp+tp``; sweeps ``-m layout=dp,zero3``).
``experiments.build`` resolves it once and refuses a bad one with the presets and the nearest name.

A layout with ``pp`` (``layout=dp+pp mesh=dp2_pp2``) pipelines the model's blocks over
the mesh axis ``pp``; the ``pipeline`` node (not a group: set its fields) picks the schedule and the
microbatches (``pipeline.schedule=gpipe pipeline.microbatches=4``) and, optionally, the blocks per stage
(``pipeline.stage_sizes=[3,1]``); ``experiments.build`` makes the run's pipeline plan from them.

``model.name`` may be a dotted module path with the model interface (``model.name=mypkg.my_model``): its
``Config`` is built from its own defaults and the ``model.config.*`` fields set on the command line only (never
the default member's fields), see :func:`own_model`; any of its fields may be set without a ``+``
(:func:`app_overrides`).

Nothing is registered at import: the apps call :func:`register` in their entry points.

The primary configs are ``train`` (``python -m experiments.train``) and ``equivalence``
(``python -m experiments.equivalence``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf, open_dict

import core
import models

__all__ = [
    "MESHES",
    "MODELS",
    "OFFLOADS",
    "PRECISIONS",
    "CheckpointConf",
    "DataConf",
    "EquivalenceConf",
    "MeshConf",
    "ModelConf",
    "OffloadConf",
    "OptimConf",
    "PipelineConf",
    "PrecisionConf",
    "RuntimeConf",
    "SweepConf",
    "TrainConf",
    "app_overrides",
    "own_model",
    "register",
    "usage",
]


@dataclass
class ModelConf:
    """A model: ``name`` is a ``models.get`` name or a dotted module path with the same interface."""

    name: str = "gpt"
    config: dict[str, Any] = field(default_factory=dict)  # fields of the model module's Config
    init_from: str | None = None  # a Hugging Face Llama folder (experiments.export) to start training from


@dataclass
class MeshConf:
    """Mesh axis sizes by name, major to minor; their product is the world size."""

    sizes: dict[str, int] = field(default_factory=dict)  # filled by the member (a default would merge in)


@dataclass
class OptimConf:
    """The optimizer and its warmup-cosine learning-rate schedule (cosine over the run's steps)."""

    name: str = "adamw"  # adamw | sgd
    lr: float = 3e-3  # peak learning rate: tiny models on bytes tolerate a large one
    warmup_steps: int = 5  # linear warmup from 0, then cosine to lr * end_ratio
    end_ratio: float = 0.1  # final lr as a fraction of the peak
    weight_decay: float = 0.1  # decoupled (AdamW) / coupled (SGD) decay
    b1: float = 0.9  # Adam first-moment decay
    b2: float = 0.95  # Adam second-moment decay: 0.95 is the usual LLM choice (faster to adapt)
    momentum: float = 0.9  # SGD momentum
    clip_norm: float | None = 1.0  # global gradient-norm clipping; null disables it


@dataclass
class DataConf:
    """Where tokens come from and how they are batched (by default byte-level: token = byte, vocab 256)."""

    source: str = "stdlib"  # stdlib | random | a directory of text files
    path: str | None = None  # one file instead: text (its bytes) or token ids (.bin: nanoGPT's uint16), memory-mapped
    dtype: str | None = None  # of data.path: bytes | uint16 | uint32; null: from the suffix (.bin: uint16, else bytes)
    name: str | None = None  # your own batches: a module with batches(conf, batch_size, seq_len) (experiments.data)
    max_bytes: int = 4_000_000  # read at most this much of the corpus (keeps start-up fast)
    batch_size: int = 16  # global batch, in sequences
    seq_len: int | None = None  # sequence length; null -> the model config's seq_len
    seed: int = 0  # shuffling seed (row order per epoch)


@dataclass
class RuntimeConf:
    """How ranks run: one process simulating them, real local processes, or torchrun/SLURM's."""

    kind: str = "multiprocess"  # simulate | multiprocess | torchrun
    world_size: int | None = None  # null -> the mesh size; set it to check a cluster allocation
    backend: str | None = None  # null -> nccl with CUDA, else gloo (multiprocess / torchrun)
    timeout_s: float = 300.0  # a collective that cannot complete raises after this long


@dataclass
class CheckpointConf:
    """Checkpointing and resume: a restarted job with the same ``dir`` resumes from its latest checkpoint."""

    every: int = 0  # save the whole train state every N steps (and at the last step); 0 = off
    dir: str | None = None  # null -> <run dir>/checkpoints; set it so a restarted job (new run dir) finds it
    keep: int = 3  # keep the newest k checkpoints
    allow_changes: bool = False  # resume even though a training-defining key differs (experiments.resume)


@dataclass
class PipelineConf:
    """The pipeline of a layout with ``pp`` (ignored without it): its schedule and microbatches per step."""

    schedule: str | None = None  # a name in shardings.pipeline.SCHEDULES; null -> DEFAULT_SCHEDULE (docs/pipeline.md)
    virtual_stages: int | None = None  # interleaved_1f1b: model chunks per rank (null -> 2); the others: their own
    microbatches: int | None = None  # null -> accum_steps when > 1, else the pp size (shardings.pipeline.plan's)
    stage_sizes: list[int] | None = None  # blocks per stage, e.g. [3, 1]; null -> balanced by parameter count
    seq_chunks: int = 1  # TeraPipe: cut each microbatch's sequence into this many chunks (gpipe, 1f1b)
    chunk_sizes: str = "terapipe"  # "terapipe" (TeraPipe's dynamic program) or "equal"


@dataclass
class PrecisionConf:
    """A ``core.precision.Policy``: the dtype params are stored and updated in, computed in, and reduced in."""

    params: str = "float32"  # master weights (what the optimizer updates)
    compute: str = "float32"  # forward and backward; each rank casts its own blocks before any gather
    reduce: str = "float32"  # gradient reduce-scatter/all-reduce and accumulation
    loss_scale: bool | None = None  # null: dynamic loss scaling exactly when compute is float16; true/false forces it


@dataclass
class OffloadConf:
    """What lives in host memory (each member sets one; ``offload.params=true`` adds another)."""

    optimizer: bool = False  # optimizer state, and its update runs on the host (ZeRO-Offload): +offload_optimizer
    params: bool = False  # parameters between steps: +offload_params
    activations: bool = False  # activations saved for backward (the model's remat="offload")


@dataclass
class SweepConf:
    """How a sweep (``-m``) ends: nonzero when a job failed or was skipped (``experiments.sweep``)."""

    allow_skipped: bool = False  # true: skipped jobs (impossible combinations of a grid) do not fail the sweep


# `_self_` first: the group members override the dataclass fields' placeholder defaults.
_TRAIN_DEFAULTS = [
    "_self_",
    {"model": "gpt_tiny"},
    {"mesh": "dp2_tp2"},
    {"optim": "adamw"},
    {"data": "stdlib"},
    {"runtime": "multiprocess"},
    {"precision": "fp32"},
    {"offload": "none"},
]


@dataclass
class TrainConf:
    """``python -m experiments.train``: a small gpt on the stdlib corpus, zero3+tp on 4 real ranks."""

    defaults: list[Any] = field(default_factory=lambda: list(_TRAIN_DEFAULTS))
    model: ModelConf = field(default_factory=ModelConf)
    layout: str = "zero3+tp"  # presets joined with '+', in any order (shardings.layouts.get)
    mesh: MeshConf = field(default_factory=MeshConf)
    optim: OptimConf = field(default_factory=OptimConf)
    data: DataConf = field(default_factory=DataConf)
    runtime: RuntimeConf = field(default_factory=RuntimeConf)
    checkpoint: CheckpointConf = field(default_factory=CheckpointConf)
    pipeline: PipelineConf = field(default_factory=PipelineConf)
    precision: PrecisionConf = field(default_factory=PrecisionConf)
    offload: OffloadConf = field(default_factory=OffloadConf)
    steps: int = 60  # optimizer steps: enough for the loss to fall from ln(256)≈5.5 to ~3 on 2 cores
    accum_steps: int = 1  # microbatches per step
    jit: bool = False  # compile each block (train_step(jit=True)): dp/ZeRO/hsdp; real ranks; others warn, run eager
    seed: int = 0  # parameter init key
    progress: bool = True  # show progress (rank 0): a bar on a terminal, plain lines in a file or log
    progress_every: int = 0  # steps between plain lines when not on a terminal; 0: about 20 lines per run
    tracker: bool = True  # TensorBoard event files (scalars per step, the config as hparams) in the run directory
    sweep: SweepConf = field(default_factory=SweepConf)


@dataclass
class EquivalenceConf:
    """``python -m experiments.equivalence``: layouts vs the single-device reference, on simulated or real ranks."""

    defaults: list[Any] = field(
        default_factory=lambda: ["_self_", {"model": "mlp"}, {"mesh": "dp2"}, {"optim": "sgd"},
                                 {"precision": "fp32"}, {"runtime": "simulate"}]
    )  # SGD: parameter differences stay proportional to gradient differences. Adam divides by sqrt(v), so
    # fp32 rounding on near-zero gradients (another reduction order) can move a parameter by ~lr.
    model: ModelConf = field(default_factory=ModelConf)
    layout: str = "zero3"  # presets joined with '+', in any order (shardings.layouts.get); dp,zero3: several
    layouts: list[str] | None = None  # several layouts against one reference run (overrides layout)
    mesh: MeshConf = field(default_factory=MeshConf)
    optim: OptimConf = field(default_factory=OptimConf)
    pipeline: PipelineConf = field(default_factory=PipelineConf)
    precision: PrecisionConf = field(default_factory=PrecisionConf)  # bf16/fp16: each layout and its fp32 twin
    runtime: RuntimeConf = field(default_factory=RuntimeConf)  # simulate | multiprocess (real gloo processes)
    jit: bool = False  # compile each block (train_step(jit=True)); needs runtime=multiprocess
    jit_backend: str | None = None  # null: check_equivalence's default; aot_eager compiles quickly
    steps: int = 3  # optimizer steps compared
    batch_size: int = 8  # rows of model.example_batch
    accum_steps: int = 1  # microbatches per step on the sharded side
    seed: int = 0  # init key and batch seed


# Members whose config values differ from the module's Config defaults; the defaults are filled in
# when registering, so `model.config.heads=8` overrides without a `+`.
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "mlp": ("mlp", {}),
    "gpt_tiny": ("gpt", {"dim": 64, "layers": 2, "heads": 4, "mlp": 192, "seq_len": 64}),  # ~0.1M params
    "gpt_small": ("gpt", {"dim": 128, "layers": 4, "heads": 8, "kv_heads": 4, "mlp": 384, "seq_len": 128}),
    "moe_tiny": ("moe", {}),
}

MESHES: dict[str, dict[str, int]] = {
    "single": {"dp": 1},
    "dp2": {"dp": 2},
    "dp4": {"dp": 4},
    "tp2": {"tp": 2},
    "tp4": {"tp": 4},
    "fsdp4": {"fsdp": 4},
    "dp2_tp2": {"dp": 2, "tp": 2},
    "fsdp2_tp2": {"fsdp": 2, "tp": 2},
    "dp2_fsdp2": {"dp": 2, "fsdp": 2},
    "dp2_fsdp2_tp2": {"dp": 2, "fsdp": 2, "tp": 2},
    "dp2_cp2": {"dp": 2, "cp": 2},  # context parallelism (layout=dp+cp)
    "dp2_ep2": {"dp": 2, "ep": 2},  # expert parallelism (model=moe_tiny layout=dp+ep)
    "pp2": {"pp": 2},  # pipeline parallelism (layout=pp)
    "pp4": {"pp": 4},  # 4 stages: needs a model with >= 4 layers (gpt_small)
    "dp2_pp2": {"dp": 2, "pp": 2},  # layout=dp+pp (or zero1+pp, zero2+pp)
    "dp2_pp2_tp2": {"dp": 2, "pp": 2, "tp": 2},  # layout=tp+sp+pp: data, stages, tensors
}

_DATA = {"stdlib": DataConf(), "random": DataConf(source="random")}
_OPTIM = {"adamw": OptimConf(), "sgd": OptimConf(name="sgd", lr=0.1, weight_decay=0.0)}
_RUNTIMES = {k: RuntimeConf(kind=k) for k in ("simulate", "multiprocess", "torchrun")}
# core.precision.NAMED as configs: fp32 no policy (the reference, what `make train` runs); bf16 FSDP2's
# MixedPrecisionPolicy(bf16, fp32); fp16 DeepSpeed's fp16 with loss_scale 0 (dynamic)
PRECISIONS: dict[str, PrecisionConf] = {
    name: PrecisionConf() if make is None else PrecisionConf(*(str(d).removeprefix("torch.") for d in (
        make().param_dtype, make().compute_dtype, make().reduce_dtype)))
    for name, make in core.precision.NAMED.items()
}
OFFLOADS: dict[str, OffloadConf] = {
    "none": OffloadConf(),
    "optimizer": OffloadConf(optimizer=True),
    "params": OffloadConf(params=True),
    "activations": OffloadConf(activations=True),
}


def _model_config(module_name: str, values: dict[str, Any]) -> dict[str, Any]:
    config_cls = models.get(module_name).Config
    return {f.name: getattr(config_cls(), f.name) for f in dataclasses.fields(config_cls)} | values


def register() -> ConfigStore:
    """Register every group member and both primary configs in Hydra's ConfigStore (idempotent); the apps call it
    in their entry points, before Hydra composes."""
    cs = ConfigStore.instance()
    for name, (module, values) in MODELS.items():
        cs.store(group="model", name=name, node=ModelConf(name=module, config=_model_config(module, values)))
    for name, sizes in MESHES.items():
        cs.store(group="mesh", name=name, node=MeshConf(sizes=dict(sizes)))
    for group, members in (("optim", _OPTIM), ("data", _DATA), ("runtime", _RUNTIMES), ("precision", PRECISIONS),
                           ("offload", OFFLOADS)):
        for name, node in members.items():
            cs.store(group=group, name=name, node=node)
    cs.store(name="train", node=TrainConf)
    cs.store(name="equivalence", node=EquivalenceConf)
    return cs


_MODEL_CONFIG = "model.config."


def app_overrides(overrides: Sequence[str]) -> list[str]:
    """The apps' command-line overrides as Hydra takes them: ``model.config.<field>=v`` becomes ``++`` (add or
    override), so any field of the model's ``Config`` can be set — a custom model's fields are not among the
    default member's. ``build`` refuses a field the model's ``Config`` lacks, listing its fields.

    >>> app_overrides(["model.config.classes=6", "layout=dp", "+model.config.dim=8"])
    ['++model.config.classes=6', 'layout=dp', '+model.config.dim=8']
    """
    return [f"++{o}" if o.startswith(_MODEL_CONFIG) else o for o in overrides]


def own_model(cfg: DictConfig, overrides: Sequence[str]) -> DictConfig:
    """``cfg`` with ``model.config`` holding only the fields set in ``overrides`` when ``model.name`` is set there.

    A ``model`` group member fills ``model.config`` with its own model's fields (``gpt_tiny``: ``dim=64``, ...);
    with another module named (``model.name=mypkg.my_model``) those belong to the wrong model, so the named
    module's ``Config`` gets its own defaults and the ``model.config.*`` fields given alongside. Both apps call
    this on the composed config with the overrides they composed it from.
    """
    keys = [o.lstrip("+~").split("=", 1)[0] for o in overrides]
    if "model.name" not in keys or "model.config" in keys:  # no other model, or its whole config given
        return cfg
    given = {k.removeprefix(_MODEL_CONFIG).split(".")[0] for k in keys if k.startswith(_MODEL_CONFIG)}
    with open_dict(cfg):
        cfg.model.config = {k: v for k, v in cfg.model.config.items() if k in given}
    return cfg


def usage(doc: str, cfg: DictConfig) -> str:
    """An app's ``--help``: its module docstring and its config with the defaults (each key a ``key=value``
    override; Hydra's own flags are not taken)."""
    return f"{doc.strip()}\n\nConfig (defaults; override any key with key=value):\n\n{OmegaConf.to_yaml(cfg)}"
