"""ZeRO-3 parameter residency: where a parameter stored sharded is whole, and for how long.

Placeholders gathered when an op first uses them (``lazy_params``), the one backward re-gather mechanism
both execution paths share (``gather_params.Regather``), and the DTensor path's bucketed gathers
(``gather_buckets``).

May import: ``shardings.spec``, ``shardings.runtime``, ``shardings.comm``.
"""
