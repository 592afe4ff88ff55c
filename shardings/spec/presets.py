"""The layout presets as data: each one's rule tables and how it composes, in one table.

Every preset is one :func:`~shardings.spec.layouts.register` call below: its rules per role, its group
(presets of one group are alternatives), the mesh axes it needs, the presets it requires, its rule tier
(:data:`~shardings.spec.layouts.TIERS`), whether it runs inside pipeline stages and whether it *is* the
pipeline. Aliases and the extra rules of a combination (``cp`` with ``sp``) are registered here too.

* **Data parallelism** (``dp``, ``zero1``/``zero2``/``zero3``, ``hsdp``) reduces over every data axis the mesh
  has — ``dp`` and ``fsdp`` — so ``zero3`` on ``Mesh(dp=2, fsdp=2)`` shards over 4 ranks, while ``hsdp`` shards
  over ``fsdp`` and replicates over ``dp``.
* **Tensor and sequence parallelism** (``tp``, ``sp``): heads, kv_heads, mlp and vocab on ``tp``; ``sp`` puts the
  residual stream's seq on ``tp`` too, after tp's rules, so inside attention and the MLP (where heads/mlp
  already hold tp) seq stays whole.
* **Context parallelism** (``cp``, ``cp_allgather``): the sequence dim of the batch and of every activation
  (``seq`` and ``block_seq``) on mesh axis ``cp``; parameters stay replicated over it and their gradients
  (``Partial`` over ``cp``) are reduced over it by the train step like data-parallel ones.
  :func:`shardings.attention` sees ``seq`` sharded and runs ring attention. ``cp_allgather`` differs in one
  rule: ``kv_seq`` (the seq dim of K/V as attention consumes them) is replicated, so attention all-gathers K/V
  instead of passing them around. Composed with ``tp+sp``, the residual stream's seq is split over
  ``("cp", "tp")`` (cp major): a combination rule placed after tp's rules (so attention keeps heads on tp and
  seq on cp) and before cp's own. Block inputs (``block_seq``) stay on cp only: sp gathers over tp, cp keeps
  its split.
* **Expert parallelism** (``ep``): the ``expert`` dim of expert weights on mesh axis ``ep`` in every role, and
  ``ep`` a data axis for tokens (DeepSpeed-MoE style): the batch is split over ``(dp, fsdp, ep)``, so
  non-expert parameters see ``ep`` as data parallelism (grads reduced over it) while MoE layers route each
  rank's tokens to the experts' ranks with ``all_to_all``. Its tier comes first so that its ``expert`` rule
  beats ``tp``'s ``expert → None`` and its batch rule beats the data presets'.
* **Pipeline parallelism** (``pp``): the blocks' index (logical name ``layers``, the i of
  ``params["blocks"][i]``) on mesh axis ``pp``. No tensor has that dim, so the tables place nothing: the train
  step splits the blocks into stages (``shardings.pipeline.plan``) and runs the presets that compose with it
  inside each stage.
* **Offload** (``offload_optimizer``, ``offload_params``): a role in host memory; composes with every preset but
  ``pp`` (ZeRO-Offload is ``zero2+offload_optimizer``).
"""

from __future__ import annotations

from shardings.spec.layouts import DATA_AXES, Layout, register, register_alias, register_combination
from shardings.spec.rules import Rules

__all__ = ["CP_AXIS", "EP_AXIS"]

CP_AXIS = "cp"
EP_AXIS = "ep"


def _shard_params_over(axes) -> Rules:
    # The first of these dims a tensor has is sharded over the data axes; the others are fallbacks
    # for tensors without an embed dim (a vocab-only or mlp-only tensor).
    return Rules([("embed", axes), ("vocab", axes), ("mlp", axes), ("heads", axes), ("kv_heads", axes)])


_DATA = Rules([("batch", DATA_AXES)])
_SHARDED = _shard_params_over(DATA_AXES)
_HSDP = _shard_params_over("fsdp")
_TP = Rules([("heads", "tp"), ("kv_heads", "tp"), ("mlp", "tp"), ("vocab", "tp"), ("expert", None)])
_SEQ = Rules([("seq", CP_AXIS), ("block_seq", CP_AXIS)])  # block inputs stay split too: cp is not sp
_EXPERT = Rules([("expert", EP_AXIS)])
_TOKENS = Rules([("batch", (*DATA_AXES, EP_AXIS))])
_PP = Rules([("layers", "pp")])
_DATA_NEEDS = (DATA_AXES,)
_IN_STAGES = {"composes_with_pp": True}  # runs inside each pipeline stage, on the stage mesh

register("dp", Layout(batch=_DATA, activations=_DATA), group="data", needs=_DATA_NEEDS, tier="data", **_IN_STAGES)
register("zero1", Layout(opt_state=_SHARDED, batch=_DATA, activations=_DATA), group="data", needs=_DATA_NEEDS,
         tier="data", **_IN_STAGES)
register("zero2", Layout(opt_state=_SHARDED, grads=_SHARDED, batch=_DATA, activations=_DATA), group="data",
         needs=_DATA_NEEDS, tier="data", **_IN_STAGES)
register("zero3", Layout(params=_SHARDED, grads=_SHARDED, opt_state=_SHARDED, batch=_DATA, activations=_DATA),
         group="data", needs=_DATA_NEEDS, tier="data", **_IN_STAGES)
register("hsdp", Layout(params=_HSDP, grads=_HSDP, opt_state=_HSDP, batch=_DATA, activations=_DATA),
         group="data", needs=(("fsdp",),), tier="data", **_IN_STAGES)
register("tp", Layout(params=_TP, compute=_TP, grads=_TP, opt_state=_TP, activations=_TP), group="tp",
         needs=(("tp",),), tier="tensor", **_IN_STAGES)
register("sp", Layout(activations=Rules([("seq", "tp")])), group="sp", needs=(("tp",),), requires=("tp",),
         tier="sequence", **_IN_STAGES)
register("pp", Layout(params=_PP, compute=_PP, grads=_PP, opt_state=_PP), group="pp", needs=(("pp",),),
         tier="pipeline", pipeline=True)
register("offload_optimizer", Layout(host=frozenset({"opt_state"})), group="offload_optimizer", tier="offload")
register("offload_params", Layout(host=frozenset({"params"})), group="offload_params", tier="offload")
register("cp", Layout(batch=_SEQ, activations=_SEQ + Rules([("kv_seq", CP_AXIS)])),
         group="cp", needs=((CP_AXIS,),), tier="context", **_IN_STAGES)
register("cp_allgather", Layout(batch=_SEQ, activations=_SEQ + Rules([("kv_seq", None)])),
         group="cp", needs=((CP_AXIS,),), tier="context", **_IN_STAGES)
register("ep", Layout(params=_EXPERT, compute=_EXPERT, grads=_EXPERT, opt_state=_EXPERT, batch=_TOKENS,
                      activations=_TOKENS + _EXPERT),
         group="ep", needs=((EP_AXIS,),), tier="expert", **_IN_STAGES)

register_combination(("cp", "sp"), Layout(activations=Rules([("seq", (CP_AXIS, "tp"))])), tier="context_tensor")

register_alias("fsdp", "zero3")
register_alias("ddp", "dp")
