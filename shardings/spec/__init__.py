"""The spec language: what a layout *says*, with no collective of its own.

``Mesh``/``P``/``NamedSharding`` (``mesh``), logical ``Rules`` and their lowering to DTensor placements
(``rules``, ``lower``), layouts — six rule tables each, the preset registry (``layouts``) and the presets'
table (``presets``, imported here so that every preset is registered whichever spec module is imported first)
— ``shard``/``reshard``/``gather`` (``distribute``), the active mesh and ``constrain`` (``context``),
``visualize``, errors, and the placeholder protocol other layers implement (``placeholder``).

May import: nothing else in ``shardings``.
"""

from shardings.spec import presets  # noqa: F401  (registers the built-in presets)
