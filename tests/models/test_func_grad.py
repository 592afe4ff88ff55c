"""torch.func.grad differentiates the models' losses on one device (docs/models.md: models are pure functions that
torch.func transforms), equal to core.grad's autograd gradients."""

import functools

import pytest
import torch

import core
import models
from shardings.testing import assert_close


@pytest.mark.parametrize("module", [models.gpt, models.moe, models.mlp], ids=lambda m: m.__name__)
def test_torch_func_grad_equals_core_grad(module):
    cfg = module.Config(layers=2)
    params, batch = module.init(core.random.key(0), cfg), module.example_batch(cfg, 2, with_ignored=True)
    got = torch.func.grad(functools.partial(module.loss, cfg=cfg))(params, batch)
    assert_close(got, core.grad(module.loss)(params, batch, cfg), terms=batch["tokens"].numel())
