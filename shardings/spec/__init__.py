"""The spec language: what a layout *says*, with no collective of its own.

``Mesh``/``P``/``NamedSharding`` (``mesh``), logical ``Rules`` and their lowering to DTensor placements
(``rules``, ``lower``), layouts — six rule tables each — and the presets (``layouts``, ``layouts_cp_ep``),
``shard``/``reshard``/``gather`` (``distribute``), the active mesh and ``constrain`` (``context``),
``visualize``, errors, and the placeholder protocol other layers implement (``placeholder``).

May import: nothing else in ``shardings``.
"""
