"""ZeRO-3 under remat (activation checkpointing per block), fp32 and bf16: each block's parameters are gathered once
in forward and once in backward (for the block's recomputation; its backward uses that copy, as FSDP with
activation checkpointing), and no gathered copy lives from a block's forward to its backward.

Two bugs this pins (found matching the planner's estimate against the fake step): under a bf16 policy the cast to
the compute dtype resolved every placeholder before the loss ran, so the checkpoint kept each block's gathered bf16
weights until backward (no re-gather, every block's weights alive at once); in fp32 the recomputation prefetched the
block *after* it (forward's order), never used: 2L - 1 gathers for L blocks.

Simulated ranks, a wide tiny gpt (weights, not activations, make the difference), 1 and 3 blocks, on the local and
the DTensor path. Counts and bytes are derived from the model's shapes, the memory bound from the per-role formulas
(``shardings.describe_layout``), not from a previous run.
"""

import functools
import gc
import math

import pytest

import core
import shardings
from models import gpt
from shardings import Mesh
from shardings.comm.peak_memory import peak_memory
from shardings.testing import check_equivalence

DP = 4
PRECISIONS = {"fp32": None, "bf16": core.precision.Policy.bf16_mixed}


def _cfg(layers):
    return gpt.Config(vocab=32, dim=64, layers=layers, heads=4, kv_heads=4, mlp=256, seq_len=4, remat=True)


def _marked_loss(params, batch, cfg, marks):
    """``gpt.loss``, noting the collectives counted so far and the live bytes when backward starts (the loss's
    gradient: its first hook)."""
    loss = gpt.loss(params, batch, cfg)
    c, m = marks.get("comms"), marks.get("memory")
    if c is not None:
        loss.register_hook(lambda g: marks.update(forward=c.totals(), live=m.live))
    return loss


@functools.cache
def _run(precision, local, layers):
    """One forward + backward on DP simulated ranks: ``(peak above entry, live above entry when backward starts,
    all_gather (count, bytes) in forward and in backward, bytes per role by the formulas)``. Cached: the tests
    share the runs."""
    cfg, mesh = _cfg(layers), Mesh(dp=DP)
    policy = PRECISIONS[precision]
    batch = gpt.example_batch(cfg, DP)  # one row of 4 tokens per rank
    marks = {}
    with shardings.simulate(DP):
        params = shardings.init(gpt.init, core.random.key(0), cfg, axes=gpt.axes(cfg), layout="zero3", mesh=mesh)
        loss = functools.partial(_marked_loss, cfg=cfg, marks=marks)
        step = shardings.train_step(loss, core.optim.sgd(0.1), layout="zero3", mesh=mesh, local=local,
                                    precision=policy() if policy else None)
        step.grads(params, batch)  # plans and caches built once
        gc.collect()
        with peak_memory() as m, shardings.comms() as c:
            marks["comms"], marks["memory"] = c, m
            step.grads(params, batch)
        view = shardings.describe_layout(params, gpt.axes(cfg), "zero3", mesh)
    gathers = {"forward": marks["forward"].get(("all_gather", "dp"), (0, 0))}
    total = c.totals().get(("all_gather", "dp"), (0, 0))
    gathers["backward"] = (total[0] - gathers["forward"][0], total[1] - gathers["forward"][1])
    roles = {role: sum(4 * r.count * math.prod(r.shape) * DP * r.shares[role] for r in view.rows)
             for role in ("grads", "compute")}  # fp32 bytes summed over the ranks
    return m.peak - m.at_entry, marks["live"] - m.at_entry, gathers, roles


def _block_params():
    """Parameters of one block of ``_cfg``, from the init's shapes."""
    blocks = [gpt.init(core.random.key(0), _cfg(n))["blocks"] for n in (1, 2)]
    return sum(x.numel() for x in core.tree.leaves(blocks[1])) - sum(x.numel() for x in core.tree.leaves(blocks[0]))


CASES = [(p, local) for p in PRECISIONS for local in (True, False)]
IDS = [f"{p}-{'local' if local else 'dtensor'}" for p, local in CASES]


@pytest.mark.parametrize(("precision", "local"), CASES, ids=IDS)
def test_backward_gathers_each_block_once(precision, local):
    """Backward's all_gathers under remat: one per block (its recomputation's; the block's backward uses that copy),
    each moving the block's parameters in the compute dtype: (DP-1)/DP of its gathered bytes, sent per rank. The
    root (embedding, final norm) stays gathered from forward. Forward: the root's and each block's, once."""
    itemsize = 2 if precision == "bf16" else 4
    block = _block_params() * itemsize * (DP - 1) / DP  # one block's gather, bytes sent per rank
    _, _, gathers, _ = _run(precision, local, 3)
    count, sent = gathers["backward"]
    assert count == 3 and sent == 3 * block, (gathers, block)
    assert gathers["forward"][0] == 4 and gathers["forward"][1] > 3 * block, gathers


def _inputs():
    """Bytes of 2 blocks' checkpointed inputs, summed over the ranks: one (1 row, seq, dim) residual per rank each,
    counted in fp32 (bf16's are half)."""
    cfg = _cfg(1)
    return 2 * DP * cfg.seq_len * cfg.dim * 4


@pytest.mark.parametrize(("precision", "local"), CASES, ids=IDS)
def test_no_gathered_weights_live_from_a_blocks_forward_to_its_backward(precision, local):
    """When backward starts, 2 more blocks hold only their checkpointed inputs: each checkpoint keeps the
    placeholders of its block's parameters, never the gathered copy (nor a cast of it, under bf16). A checkpoint
    that kept the gathered weights holds 2 more gathered blocks here, 128 times the inputs."""
    itemsize = 2 if precision == "bf16" else 4
    (_, small, _, roles_1), (_, large, _, roles_3) = (_run(precision, local, n) for n in (1, 3))
    gathered_block = (roles_3["compute"] - roles_1["compute"]) / 2 * itemsize / 4  # in the compute dtype
    growth = large - small
    assert 0 < growth <= _inputs(), (
        f"{precision} ({'local' if local else 'DTensor'} path): 2 more blocks hold {growth:,.0f} B more when backward "
        f"starts ({growth / gathered_block:.2f} gathered blocks of {gathered_block:,.0f} B); their inputs are "
        f"{_inputs():,.0f} B")


@pytest.mark.parametrize(("precision", "local"), CASES, ids=IDS)
def test_the_peak_holds_at_most_two_gathered_blocks_whatever_the_depth(precision, local):
    """From 1 to 3 blocks the step's peak grows by the 2 blocks' reduced gradients, their checkpointed inputs and at
    most one gathered block in the compute dtype: in backward a rank holds the block being recomputed (present at
    any depth) and the one before it, prefetched (absent with one block). Prefetches that pile up (the recomputation
    gathering the block after it, in forward's order, awaited only when the step ends) grow it by 2 gathered blocks
    here. (A checkpoint that kept every block's gathered bf16 weights grows it by 1: the peak, at the reduce-scatter
    of a block's fp32 gradients, is mostly transients; the test above sees those weights.)"""
    itemsize = 2 if precision == "bf16" else 4
    (small, _, _, roles_1), (large, _, _, roles_3) = (_run(precision, local, n) for n in (1, 3))
    grads = roles_3["grads"] - roles_1["grads"]  # the 2 blocks' reduced gradients (fp32), summed over the ranks
    gathered_block = (roles_3["compute"] - roles_1["compute"]) / 2 * itemsize / 4  # in the compute dtype
    growth = large - small
    assert grads <= growth <= grads + gathered_block + _inputs(), (
        f"{precision} ({'local' if local else 'DTensor'} path): 2 more blocks raised the peak by {growth:,.0f} B; "
        f"their gradients are {grads:,.0f} B, one gathered block {gathered_block:,.0f} B, inputs {_inputs():,.0f} B "
        f"(growth - grads = {(growth - grads) / gathered_block:.2f} gathered blocks)")


@pytest.mark.parametrize(("precision", "local"), CASES, ids=IDS)
def test_zero3_under_remat_with_accumulation_and_clipping_matches_one_device(precision, local):
    """The recomputation's gathers are the ones backward uses: the step equals the single-device reference under the
    same policy (bf16: its own rule, ``shardings.testing.tolerance``), with 2 microbatches and clipping."""
    cfg = gpt.Config(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, mlp=64, seq_len=8, remat=True)
    policy = PRECISIONS[precision]
    report = check_equivalence(gpt.init, gpt.loss, gpt.axes, cfg, gpt.example_batch(cfg, 8), layouts=["zero3"],
                               mesh=Mesh(dp=DP), steps=2, accum_steps=2, clip_norm=1.0, local=local,
                               precision=policy() if policy else None, fp32_twin=False)
    assert report.ok and len(report.rows) == 3 * 2
