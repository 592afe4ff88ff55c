"""Presets ``cp``, ``cp_allgather`` and ``ep``: context and expert parallelism as rule tables.

``cp`` puts the sequence dim of the batch and of every activation (``seq`` and ``block_seq``) on
mesh axis ``cp``; parameters stay replicated over it and their gradients (``Partial`` over ``cp``)
are reduced over it by the train step like data-parallel ones. :func:`shardings.attention` sees
``seq`` sharded and runs ring attention. ``cp_allgather`` differs in one rule: ``kv_seq`` (the seq
dim of K/V as attention consumes them) is replicated, so attention all-gathers K/V instead of
passing them around.

Composed with ``tp+sp``, the residual stream's seq is split over ``("cp", "tp")`` (cp major): a
combination rule placed after tp's rules (so attention keeps heads on tp and seq on cp) and before
cp's own. Block inputs (``block_seq``) stay on cp only: sp gathers over tp, cp keeps its split.

``ep`` puts the ``expert`` dim of expert weights on mesh axis ``ep`` in every role, and treats
``ep`` as a data axis for tokens (DeepSpeed-MoE style): the batch is split over ``(dp, fsdp, ep)``,
so non-expert parameters see ``ep`` as data parallelism (grads reduced over it) while MoE layers
route each rank's tokens to the experts' ranks with ``all_to_all``. It ranks first so that its
``expert`` rule beats ``tp``'s ``expert → None`` and its batch rule beats the data presets'.
"""

from __future__ import annotations

from shardings.spec.layouts import DATA_AXES, Layout, register, register_combination
from shardings.spec.rules import Rules

__all__ = ["CP_AXIS", "EP_AXIS"]

CP_AXIS = "cp"
EP_AXIS = "ep"

_SEQ = Rules([("seq", CP_AXIS), ("block_seq", CP_AXIS)])  # block inputs stay split too: cp is not sp
register("cp", Layout(batch=_SEQ, activations=_SEQ + Rules([("kv_seq", CP_AXIS)])),
         group="cp", needs=((CP_AXIS,),), rank=15)
register("cp_allgather", Layout(batch=_SEQ, activations=_SEQ + Rules([("kv_seq", None)])),
         group="cp", needs=((CP_AXIS,),), rank=15)

register_combination(("cp", "sp"), Layout(activations=Rules([("seq", (CP_AXIS, "tp"))])), rank=12)

_EXPERT = Rules([("expert", EP_AXIS)])
_TOKENS = Rules([("batch", (*DATA_AXES, EP_AXIS))])
register("ep", Layout(params=_EXPERT, compute=_EXPERT, grads=_EXPERT, opt_state=_EXPERT, batch=_TOKENS,
                      activations=_TOKENS + _EXPERT),
         group="ep", needs=((EP_AXIS,),), rank=-10)
