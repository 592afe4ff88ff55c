"""Cases the pipeline tests share (a module of cases, not a test file): the small models, their inputs split into
microbatches, drawn and hand-edited schedules."""

import dataclasses
import re

import torch
from hypothesis import strategies as st
from torch.utils import _pytree as pytree

import core
import models
from shardings import default_token_count
from shardings.pipeline.schedule import SCHEDULES, Action, Schedule, build

MODELS = {
    "gpt": (models.gpt, dict(vocab=64, dim=32, heads=4, kv_heads=2, seq_len=8, mlp=64)),
    # tied embedding: the first stage's lookup and the last stage's head add up to its gradient
    "gpt_tied": (models.gpt, dict(vocab=64, dim=32, heads=4, kv_heads=2, seq_len=8, mlp=64, tie_embeddings=True)),
    "mlp": (models.mlp, dict(vocab=64, dim=32, mlp=64)),
    "moe": (models.moe, dict(vocab=64, dim=32, heads=4, kv_heads=2, seq_len=8, mlp=32, experts=4, top_k=2)),
}
REAL_CFG = models.gpt.Config(vocab=64, dim=32, layers=5, heads=4, kv_heads=2, seq_len=8, mlp=64)  # 5 layers, 4 stages
REAL_PP, REAL_M = 4, 4
_KIND = {"F": "F", "B": "B", "W": "W", "sF": "SEND_F", "rF": "RECV_F", "sB": "SEND_B", "rB": "RECV_B"}


def setup(model: str, layers: int, batch_size: int, with_ignored: bool = True):
    """``(module, cfg, params, batch)`` of one of :data:`MODELS` with ``layers`` blocks."""
    module, kw = MODELS[model]
    cfg = module.Config(layers=layers, **kw)
    return module, cfg, module.init(core.random.key(0), cfg), module.example_batch(cfg, batch_size,
                                                                                    with_ignored=with_ignored)


def microbatches(batch, m) -> tuple[list, list[torch.Tensor]]:
    """``batch`` as ``m`` microbatches (each its own storage) and each one's share of the tokens."""
    mbs = [pytree.tree_map(lambda x, i=i: x.chunk(m)[i].clone(), batch) for i in range(m)]  # own storage each
    total = default_token_count(batch)
    return mbs, [default_token_count(mb) / total for mb in mbs]


def real_rank_inputs():
    """``(params, microbatches, weights)`` of :data:`REAL_CFG` for the real-rank pipeline tests."""
    params = models.gpt.init(core.random.key(0), REAL_CFG)
    mbs, weights = microbatches(models.gpt.example_batch(REAL_CFG, 2 * REAL_M, with_ignored=True), REAL_M)
    return params, mbs, weights


def any_schedule(data: st.DataObject) -> Schedule:
    """A schedule of any kind ``build`` knows, at small sizes (interleaved: m a multiple of pp, v in 1..3)."""
    name = data.draw(st.sampled_from(sorted(SCHEDULES)), label="schedule")
    pp = data.draw(st.integers(1, 5), label="pp")
    if name == "interleaved_1f1b":
        return build(name, pp, pp * data.draw(st.integers(1, 3)), virtual_stages=data.draw(st.integers(1, 3)))
    return build(name, pp, data.draw(st.integers(1, 10), label="m"))


def parse(program: str, stage: int) -> tuple[Action, ...]:
    """``"rF0 F0 sF0"`` -> the actions of ``stage`` those labels name (the inverse of ``str(Action)``)."""
    labels = [re.fullmatch(r"([a-zA-Z]+)(\d+)", word).groups() for word in program.split()]
    return tuple(Action(_KIND[kind], stage, int(mb)) for kind, mb in labels)


def with_rank(schedule: Schedule, rank: int, program: str, stage: int | None = None) -> Schedule:
    """``schedule`` with rank ``rank``'s program replaced by ``program`` (of stage ``rank`` unless given)."""
    ranks = list(schedule.ranks)
    ranks[rank] = parse(program, rank if stage is None else stage)
    return dataclasses.replace(schedule, ranks=tuple(ranks))


def split_after_b(schedule: Schedule) -> Schedule:
    """``schedule`` with a W right after each B: the same work as its whole backwards, split."""
    ranks = tuple(tuple(x for a in actions for x in ([a, Action("W", a.stage, a.mb)] if a.kind == "B" else [a]))
                  for actions in schedule.ranks)
    return dataclasses.replace(schedule, name=schedule.name + "+W", ranks=ranks)
