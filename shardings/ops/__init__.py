"""Layout-aware ops a model calls: ``einsum`` on local blocks (``local_einsum``), row-wise functions on local
blocks (``blockwise``), ring attention, the vocab-parallel embedding and cross-entropy, SDPA sharding
strategies, and tensor parallelism for ``nn.Module`` models (``module_tp``).

May import: ``shardings.spec``, ``shardings.runtime``, ``shardings.comm``, ``shardings.residency``.
"""
