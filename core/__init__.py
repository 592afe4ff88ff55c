"""Distribution-free functional layer: pytrees, random keys, transforms, optimizers, precision."""

from core import offload, optim, precision, random, tree
from core.transforms import grad, jit, remat, value_and_grad, vmap

__all__ = ["grad", "jit", "offload", "optim", "precision", "random", "remat", "tree", "value_and_grad", "vmap"]
