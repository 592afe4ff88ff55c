"""Distribution-free functional layer: pytrees, random keys, transforms, optimizers, precision."""

from core import optim, precision, random, tree
from core.transforms import grad, jit, remat, value_and_grad, vmap

__all__ = ["grad", "jit", "optim", "precision", "random", "remat", "tree", "value_and_grad", "vmap"]
