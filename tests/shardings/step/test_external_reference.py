"""An external reference: torch's own DDP + AdamW and FSDP2 (``fully_shard``) over 3 steps on the same weights
as shardlab's ``dp`` and ``zero3`` (real gloo ranks): params and grads must agree."""

import functools

import pytest
import torch
from torch.distributed.tensor import DTensor

import core
import models.gpt as gpt
import shardings
from shardings import Mesh
from shardings.testing import assert_close

# -- an external reference: torch's DDP + AdamW and FSDP2 on the same weights ------------------------------------------


NATIVE = dict(vocab=32, dim=16, layers=2, heads=2, mlp=32, seq_len=8)  # untied: NativeGpt mirrors untied models
NATIVE_STEPS = 3


def _native_tree(model, cfg, grads):
    """``model``'s full weights (or grads) as a gpt tree: FSDP2's DTensor shards gathered, DDP's tensors as they are."""
    from experiments.bench import native_gpt

    plain = native_gpt.NativeGpt(cfg)
    with torch.no_grad():
        for (name, p), (plain_name, q) in zip(model.named_parameters(), plain.named_parameters(), strict=True):
            assert name == plain_name, (name, plain_name)
            x = p.grad if grads else p
            x = (x.full_tensor() if isinstance(x, DTensor) else x).detach().clone()
            if grads:
                q.grad = x
            else:
                q.copy_(x)
    return native_gpt.to_params(plain, grads=grads)


def _torch_and_ours_on_ranks(steps):
    """On each gloo rank: per layout, per step, the full grads and params of torch's wrapper and of shardlab's step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from experiments.bench import native_gpt

    torch.set_num_threads(1)
    cfg = gpt.Config(**NATIVE)
    batch = gpt.example_batch(cfg, 4)  # no ignored labels: DDP/FSDP2 average per-rank means, equal token counts
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    rows = len(batch["tokens"]) // world
    local = {k: v[rank * rows:(rank + 1) * rows] for k, v in batch.items()}
    out = {}
    for layout in ("dp", "zero3"):
        model = native_gpt.from_params(gpt.init(core.random.key(0), cfg), cfg)
        if layout == "dp":
            wrapped = DistributedDataParallel(model)
        else:  # FSDP2 as torchtitan wraps it: each block, then the root (embedding, final norm, unembedding)
            dp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
            for block in model.blocks:
                fully_shard(block, mesh=dp_mesh)
            wrapped = fully_shard(model, mesh=dp_mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)  # = core.optim.adamw(1e-3)
        theirs = []
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            wrapped(local).backward()
            grads = _native_tree(model, cfg, grads=True)
            opt.step()
            theirs.append({"grads": grads, "params": _native_tree(model, cfg, grads=False)})
        mesh = Mesh(dp=world)
        params = shardings.init(gpt.init, core.random.key(0), cfg, axes=gpt.axes(cfg), layout=layout, mesh=mesh)
        step = shardings.train_step(functools.partial(gpt.loss, cfg=cfg), core.optim.adamw(1e-3), layout=layout,
                                    mesh=mesh)
        state, ours = step.init(params), []
        for _ in range(steps):
            _, grads, _ = step.grads(params, batch)
            params, state = step.apply(params, state, grads)
            ours.append({"grads": shardings.gather(grads), "params": shardings.gather(params)})
        out[layout] = theirs, ours
    return out


@pytest.mark.multiprocess
def test_dp_and_zero3_match_torch_ddp_and_fsdp2_with_adamw_over_three_steps():
    per_rank = shardings.launch(_torch_and_ours_on_ranks, 2, NATIVE_STEPS, backend="gloo")
    cfg = gpt.Config(**NATIVE)
    init = gpt.init(core.random.key(0), cfg)
    tokens = 4 * cfg.seq_len
    for rank, out in enumerate(per_rank):
        for layout, torch_name in (("dp", "DDP"), ("zero3", "FSDP2")):
            theirs, ours = out[layout]
            assert len(theirs) == len(ours) == NATIVE_STEPS
            for i, (t, o) in enumerate(zip(theirs, ours), start=1):
                for quantity in ("grads", "params"):
                    assert_close(o[quantity], t[quantity], terms=tokens,
                                 msg=f"{layout} vs {torch_name}, rank {rank}, step {i}, {quantity}")
            # not vacuous: the weights moved, and so did the gradients between steps
            assert not torch.equal(ours[-1]["params"]["blocks"][0]["wq"], init["blocks"][0]["wq"])
            assert not torch.equal(ours[0]["grads"]["unembed"], ours[-1]["grads"]["unembed"])
