"""Testing helpers for sharded code: hypothesis strategies (``meshes``, ``specs``)."""

from shardings.testing.strategies import meshes, specs

__all__ = ["meshes", "specs"]
