"""``python -m experiments.plan``: which layout and mesh for this model on that cluster, ranked by predicted step time.

Hydra overrides pick the model (``model=``: the experiments' models and the published shapes ``gpt3_175b``,
``llama3_8b``, ``llama3_70b``, ``llama3_405b``, ``mixtral_8x7b``) and the cluster (``cluster=``: ``this``,
``h100x8``, ``h100x64``, ``h100x512``; ``experiments/conf/cluster``)::

    python -m experiments.plan model=gpt3_175b cluster=h100x64 batch_size=1536 precisions=[bf16]
    python -m experiments.plan model=llama3_8b cluster=h100x8 batch_size=8 fits=true layout=zero3 mesh=dp8 \\
        precision=bf16 remat=true        # does it fit? yes/no and where the memory goes
    python -m experiments.plan model=gpt_small explain=true layout=zero3+tp mesh=dp2_tp2   # one candidate's why
    python -m experiments.plan model.name=mypkg.my_model model.config.layers=8   # your model, its own Config
    python -m experiments.plan calibrate    # measure this machine: writes experiments/conf/cluster/this.yaml
    python -m experiments.plan validate     # predicted vs measured on 4 gloo processes (experiments.bench.plan)

It prints the model and config it planned (``model.name=``: the module's own ``Config``, its defaults and the
``model.config.*`` given) with its parameter count, the top ``top_k`` candidates (step time, peak memory and bytes
sent per rank, exposed communication, compute, bubble), the winner as the ``experiments.train`` overrides that run
it, and the dropped candidates counted by reason. A ``Config`` without ``remat`` is planned without it. Nothing is
allocated: the model's steps run on fake tensors (``shardings.plan``; ``docs/planner.md``).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException
from omegaconf import OmegaConf

import core
import shardings
from core import deferred, tree
from experiments.auto import CONF, auto, load_cluster, train_overrides
from experiments.build import ConfigError, model
from experiments.config import ModelConf, app_overrides, own_model, register, usage
from shardings.planner import Candidate, Cluster, Space, row_tokens

__all__ = ["PlanConf", "auto", "candidate", "dropped_by_reason", "load_cluster", "main", "parse_mesh", "planned"]


@dataclass
class PlanConf:
    """``python -m experiments.plan``: plan a model on a cluster; or check one candidate (``fits``, ``explain``)."""

    defaults: list[Any] = field(default_factory=lambda: ["_self_", {"model": "gpt_small"}, {"cluster": "this"}])
    model: ModelConf = field(default_factory=ModelConf)
    cluster: Any = None  # a member of experiments/conf/cluster (shardings.planner.Cluster's fields)
    batch_size: int = 16  # global batch, in sequences
    seq_len: int | None = None  # tokens per sequence; null -> the model config's seq_len (none: measured, a ViT's)
    top_k: int = 10  # rows printed, and candidates run exactly on fake tensors
    budget_s: float = 40.0  # seconds of exact predictions at most
    precisions: list[str] = field(default_factory=lambda: ["fp32"])  # fp32 | bf16 | fp16 to try
    remats: list[Any] = field(default_factory=lambda: [False, True])  # remat choices to try (false, true, offload)
    max_cp: int = 1  # the largest context-parallel degree tried
    max_pp: int = 16  # the largest pipeline-parallel degree tried
    max_microbatches: int = 64  # the most microbatches (pipeline or accumulation) tried
    offload: bool = True  # try the offload presets
    seq_chunks_tried: list[int] = field(default_factory=lambda: [1])  # TeraPipe chunks per sequence to try (gpipe,
    # 1f1b; run exactly like the rest): e.g. [1,2,4]; [1]: whole sequences only
    fits: bool = False  # answer yes/no for the candidate below, with its memory breakdown
    explain: bool = False  # explain the candidate below: where its time and memory go, its rank (both: both)
    layout: str | None = None  # the candidate for fits/explain ...
    mesh: str | None = None  # ... its mesh, major to minor (dp8_tp2)
    microbatches: int = 1  # ... its microbatches (with pp: the pipeline's; default pp size)
    schedule: str | None = None  # ... with pp: its schedule (default 1f1b)
    seq_chunks: int = 1  # ... with pp: TeraPipe's chunks per sequence (gpipe, 1f1b; train's pipeline.seq_chunks)
    remat: Any = False  # ... its remat (false, true, offload)
    precision: str = "fp32"  # ... its precision


def parse_mesh(text: str) -> dict[str, int]:
    """``"dp8_pp4_tp2"`` -> ``{"dp": 8, "pp": 4, "tp": 2}`` (the experiments' mesh names).

    Raises:
        ConfigError: a part that is not an axis name followed by its size.
    """
    sizes = {}
    for part in text.split("_"):
        name = part.rstrip("0123456789")
        if not name or name == part:
            raise ConfigError(f"mesh={text!r}: {part!r} is not an axis name and size. Fix: write e.g. mesh=dp8_tp2.")
        sizes[name] = int(part[len(name):])
    return sizes


def candidate(cfg: Any) -> Candidate:
    """The candidate ``cfg`` names (``layout``, ``mesh``, ...), its layout spelled canonically."""
    if not cfg.layout or not cfg.mesh:
        raise ConfigError("fits/explain need a candidate. Fix: add layout=... mesh=... (e.g. layout=zero3 mesh=dp8).")
    try:
        layout = shardings.layouts.get(cfg.layout)
    except ValueError as e:
        raise ConfigError(f"layout={cfg.layout!r}: {e}") from None
    sizes = parse_mesh(cfg.mesh)
    if layout.pipelined:
        m = shardings.pipeline.default_microbatches(sizes.get("pp", 1), cfg.microbatches)
        return Candidate(layout.name, tuple(sizes.items()), m, cfg.schedule or shardings.pipeline.DEFAULT_SCHEDULE,
                         None, cfg.remat, cfg.precision, cfg.seq_chunks)
    return Candidate(layout.name, tuple(sizes.items()), cfg.microbatches, None, None, cfg.remat, cfg.precision)


def run(cfg: Any) -> str:
    """Plan (or check one candidate) for the composed ``plan`` config; the text to print: what was planned (the
    model's config and parameter count), then the answer, then the dropped candidates counted by reason."""
    module, model_cfg = model(cfg.model)
    cluster = Cluster.from_dict(OmegaConf.to_container(cfg.cluster, resolve=True))
    batch = (cfg.batch_size, cfg.seq_len or row_tokens(module, model_cfg))  # an image model: its own tokens per row
    head = planned(cfg.model.name, model_cfg, module, batch)
    if cfg.fits or cfg.explain:
        cand = candidate(cfg)
        world = 1
        for n in cand.sizes.values():
            world *= n
        if world != cluster.world:
            raise ConfigError(f"mesh={cfg.mesh} has {world} ranks but cluster {cluster.name} has {cluster.world}. "
                              f"Fix: a mesh of {cluster.world} ranks, or another cluster.")
        try:
            ranking = shardings.plan(module, model_cfg, batch, cluster, candidates=[cand], top_k=1, budget_s=1e9)
            answers = ([str(ranking.fits(cand))] if cfg.fits else []) + ([ranking.explain(cand)] if cfg.explain
                                                                         else [])  # both: from one exact run
        except RuntimeError as e:
            op = _data_dependent_op(e)
            if op is None:
                raise
            raise ConfigError(f"{cand}: the step cannot run on fake tensors (shapes without data): {op} needs the "
                              "values of a tensor (.item(), a boolean mask's size, nonzero). Fix: make that step of "
                              "the loss shape-only (e.g. a mask multiplied in, not indexed with), or check the "
                              "candidate by running it (experiments.train, experiments.equivalence).") from None
        return "\n".join([head, *answers])
    space = Space(precisions=tuple(cfg.precisions), remat=tuple(cfg.remats), max_microbatches=cfg.max_microbatches,
                  max_cp=cfg.max_cp, max_pp=cfg.max_pp, offload=cfg.offload,
                  seq_chunks=tuple(cfg.seq_chunks_tried))
    ranking = shardings.plan(module, model_cfg, batch, cluster, space=space, top_k=cfg.top_k, budget_s=cfg.budget_s)
    return "\n".join([head, ranking.table(cfg.top_k, train_overrides), *dropped_by_reason(ranking.dropped)])


def _data_dependent_op(error: BaseException) -> str | None:
    """The op a fake-tensor run stopped at because it needs data (torch's data-dependent errors carry it as
    ``func``), looked for along the chain of causes; ``None`` for any other error."""
    seen = error
    while seen is not None:
        if getattr(seen, "func", None) is not None and "fake" in type(seen).__module__:
            return str(seen.func)
        seen = seen.__cause__ or seen.__context__
    return None


def planned(name: str, model_cfg: Any, module: Any, batch: tuple[int, int]) -> str:
    """One line: the model and config planned, its parameter count, the batch, and whether remat was searched."""
    with deferred.deferred():  # shapes only
        params = module.init(core.random.key(0), model_cfg)
    count = sum(leaf.numel() for leaf in tree.leaves(params))
    remat = "" if any(f.name == "remat" for f in dataclasses.fields(model_cfg)) else \
        "; its Config has no remat field: planned without remat"
    return f"planning {name} {model_cfg!r}: {count:,} parameters, batch {batch[0]} × {batch[1]} tokens{remat}"


def dropped_by_reason(dropped: dict[Candidate, str]) -> list[str]:
    """``dropped`` counted by reason (its words before the first colon, a schedule's named once), each with one
    example: ``"dropped 10: cannot run (e.g. tp tp4 fp32: at ['blocks'][0]['wk'] ...)"``."""
    groups: dict[str, list[tuple[Candidate, str]]] = {}
    for cand, why in dropped.items():
        kind = "the schedule cannot be built" if why.startswith("schedule ") else why.split(":", 1)[0]
        groups.setdefault(kind, []).append((cand, why))
    lines = [f"dropped {len(dropped)}:" if dropped else "dropped none"]
    for kind, members in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        cand, why = members[0]
        example = why.split(":", 1)[1].strip() if ":" in why else why
        lines.append(f"  {len(members):>5} {kind} (e.g. {cand}: {example[:200]})")
    return lines


_CANDIDATE_KEYS = ("layout", "mesh", "microbatches", "schedule", "remat", "precision")  # PlanConf's candidate


def _store() -> None:
    ConfigStore.instance().store(name="plan", node=PlanConf)


def main(argv: Sequence[str] | None = None) -> int:
    """Compose the ``plan`` config from ``argv`` overrides and print the plan; return the exit code.

    ``calibrate`` and ``validate`` as the first argument run those instead (module docstring).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] != ["validate"] and {"-h", "--help"} & set(args):  # validate: its own options (argparse)
        register()
        with initialize_config_dir(version_base="1.3", config_dir=str(CONF), job_name="plan"):
            print(usage(__doc__, compose("plan")))
        return 0
    if args[:1] == ["calibrate"]:
        return _calibrate(args[1:])
    if args[:1] == ["validate"]:
        from experiments.bench import plan as bench

        bench.main(args[1:])
        return 0
    register()
    _store()
    # the candidate's keys go in after Hydra composes: `mesh` and `precision` are also the train app's config groups,
    # and Hydra would take `mesh=dp8` for a choice of one
    given = [a for a in args if a.split("=", 1)[0] in _CANDIDATE_KEYS]
    try:
        overrides = app_overrides([a for a in args if a not in given])
        with initialize_config_dir(version_base="1.3", config_dir=str(CONF), job_name="plan"):
            cfg = own_model(compose("plan", overrides=overrides), overrides)
        cfg.merge_with_dotlist(given)
        print(run(cfg))
    except (ConfigError, HydraException, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _calibrate(args: list[str]) -> int:
    from experiments.calibrate import calibrate, write

    world = int(args[0]) if args else 4
    path = write(calibrate(world), CONF / "cluster" / "this.yaml")
    print(f"wrote {path}")
    return 0


_store()

if __name__ == "__main__":
    sys.exit(main())

