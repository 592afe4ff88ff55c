"""DTensor sharding strategies for tensor checks, ``aten._assert_async`` (registered on import).

``F.one_hot`` (a top-k router's count of chosen experts, for one) checks its indices in range. On real data it reads
them (``.item()``); on tensors without data, which is what ``torch.compile`` traces (fake tensors), it emits
``aten._assert_async(min(x) >= 0)`` and ``aten._assert_async(max(x) < num_classes)`` instead. DTensor has no
strategy for either overload, so a compiled block that called ``F.one_hot`` on DTensors failed to trace
(``NotImplementedError: Operator aten._assert_async.msg does not have a sharding strategy registered``) where the
eager step ran it.

The op returns nothing: its strategy keeps the checked tensor where it is (no communication), except a ``Partial``
one, whose local value is not the value being checked: it is reduced (replicated) first. A check of a split tensor
checks each rank's block, which is what a check of the whole asks (every element).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate

from shardings.runtime.compat import DTensorSpec, OpSchema, OpSpec, OpStrategy

__all__ = ["ASSERT_OPS", "check_strategy"]

_aten = torch.ops.aten
ASSERT_OPS = (_aten._assert_async.default, _aten._assert_async.msg)


def check_strategy(op_schema: OpSchema) -> OpStrategy:
    """The checked tensor as it is (a ``Partial`` reduced first); the op has no output to place."""
    checked = op_schema.args_schema[0]
    if not isinstance(checked, OpStrategy):
        raise TypeError(f"{op_schema.op}: expected a DTensor to check, got {type(checked).__name__}")
    options = []
    for spec in checked.strategies:
        have = spec.output_spec
        want = DTensorSpec(have.mesh, tuple(Replicate() if p.is_partial() else p for p in have.placements),
                           tensor_meta=have.tensor_meta)
        options.append(OpSpec(output_specs=want, input_specs=(want,),
                              redistribute_cost=[[0.0 if want.placements == have.placements else 1.0]]))
    return OpStrategy(options)


for _op in ASSERT_OPS:
    DTensor._op_dispatcher.sharding_propagator.register_op_strategy(_op, check_strategy)
