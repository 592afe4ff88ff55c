"""The :mod:`models.gpt` decoder with a mixture-of-experts MLP every ``moe_every`` blocks.

An MoE block replaces the SwiGLU MLP by ``experts`` SwiGLU experts stacked on a leading
``expert`` axis and a softmax router: each token goes to its ``top_k`` experts, their outputs
weighted by the router probabilities renormalized over the chosen ``k`` (Mixtral).

**Auxiliary losses, per sequence.** Two router losses join the cross-entropy, each computed for
every sequence (batch row) ``r`` from its own tokens: the load-balancing loss
``LB_r = E · Σ_e f_{e,r} · P_{e,r}`` (Switch/GShard's form; ``f_{e,r}`` the fraction of the row's
``top_k`` assignments routed to expert ``e``, ``P_{e,r}`` the row's mean router probability of
``e``; 1 when balanced) and the router z-loss ``z_r`` = the mean over the row's tokens of
``logsumexp(logits)²`` (ST-MoE). :func:`loss` weighs the rows as the cross-entropy weighs tokens:
``aux = Σ_r n_r · aux_r / Σ_r n_r``, ``n_r`` the row's labels ≠ ``ignore_index`` (a row whose
labels are all ignored still routes its tokens but adds no aux loss). Balancing per sequence is
DeepSeek-V3's "complementary sequence-wise auxiliary loss" (arXiv:2412.19437, §2.1.2).

Why per row: the row is already the routing group (capacity below), and the whole loss becomes a
token-weighted sum over rows, so any split of the batch by rows (data-parallel ranks, each
weighted by its token share; accumulation microbatches; both) reproduces the single-device loss
and gradients exactly (in exact arithmetic; only rounding differs), with no collective for the
statistics. Statistics over the whole batch could not be split so: a microbatch cannot see the
other microbatches' tokens, and the local train-step path runs the loss on each rank's rows
with no mesh (``shardings.step.local_step``), so it has no all-reduce to call.

**Capacity.** Each sequence (batch row) is a routing group: expert ``e`` takes at most
``C = ceil(capacity_factor · seq · top_k / experts)`` of a row's assignments, first choices of
every token before second choices, earlier tokens first; the rest are dropped (the token keeps
its residual only). ``capacity_factor=None`` is dropless (``C = seq``: every assignment fits, at
``experts / top_k`` times the dispatch buffer). Groups are rows, so drops never depend on how
the batch is split across ranks.

**Expert parallelism.** Under a mesh the MoE MLP runs inside :func:`shardings.shard_map`. When
the layout maps ``expert`` to a mesh axis (preset ``ep``), each rank packs its tokens into an
``(experts, slots, dim)`` buffer, ``all_to_all`` sends every expert's slots to the rank holding it,
the local experts run, and the reverse ``all_to_all`` brings the outputs back to be combined: 2
all-to-alls forward and their 2 transposes backward. Without ``ep`` the same function runs every
expert locally. The experts' ``mlp`` dim may be on ``tp`` (``tp+ep``): partial outputs are psummed.

Parameter tree: :mod:`models.gpt`'s, where every MoE block has, instead of ``w_gate/w_up/w_down``::

    {"router": (dim, experts),
     "w_gate": (experts, dim, expert_mlp), "w_up": (experts, dim, expert_mlp),
     "w_down": (experts, expert_mlp, dim)}
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import einops
import torch
import torch.nn.functional as F

import core
from models import gpt
from models.layers import cross_entropy, einsum, next_token_batch, rms_norm
from shardings import P, all_to_all, constrain, current, logical_to_spec, psum, shard_map, sharding_error
from shardings.pipeline import Stages

__all__ = ["Config", "apply", "apply_with_aux", "axes", "capacity", "example_batch", "init", "loss", "moe_mlp",
           "stages"]

Params = dict[str, Any]
Aux = dict[str, torch.Tensor]
RESIDUAL = gpt.RESIDUAL
EXPERT_IN, EXPERT_OUT = ("expert", "embed", "mlp"), ("expert", "mlp", "embed")


@dataclasses.dataclass(frozen=True)
class Config(gpt.Config):
    """:class:`models.gpt.Config` plus the mixture of experts. Defaults: a tiny model for CPU tests.

    Raises:
        ValueError: what ``gpt.Config`` rejects; ``top_k`` outside ``[1, experts]``; a non-positive
            ``experts``, ``moe_every``, ``expert_mlp`` or ``capacity_factor``.
    """

    experts: int = 4  # experts per MoE block
    top_k: int = 2  # experts per token (Mixtral/GShard: 2)
    moe_every: int = 2  # blocks moe_every-1, 2·moe_every-1, ... are MoE (GShard/Switch: every other block)
    expert_mlp: int | None = None  # hidden width of one expert; None -> mlp
    capacity_factor: float | None = 1.25  # slots per expert per row, x the fair share; None = dropless
    aux_loss_coef: float = 0.01  # load-balancing loss weight (Switch Transformer)
    z_loss_coef: float = 1e-3  # router z-loss weight (ST-MoE)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("experts", "moe_every", "d_expert"):
            if getattr(self, name) < 1:
                raise ValueError(f"moe.Config: {name}={getattr(self, name)} must be >= 1. Fix: pass a positive value.")
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(
                f"moe.Config: top_k={self.top_k} must be in [1, experts={self.experts}]. Fix: lower top_k."
            )
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(
                f"moe.Config: capacity_factor={self.capacity_factor} must be > 0. Fix: pass e.g. 1.25, "
                f"or None for dropless routing."
            )

    @property
    def d_expert(self) -> int:
        """The hidden width of one expert (``expert_mlp``, or ``mlp`` when unset)."""
        return self.mlp if self.expert_mlp is None else self.expert_mlp

    def is_moe(self, layer: int) -> bool:
        """Whether block ``layer`` has the MoE MLP."""
        return layer % self.moe_every == self.moe_every - 1


def capacity(cfg: Config, seq: int) -> int:
    """Slots per expert per row of ``seq`` tokens (``seq`` when dropless: nothing can overflow).

    >>> capacity(Config(experts=4, top_k=2, capacity_factor=1.0), seq=8)
    4
    """
    if cfg.capacity_factor is None:
        return seq
    return min(seq, math.ceil(cfg.capacity_factor * seq * cfg.top_k / cfg.experts))


def init(key: torch.Tensor, cfg: Config) -> Params:
    """Random parameters: :func:`models.gpt.init`'s, with the MoE blocks' MLP replaced by router + experts.

    Each leaf is one ``core.random`` draw times a scalar (block-evaluable); expert ``w_down`` uses
    gpt's scaled output std.

    >>> p = init(core.random.key(0), Config(layers=2))
    >>> tuple(p["blocks"][1]["w_up"].shape)
    (4, 128, 384)
    """
    k_dense, k_moe = core.random.split(key, 2)
    params = gpt.init(k_dense, cfg)
    std, out_std = cfg.init_std, cfg.init_std / (2 * cfg.layers) ** 0.5
    for i, block in enumerate(params["blocks"]):
        if not cfg.is_moe(i):
            continue
        kr, kg, ku, kd = core.random.split(core.random.fold_in(k_moe, i), 4)
        for name in ("w_gate", "w_up", "w_down"):
            del block[name]
        block["router"] = core.random.normal(kr, (cfg.dim, cfg.experts)) * std
        block["w_gate"] = core.random.normal(kg, (cfg.experts, cfg.dim, cfg.d_expert)) * std
        block["w_up"] = core.random.normal(ku, (cfg.experts, cfg.dim, cfg.d_expert)) * std
        block["w_down"] = core.random.normal(kd, (cfg.experts, cfg.d_expert, cfg.dim)) * out_std
    return params


def axes(cfg: Config) -> Params:
    """Logical axis names of every parameter dim, in the same tree structure as :func:`init`.

    The router's expert dim has no name (always whole: every token scores every expert).

    >>> axes(Config(layers=2))["blocks"][1]["w_down"]
    ('expert', 'mlp', 'embed')
    """
    tree = gpt.axes(cfg)
    for i, block in enumerate(tree["blocks"]):
        if cfg.is_moe(i):  # same key order as init (tree structures compare it)
            for name in ("w_gate", "w_up", "w_down"):
                del block[name]
            block.update(router=("embed", None), w_gate=EXPERT_IN, w_up=EXPERT_IN, w_down=EXPERT_OUT)
    return tree


# -- the MoE MLP on one rank's tokens ----------------------------------------------------------------


def _route(x: torch.Tensor, router: torch.Tensor, cfg: Config):
    """Top-k routing of ``x: (b, s, dim)``: expert ids, renormalized weights, and each row's aux losses ``(b,)``."""
    logits = einsum(x.float(), router.float(), "b s e, e x -> b s x")  # (b, s, experts), float32
    probs = torch.softmax(logits, dim=-1)
    top_p, top_i = probs.topk(cfg.top_k, dim=-1)  # (b, s, k)
    weights = top_p / top_p.sum(-1, keepdim=True)
    chosen = F.one_hot(top_i, cfg.experts).float()  # (b, s, k, experts)
    seq = x.shape[1]
    f = chosen.sum((1, 2)) / (seq * cfg.top_k)  # (b, experts): the row's share of assignments per expert
    aux = {  # per row: the row is the group (as capacity's), so no statistic crosses rows or ranks
        "load_balance": cfg.experts * (f * probs.mean(1)).sum(-1),
        "z_loss": torch.logsumexp(logits, -1).pow(2).mean(-1),
    }
    return top_i, weights, chosen, aux


def _slots(chosen: torch.Tensor, top_i: torch.Tensor, cap: int, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot of each assignment in its row's ``(experts · cap)`` buffer (``experts · cap`` = dropped) and keep mask."""
    order = einops.rearrange(chosen, "b s k x -> b (k s) x")  # priority: all first choices, then second, ...
    position = ((order.cumsum(1) - 1) * order).sum(-1)  # (b, k·s): place in the expert's queue of this row
    position = einops.rearrange(position, "b (k s) -> b s k", k=top_i.shape[-1]).long()
    keep = position < cap
    slot = torch.where(keep, top_i * cap + position, experts * cap)  # (b, s, k)
    return slot, keep


def _experts(buf: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """SwiGLU of each expert on its slots: ``buf (experts, slots, dim)`` → same shape."""
    up = lambda w: einsum(buf, w, "x t e, x e f -> x t f")  # (experts, slots, expert_mlp)
    hidden = F.silu(up(w_gate)) * up(w_up)
    return einsum(hidden, w_down, "x t f, x f e -> x t e")


def _moe_local(x, router, w_gate, w_up, w_down, *, cfg: Config, ep_axes=(), tp_axes=()):
    """The MoE MLP on this rank's whole rows ``x: (b, s, dim)``; experts local, or routed over ``ep_axes``.

    Returns the output ``(b, s, dim)`` and the rows' aux losses ``{"load_balance", "z_loss"}``, each ``(b,)``.
    """
    b, s, dim = x.shape
    cap, experts = capacity(cfg, s), cfg.experts
    top_i, weights, chosen, aux = _route(x, router, cfg)
    slot, keep = _slots(chosen, top_i, cap, experts)
    row_slots = experts * cap + 1  # one dummy slot per row receives the dropped assignments
    index = (slot + _arange(slot, b)[:, None, None] * row_slots).flatten()  # (b·s·k,) into (b·row_slots, dim)
    sent = einops.repeat(x, "b s e -> (b s k) e", k=cfg.top_k)
    buf = x.new_zeros(b * row_slots, dim).index_add(0, index, sent)
    buf = einops.rearrange(buf.unflatten(0, (b, row_slots))[:, :-1], "b (x c) e -> x (b c) e", x=experts)
    if ep_axes:  # experts' slots to the ranks holding them: (experts, b·cap, dim) -> (experts / ep, ep·b·cap, dim)
        buf = all_to_all(buf, ep_axes, 0, 1, tiled=True)
    out = _experts(buf, w_gate, w_up, w_down)
    if tp_axes:  # each rank computed its slice of the experts' hidden dim
        out = psum(out, tp_axes)
    if ep_axes:  # and back to the tokens' ranks
        out = all_to_all(out, ep_axes, 1, 0, tiled=True)
    out = einops.rearrange(out, "x (b c) e -> b (x c) e", b=b)
    out = torch.cat((out, out.new_zeros(b, 1, dim)), dim=1).flatten(0, 1)  # (b·row_slots, dim), dummy = 0
    gathered = out.index_select(0, index).unflatten(0, (b, s, cfg.top_k))  # (b, s, k, dim)
    combine = (weights * keep).to(x.dtype)  # a dropped assignment contributes nothing
    return einsum(gathered, combine, "b s k e, b s k -> b s e"), aux


def _arange(x: torch.Tensor, n: int) -> torch.Tensor:
    return x.new_ones(n, dtype=torch.int64).cumsum(0) - 1


def _entry(axes: tuple[str, ...]) -> Any:
    return None if not axes else axes[0] if len(axes) == 1 else axes


def moe_mlp(p: Params, x: torch.Tensor, cfg: Config) -> tuple[torch.Tensor, Aux]:
    """The MoE MLP of one block on ``x: (batch, seq, dim)``: output and each row's aux losses.

    The aux losses ``{"load_balance", "z_loss"}`` are ``(batch,)`` tensors: row ``r``'s ``LB_r`` and
    ``z_r`` (module docstring), computed from that row's tokens only.

    Under an active mesh it runs inside ``shard_map``: tokens stay split over the data axes the
    rules give ``batch`` (minus the experts' ``mlp`` axes; rows are kept whole so capacity groups
    and aux losses do not depend on the layout), experts over the axes of ``expert`` (all-to-all
    dispatch) and their hidden dim over the axes of ``mlp`` (psum of partial outputs). The aux
    losses come out split over the batch like the tokens: no collective computes them.

    Raises:
        ShardingError: ``experts`` not divisible by the expert-parallel ranks.

    >>> cfg = Config(layers=2)
    >>> y, aux = moe_mlp(init(core.random.key(0), cfg)["blocks"][1], torch.randn(2, 8, cfg.dim), cfg)
    >>> y.shape, {k: tuple(v.shape) for k, v in aux.items()}
    (torch.Size([2, 8, 128]), {'load_balance': (2,), 'z_loss': (2,)})
    """
    weights = (p["router"], p["w_gate"], p["w_up"], p["w_down"])
    ctx = current()
    if ctx is None:
        return _moe_local(x, *weights, cfg=cfg)
    mesh, rules = ctx.mesh, ctx.rules
    w_axes = logical_to_spec(EXPERT_IN, rules, mesh).dim_axes()
    ep_axes, tp_axes = w_axes[0], w_axes[2]
    if cfg.experts % mesh.axis_size(ep_axes):
        raise sharding_error(
            f"moe: {cfg.experts} experts cannot be split evenly over {ep_axes} ({mesh.axis_size(ep_axes)} ranks)",
            fix="use a number of experts divisible by the expert-parallel ranks, or a smaller ep axis",
            spec=P(_entry(ep_axes)),
            mesh=mesh,
        )
    token_axes = tuple(a for a in logical_to_spec(RESIDUAL, rules, mesh).dim_axes()[0] if a not in tp_axes)
    x_spec = P(_entry(token_axes))  # the tokens' rows, and the (batch,) aux losses: split alike
    w_in, w_out = P(_entry(ep_axes), None, _entry(tp_axes)), P(_entry(ep_axes), _entry(tp_axes))
    local = functools.partial(_moe_local, cfg=cfg, ep_axes=ep_axes, tp_axes=tp_axes)
    return shard_map(local, mesh, (x_spec, P(), w_in, w_in, w_out), (x_spec, x_spec))(x, *weights)


# -- the model ----------------------------------------------------------------------------------------


def _block(p: Params, x: torch.Tensor, cfg: Config) -> tuple[torch.Tensor, Aux]:
    x = gpt._attention_residual(p, x, cfg)
    y, aux = moe_mlp(p, constrain(rms_norm(x, p["mlp_norm"], cfg.norm_eps), gpt.BLOCK_INPUT), cfg)
    return x + constrain(y, RESIDUAL), aux


def apply_with_aux(params: Params, tokens: torch.Tensor, cfg: Config) -> tuple[torch.Tensor, Aux]:
    """Logits ``(batch, seq, vocab)`` and the rows' auxiliary losses ``(batch,)`` summed over the MoE blocks.

    ``aux`` is ``{"load_balance", "z_loss"}`` (empty when no block is MoE); :func:`loss` weighs its rows.

    >>> cfg = Config(layers=2)
    >>> logits, aux = apply_with_aux(init(core.random.key(0), cfg), torch.zeros(2, 4, dtype=torch.int64), cfg)
    >>> logits.shape, aux["z_loss"].shape
    (torch.Size([2, 4, 256]), torch.Size([2]))
    """
    carry, block = (gpt.embed(params, tokens), {}), _carry_block(cfg)  # ((batch, seq, dim), aux so far)
    for i, p in enumerate(params["blocks"]):
        carry = block(p, carry, i)
    x, total = carry
    return gpt.logits(params, x, cfg), total


def _carry_block(cfg: Config):
    """Block ``i`` on the carry ``(x, aux summed so far)``: dense or MoE by ``cfg.is_moe(i)``."""
    dense, sparse = functools.partial(gpt._block, cfg=cfg), functools.partial(_block, cfg=cfg)
    if cfg.remat:
        policy = "offload" if cfg.remat == "offload" else None
        dense, sparse = core.remat(dense, policy=policy), core.remat(sparse, policy=policy)

    def block(p: Params, carry: tuple[torch.Tensor, Aux], i: int) -> tuple[torch.Tensor, Aux]:
        x, total = carry
        if not cfg.is_moe(i):
            return dense(p, x), total
        x, aux = sparse(p, x)
        return x, ({k: total[k] + v for k, v in aux.items()} if total else aux)

    return block


def apply(params: Params, tokens: torch.Tensor, cfg: Config) -> torch.Tensor:
    """Next-token logits ``(batch, seq, vocab)`` for int64 ``tokens: (batch, seq)``.

    >>> cfg = Config(layers=2)
    >>> apply(init(core.random.key(0), cfg), torch.zeros(2, 5, dtype=torch.int64), cfg).shape
    torch.Size([2, 5, 256])
    """
    return apply_with_aux(params, tokens, cfg)[0]


def loss(params: Params, batch: dict[str, torch.Tensor], cfg: Config) -> torch.Tensor:
    """Cross-entropy + ``aux_loss_coef`` · load-balancing loss + ``z_loss_coef`` · router z-loss.

    The aux losses are per row (module docstring), combined as the cross-entropy combines tokens:
    each row weighs its counted labels (``labels != ignore_index``), ``Σ_r n_r · aux_r / Σ_r n_r``
    (0 when every label is ignored). So the loss of a batch is its rows' token-weighted sum, and
    any split of it by rows, weighted by token share, adds up to it exactly: what
    :func:`shardings.train_step` does per rank and microbatch, as long as its ``token_count``
    counts the same labels (the default counts labels ≠ -100, this config's default ``ignore_index``).

    >>> cfg = Config(layers=2)
    >>> loss(init(core.random.key(0), cfg), example_batch(cfg, 2), cfg).shape
    torch.Size([])
    """
    logits, aux = apply_with_aux(params, batch["tokens"], cfg)
    return _logits_loss(logits, aux, batch, cfg)


def stages(cfg: Config) -> Stages:
    """The pipeline declaration (``shardings.pipeline``): the carry between blocks is ``(x, aux so far)``.

    :func:`loss` is these composed (through :func:`apply_with_aux`: the same block and head functions).
    """
    return Stages(first=lambda params, batch: (gpt.embed(params, batch["tokens"]), {}), block=_carry_block(cfg),
                  last=functools.partial(_head_loss, cfg=cfg),
                  carry_names=lambda carry: (RESIDUAL, {k: ("batch",) for k in carry[1]}))


def _head_loss(params: Params, carry: tuple[torch.Tensor, Aux], batch: dict[str, torch.Tensor],
               cfg: Config) -> torch.Tensor:
    x, aux = carry
    return _logits_loss(gpt.logits(params, x, cfg), aux, batch, cfg)


def _logits_loss(logits: torch.Tensor, aux: Aux, batch: dict[str, torch.Tensor], cfg: Config) -> torch.Tensor:
    labels = constrain(batch["labels"], gpt.BATCH_INPUT)
    ce = cross_entropy(logits, labels, cfg.ignore_index)
    if not aux:
        return ce
    per_row = cfg.aux_loss_coef * aux["load_balance"] + cfg.z_loss_coef * aux["z_loss"]  # (batch,)
    return ce + _weigh_rows(per_row, labels, cfg.ignore_index)


def _weigh_rows(per_row: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """``Σ_r n_r · per_row_r / Σ_r n_r`` with ``n_r`` row ``r``'s labels ≠ ``ignore_index`` (0 if none counts).

    The rows' weights are the cross-entropy's token counts, so a rank or microbatch weighted by its token
    share contributes exactly its rows' part of the whole batch's value.
    """
    counted = (labels != ignore_index).float().sum(-1)  # (batch,)
    return (counted * per_row).sum() / counted.sum().clamp(min=1.0)


def example_batch(cfg: Config, batch_size: int, seed: int = 0, with_ignored: bool = False) -> dict[str, torch.Tensor]:
    """A deterministic synthetic batch ``{"tokens", "labels"}`` of shape ``(batch_size, cfg.seq_len)``.

    >>> example_batch(Config(), 2)["tokens"].shape
    torch.Size([2, 64])
    """
    return next_token_batch(cfg.vocab, cfg.seq_len, batch_size, seed, cfg.ignore_index, with_ignored)
