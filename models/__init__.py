"""Pure reference models: each module has ``Config``, ``init``, ``axes``, ``apply``, ``loss``, ``example_batch``."""

from types import ModuleType

from models import gpt, mlp, moe

__all__ = ["get", "gpt", "mlp", "moe", "names"]

_MODELS = {"gpt": gpt, "mlp": mlp, "moe": moe}


def names() -> list[str]:
    """The names :func:`get` knows, sorted.

    >>> names()
    ['gpt', 'mlp', 'moe']
    """
    return sorted(_MODELS)


def get(name: str) -> ModuleType:
    """The model module called ``name``.

    >>> get("gpt").Config().heads
    4

    Raises:
        ValueError: an unknown name.
    """
    if name not in _MODELS:
        raise ValueError(f"models.get: unknown model {name!r}. Fix: use one of {names()}.")
    return _MODELS[name]
