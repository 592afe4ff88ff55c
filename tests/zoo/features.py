"""How each feature of the zoo's matrix runs a cell ``(model, family, feature)`` (the table: ``tests/zoo/__init__.py``).

Real-process features share launches: every ``real``/``jit`` cell of a world size runs in one launch
(``shardings.testing.check_equivalences``), and every ``train`` cell of a world size in another
(:func:`train_all`: each rank runs experiments.train's loop, ``run_rank``, once per cell)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import core
import shardings
from core import tree
from core.deferred import deferred
from shardings import Mesh, checkpoint
from shardings.testing import assert_close, check_equivalence
from tests.zoo import LAYOUTS, config, module

BATCH = 8  # rows: 2 data-parallel ranks × 2 microbatches × 2
ADAMW = functools.partial(core.optim.adamw, 1e-3)
# resume: momentum SGD, whose state (the momentum) must come back for step 2 to match, and which is linear in the
# gradient: AdamW turns a leaf whose true gradient is 0 (a key bias) and whose layouts' rounding differs into
# lr-sized steps of either sign (check_equivalence allows for that; a plain comparison of two layouts cannot)
MOMENTUM = functools.partial(core.optim.sgd, 0.1, momentum=0.9)


def mesh_of(family: str) -> Mesh:
    return Mesh(**LAYOUTS[family][1])


def check_args(model: str, family: str, feature: str) -> dict[str, Any]:
    """``check_equivalence``'s arguments for an equivalence cell (simulated, bf16, real, jit)."""
    m, cfg = module(model), config(model, family)
    layout, _, schedule = LAYOUTS[family]
    args = dict(init=m.init, loss=m.loss, axes=m.axes, cfg=cfg, batch=m.example_batch(cfg, BATCH),
                layouts=[layout], mesh=mesh_of(family), stages=m.stages, schedule=schedule)
    if feature == "simulated":  # SGD: the update is the gradient, so step 2 checks step 1's update exactly; one step
        return {**args, "steps": 2 if args["mesh"].size <= 4 else 1}  # on 8 ranks (~40 s a step here under ZB-V)
    args = {**args, "steps": 1, "optimizer": ADAMW}
    if feature == "bf16":
        return {**args, "precision": core.precision.Policy.bf16_mixed()}
    return {**args, "jit": feature == "jit"}


def check_simulated(model: str, family: str, feature: str) -> Any:
    return check_equivalence(**check_args(model, family, feature), runtime="simulate")


def train_overrides(model: str, family: str, runtime: str = "multiprocess") -> list[str]:
    """experiments.train's overrides for the cell: 2 steps of ``model.name=tests.zoo.<model>``."""
    layout, sizes, schedule = LAYOUTS[family]
    out = [f"model.name=tests.zoo.{model}", f"layout={layout}", "mesh=single", f"runtime={runtime}", "steps=2",
           "progress=false", "data.max_bytes=200000", f"data.batch_size={BATCH}", "optim.warmup_steps=0"]
    out += [f"++mesh.sizes.{axis}={n}" for axis, n in sizes.items()]
    if schedule:
        out.append(f"pipeline.schedule={schedule}")
    if config(model, family).layers != module(model).Config().layers:
        out.append(f"model.config.layers={config(model, family).layers}")
    return out


def _train_all(jobs: dict[str, tuple[dict, str]]) -> dict[str, Any]:
    """One real rank: experiments.train's loop for every job in turn (one process start for all of them)."""
    from experiments.train import run_rank

    out = {}
    for name, (conf, out_dir) in jobs.items():
        try:
            out[name] = run_rank(conf, out_dir)
        except Exception as e:
            e.add_note(f"while training {name!r} (one launch trains every cell of this world size in turn)")
            raise
    return out


def train_all(confs: dict[str, Any], root: Path) -> dict[str, list[dict]]:
    """Train each of ``confs`` (name -> composed train config) on real processes, one launch per world size;
    name -> its metrics.jsonl records."""
    from omegaconf import OmegaConf

    from experiments.build import build

    by_size: dict[int, dict[str, tuple[dict, str]]] = {}
    for name, cfg in confs.items():
        setup = build(cfg)  # what experiments.train checks before any process starts
        out_dir = root / name.replace(" ", "_").replace("+", "-")
        out_dir.mkdir(parents=True)
        by_size.setdefault(setup.mesh.size, {})[name] = (OmegaConf.to_container(setup.conf, resolve=True), str(out_dir))
    for size, jobs in by_size.items():
        shardings.launch(_train_all, size, jobs)
    return {name: [json.loads(line) for line in Path(job[1], "metrics.jsonl").read_text().splitlines()]
            for jobs in by_size.values() for name, job in jobs.items()}


def resume_target(family: str) -> str:
    return "zero3" if family != "zero3" else "tp+sp"


def _state(model: str, cfg: Any, family: str, batches: list[Any], steps: int) -> tuple[dict, Any]:
    """``(state, step_fn)`` after ``steps`` momentum-SGD steps of the cell's layout (simulated ranks)."""
    m = module(model)
    layout, sizes, schedule = LAYOUTS[family]
    mesh = Mesh(**sizes)
    where = {}
    if schedule:
        with deferred():  # recipes: shapes only, nothing drawn
            shaped = m.init(core.random.key(0), cfg)
        where = {"plan": shardings.pipeline.plan(layout, mesh, shaped, schedule=schedule)}
    params = shardings.init(m.init, core.random.key(0), cfg, axes=m.axes(cfg), layout=layout, mesh=mesh, **where)
    loss = m.stages(cfg) if schedule else functools.partial(m.loss, cfg=cfg)
    step_fn = shardings.train_step(loss, MOMENTUM(), layout=layout, mesh=mesh, **where)
    opt_state = step_fn.init(params)
    for batch in batches[:steps]:
        params, opt_state, _ = step_fn(params, opt_state, batch)
    return {"params": params, "opt_state": opt_state}, step_fn


def _full(state: Any, step_fn: Any) -> dict[str, Any]:
    sync = getattr(step_fn, "gather_stages", lambda t: t)
    whole = shardings.gather(sync(state))
    return {tree.keystr(p): shardings.unwrap(x) for p, x in tree.leaves_with_path(whole)}


def resume(model: str, family: str, root: Path) -> tuple[dict, dict]:
    """Save after step 1 under ``family``, resume under :func:`resume_target`, take step 2: (resumed, uninterrupted)
    full values of the loss and params after step 2."""
    cfg = config(model, family)
    m, other = module(model), resume_target(family)
    batches = [m.example_batch(cfg, BATCH, seed=i) for i in range(2)]  # built outside simulate: one stream
    runs = {}
    for name, fam, save in (("uninterrupted", family, True), ("resumed", other, False)):
        with shardings.simulate(mesh_of(fam).size):
            if save:
                state, step_fn = _state(model, cfg, fam, batches, 1)
                checkpoint.save(root, state, step=1)
            else:
                like, step_fn = _state(model, cfg, fam, batches, 0)
                state, at = checkpoint.load(root, like)
                assert at == 1
            params, _, metrics = step_fn(state["params"], state["opt_state"], batches[1])
            runs[name] = {"loss": shardings.unwrap(shardings.gather(metrics["loss"])),
                          **_full({"params": params}, step_fn)}
    return runs["resumed"], runs["uninterrupted"]


def assert_resumed_equal(model: str, family: str, root: Path) -> None:
    got, want = resume(model, family, root)
    cfg = config(model, family)
    terms = BATCH * getattr(cfg, "seq_len", getattr(cfg, "tokens", 1))
    assert_close(got, want, terms=terms)
