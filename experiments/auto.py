"""``layout=auto``: the planner picks the layout, mesh and pipeline a run trains with; and the clusters it plans for.

Below both apps that use it: ``experiments.build`` (which resolves ``layout=auto`` once, for ``experiments.train``)
and ``experiments.plan`` (the planner's command line) import this module, and it imports neither, so the
experiments' modules import one way (``tests/test_architecture.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf, open_dict

import core
import shardings
from shardings.planner import Candidate, Cluster, Space, row_tokens

__all__ = ["CONF", "auto", "load_cluster"]

CONF = Path(__file__).parent / "conf"


@contextlib.contextmanager
def _own_hydra() -> Iterator[None]:
    """Hydra's compose API in a process whose Hydra may already be initialized (``experiments.train``'s app with
    ``layout=auto``): the app's instance is set aside while ours composes, then put back."""
    outer = GlobalHydra.instance().hydra
    GlobalHydra.instance().clear()
    try:
        yield
    finally:
        GlobalHydra.instance().hydra = outer  # `initialize` swaps the singleton on exit: reach it again


def load_cluster(name: str) -> Cluster:
    """The cluster ``name`` from ``experiments/conf/cluster`` (its Hydra defaults applied: ``h100x64`` is 8
    ``h100x8`` nodes); callable from inside a running Hydra app."""
    with _own_hydra(), initialize_config_dir(version_base="1.3", config_dir=str(CONF), job_name="cluster"):
        cfg = compose(overrides=[f"+cluster={name}"])
    return Cluster.from_dict(OmegaConf.to_container(cfg.cluster, resolve=True))



def train_overrides(cand: Candidate) -> list[str]:
    """The ``experiments.train`` overrides that run planner candidate ``cand`` (the train app's keys live here, not
    in the planner: ``Ranking.table(k, train_overrides)`` prints the winner with them).

    >>> train_overrides(Candidate("zero1+pp", (("pp", 2), ("dp", 2)), 4, "1f1b", None, False, "bf16"))
    ['layout=zero1+pp', 'mesh=pp2_dp2', 'precision=bf16', 'pipeline.schedule=1f1b', 'pipeline.microbatches=4']
    """
    out = [f"layout={cand.layout}", f"mesh={cand.mesh_name}", f"precision={cand.precision}"]
    if cand.pipelined:
        out += [f"pipeline.schedule={cand.schedule}", f"pipeline.microbatches={cand.microbatches}"]
        if cand.virtual_stages:
            out.append(f"pipeline.virtual_stages={cand.virtual_stages}")
        if cand.seq_chunks > 1:
            out.append(f"pipeline.seq_chunks={cand.seq_chunks}")
    elif cand.microbatches > 1:
        out.append(f"accum_steps={cand.microbatches}")
    if cand.remat:
        out.append("model.config.remat=true" if cand.remat is True else "offload=activations")
    return out


def auto(cfg: Any, module: ModuleType, model_cfg: Any) -> Any:
    """``layout=auto`` in a composed ``train`` config: plan ``module`` (its config ``model_cfg``) at the configured
    batch and world size on this machine's cluster (``cluster/this.yaml``, one node of that many ranks), print
    the table, and return a copy of ``cfg`` with the winner's layout, mesh, pipeline and accumulation (the precision
    and remat as configured). Any other layout: ``cfg`` unchanged."""
    if str(cfg.layout) != "auto":
        return cfg
    world = (cfg.get("runtime") or {}).get("world_size") or math.prod(dict(cfg.mesh.sizes).values())
    cluster = dataclasses.replace(load_cluster("this"), nodes=1, per_node=world)
    data = cfg.get("data")
    rows = data.batch_size if data is not None else cfg.batch_size
    seq = (data.seq_len if data is not None else None) or row_tokens(module, model_cfg)
    precision = core.precision.name_of(str((cfg.get("precision") or {}).get("compute", "float32")))
    space = Space(precisions=(precision,), remat=(getattr(model_cfg, "remat", False),), offload=False)
    ranking = shardings.plan(module, model_cfg, (rows, seq), cluster, space=space, top_k=5, budget_s=20)
    print(ranking.table(5, train_overrides))
    best = ranking.winner.candidate
    out = cfg.copy()
    with open_dict(out):
        out.layout, out.mesh.sizes = best.layout, dict(best.sizes)
        if best.pipelined:
            out.pipeline.schedule, out.pipeline.microbatches = best.schedule, best.microbatches
            out.pipeline.virtual_stages = best.virtual_stages
        else:
            out.accum_steps = best.microbatches
    return out
