"""A stage's backward split in two, exactly: ``B`` (the input gradient) now, ``W`` (the weight gradient) later.

Zero-bubble schedules need the previous stage's input gradient early and the weight gradient whenever the rank
is idle. Autograd computes both in one pass; the split follows torch's ``stage_backward_input`` /
``stage_backward_weight``. The graph's nodes fall in two kinds: those on a path to the stage's input (``I``)
and those only on paths to parameters. ``B`` runs autograd to the inputs only, so it skips every weight-only
node, and a pre-hook records the gradient arriving at each ``I`` node with a weight-only child (a matmul whose
other operand is a weight: its ``dW`` is skipped). ``W`` re-enters the graph at those nodes with the recorded
gradients (``GradientEdge``), one autograd call per group of parameters reached from the same nodes, so no
gradient is counted twice. A node runs the same kernel on the same inputs in ``B``, ``W`` and a whole backward,
and what arrives at a recorded node is accumulated in the same order (its parents are all on the input path),
so ``B`` then ``W`` gives the whole backward's gradients bitwise; the graph outside the recorded nodes is
freed after ``B``.

A compiled graph's backward (``train_step(jit=True)``'s block: AOTAutograd's ``CompiledFunction``) is one opaque
node that computes the gradient of every input whatever ``B`` asks for: re-entering it in ``W`` would run the
block's whole backward twice. So ``B`` keeps what such a node already computed for its weight-only children (a
post-hook) and ``W`` re-enters below the node, at those children, with those gradients: the node runs once, and
``W`` holds the block's weight gradients (not its saved activations) until it runs. ``B`` keeps the graph for the
eager nodes ``W`` re-enters (``retain_graph``), which torch refuses for a compiled backward that reuses its saved
tensors' storage (AOTAutograd's donated buffers, on by default): that check is relaxed for ``B``'s call, as the
compiled node, which runs once, is the only reader of those tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from shardings.runtime.compat import AOT_RUNTIME_MODULE, aot_config_patch, grad_from_edges

__all__ = ["PendingWeightGrad", "backward_input", "backward_weight"]


@dataclass
class PendingWeightGrad:
    """What ``W`` needs: per group, the nodes to re-enter with their recorded gradients and its parameters."""

    groups: list[tuple[list[Any], list[int]]]  # ([node, ...], [index into params, ...])
    recorded: dict[Any, tuple[torch.Tensor | None, ...]]  # node -> the gradients of its outputs
    # a compiled graph's node -> (the edge to a weight-only child, the gradient B computed for it)
    computed: dict[Any, list[tuple[GradientEdge, torch.Tensor]]] = dataclasses.field(default_factory=dict)


def _compiled(node: Any) -> bool:
    """Whether ``node`` is a compiled graph's backward (AOTAutograd's ``CompiledFunction``: one node for a whole
    ``torch.compile``d block), which computes every input's gradient in one call (module docstring)."""
    return getattr(getattr(node, "_forward_cls", None), "__module__", "") == AOT_RUNTIME_MODULE


def _post_order(roots: list[Any]) -> list[Any]:
    """Every node reachable from ``roots``, each after all of its children (iterative: graphs are deep)."""
    order, seen, stack = [], set(), [(r, False) for r in roots]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
        elif node not in seen:
            seen.add(node)
            stack.append((node, True))
            stack.extend((k, False) for k, _ in node.next_functions if k is not None and k not in seen)
    return order


def _groups(roots: list[Any], inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor]):
    """The nodes ``W`` re-enters, grouped by the parameters they reach (module docstring)."""
    to_input = {get_gradient_edge(t).node for t in inputs}
    param_at = {get_gradient_edge(t).node: i for i, t in enumerate(params)}
    on_input: dict[Any, bool] = {}
    reaches: dict[Any, frozenset[int]] = {}  # node -> the params below it
    for node in _post_order(roots):
        kids = [k for k, _ in node.next_functions if k is not None]
        on_input[node] = node in to_input or any(on_input[k] for k in kids)
        below = {param_at[node]} if node in param_at else set()
        reaches[node] = frozenset(below.union(*(reaches[k] for k in kids)))
    groups: list[tuple[list[Any], set[int]]] = []
    for node in reaches:  # in post order: deterministic
        if on_input[node]:
            mine = set().union(*(reaches[k] for k, _ in node.next_functions if k is not None and not on_input[k]))
        else:
            mine = set(reaches[node]) if node in roots else set()
        if not mine:
            continue
        nodes = [node]
        for other in [g for g in groups if g[1] & mine]:  # parameters reached from several nodes: one group
            groups.remove(other)
            nodes, mine = other[0] + nodes, other[1] | mine
        groups.append((nodes, mine))
    return [(nodes, sorted(mine)) for nodes, mine in groups], on_input


def backward_input(outputs: Sequence[torch.Tensor], cotangents: Sequence[torch.Tensor],
                   inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor]
                   ) -> tuple[list[torch.Tensor | None], PendingWeightGrad]:
    """``B``: the gradients of ``inputs`` (``None`` where unused), and what ``backward_weight`` needs."""
    # an output that is a leaf is an input passed through (a carry's untouched part): autograd.grad handles it
    roots = list(dict.fromkeys(o.grad_fn for o in outputs if o.grad_fn is not None))
    groups, on_input = _groups(roots, inputs, params)
    recorded: dict[Any, tuple[torch.Tensor | None, ...]] = {}
    for o, c in zip(outputs, cotangents):  # outputs off the input path: W starts from them
        if o.grad_fn is not None and not on_input[o.grad_fn]:
            grads = list(recorded.get(o.grad_fn, (None,) * (o.output_nr + 1)))
            grads += [None] * (o.output_nr + 1 - len(grads))
            grads[o.output_nr] = c if grads[o.output_nr] is None else grads[o.output_nr] + c
            recorded[o.grad_fn] = tuple(grads)
    hooked = [n for nodes, _ in groups for n in nodes if on_input[n]]
    computed: dict[Any, list[tuple[GradientEdge, torch.Tensor]]] = {}

    def keep(node: Any, grad_inputs: tuple[torch.Tensor | None, ...]) -> None:
        computed[node] = [(GradientEdge(kid, nr), g) for (kid, nr), g in zip(node.next_functions, grad_inputs)
                          if kid is not None and not on_input[kid] and g is not None]

    handles = [n.register_hook(lambda gi, _, n=n: keep(n, gi)) if _compiled(n)
               else n.register_prehook(lambda g, n=n: recorded.__setitem__(n, tuple(g))) for n in hooked]
    try:
        grads = [None] * len(inputs)
        if inputs:
            # retain_graph: for the eager nodes W re-enters. A compiled node never runs again (W starts below it), so
            # its donated buffers (saved tensors its backward may overwrite) are safe: torch's check is relaxed here
            with aot_config_patch(donated_buffer=False):
                grads = list(torch.autograd.grad(outputs, inputs, cotangents, retain_graph=True, allow_unused=True))
    finally:
        for h in handles:
            h.remove()
    return grads, PendingWeightGrad(groups, recorded, computed)


def backward_weight(pending: PendingWeightGrad, params: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """``W``: the gradients of ``params`` (``None`` where unused), from what ``backward_input`` recorded."""
    out: list[torch.Tensor | None] = [None] * len(params)
    for nodes, indices in pending.groups:
        edges, grads = [], []
        for node in nodes:
            for edge, g in pending.computed.get(node, ()):  # below a compiled node: what B computed
                edges.append(edge)
                grads.append(g)
            for nr, g in enumerate(pending.recorded.get(node, ())):
                if g is not None:
                    edges.append(GradientEdge(node, nr))
                    grads.append(g)
        if edges:
            found = grad_from_edges(edges, [params[i] for i in indices], grads)  # torch.autograd.grad
            for i, g in zip(indices, found):
                out[i] = g
    return out
