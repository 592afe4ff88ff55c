"""Checkpoints from pp on real processes: each rank writes its own stage's blocks; the checkpoint loads on one
device (every block, bitwise as the owners held them) and back into absent blocks under pp."""

import torch

import core
import models
import shardings
from shardings import Mesh, checkpoint
from shardings.spec.distribute import gather

CFG = models.gpt.Config(vocab=64, dim=32, layers=4, heads=4, kv_heads=2, seq_len=8, mlp=64)


def _save_and_reload(root: str) -> dict:
    mesh = Mesh(pp=4)
    make = lambda: shardings.init(models.gpt.init, core.random.key(0), CFG, axes=models.gpt.axes(CFG),
                                  layout="pp", mesh=mesh)
    params = make()
    step = shardings.train_step(models.gpt.stages(CFG), core.optim.adamw(1e-2), layout="pp", mesh=mesh,
                                plan=shardings.pipeline.plan("pp", mesh, params, microbatches=4))
    state = step.init(params)
    params, state, _ = step(params, state, models.gpt.example_batch(CFG, 8))
    checkpoint.save(root, {"params": params, "opt_state": state}, step=1)
    fresh = make()  # absent blocks where params has them
    loaded, at = checkpoint.load(root, like={"params": fresh, "opt_state": step.init(fresh)})
    return {"saved": gather(step.gather_stages(params)), "reloaded": gather(step.gather_stages(loaded["params"])),
            "step": at}


def test_a_pp_checkpoint_from_real_ranks_loads_on_one_device_and_back(tmp_path):
    ranks = shardings.launch(_save_and_reload, 4, str(tmp_path))
    saved = ranks[0]["saved"]
    for r in ranks:
        assert r["step"] == 1
        for a, b in zip(core.tree.leaves(r["reloaded"]), core.tree.leaves(saved)):
            assert torch.equal(a, b)  # back under pp: each rank's own blocks, read from the owners
    whole, step = checkpoint.load(tmp_path)  # one device, no like: every tensor whole
    assert step == 1
    params = {k[len("['params']"):]: v for k, v in whole.items() if k.startswith("['params']")}
    for path, x in core.tree.leaves_with_path(saved):
        assert torch.equal(params[core.tree.keystr(path)], x)
