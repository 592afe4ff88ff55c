"""``models.mlp`` with a misspelled logical name: block 0's ``w_up`` is named ``("embed", "mpl")``.

For the apps' message on a logical-name typo (``model.name=tests.experiments.axes_typo``): "unknown logical name
'mpl' ... did you mean 'mlp'?" at that key path, a skipped job in a sweep.
"""

from __future__ import annotations

from models.mlp import Config, example_batch, init, loss
from models.mlp import axes as _mlp_axes

__all__ = ["Config", "axes", "example_batch", "init", "loss"]


def axes(cfg: Config) -> dict:
    """mlp's names, with the typo."""
    names = _mlp_axes(cfg)
    names["blocks"][0]["w_up"] = ("embed", "mpl")
    return names
