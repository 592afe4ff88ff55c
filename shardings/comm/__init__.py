"""Communication: axis-named collectives with their transposes (``axis_comm``, ``collectives``), ``shard_map``,
flat buffers and buckets that move many leaves in one collective (``flat_comm``, ``buckets``), and what was sent
and held (``accounting``: ``comms``, ``memory``; ``peak_memory``).

May import: ``shardings.spec``, ``shardings.runtime``.
"""
