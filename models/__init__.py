"""Pure reference models: each module has ``Config``, ``init``, ``axes``, ``apply``, ``loss``, ``example_batch``."""

from types import ModuleType

from models import gpt, mlp

__all__ = ["get", "gpt", "mlp"]

_MODELS = {"gpt": gpt, "mlp": mlp}


def get(name: str) -> ModuleType:
    """The model module called ``name``.

    >>> get("gpt").Config().heads
    4

    Raises:
        ValueError: an unknown name.
    """
    if name not in _MODELS:
        raise ValueError(f"models.get: unknown model {name!r}. Fix: use one of {sorted(_MODELS)}.")
    return _MODELS[name]
