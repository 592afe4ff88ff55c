"""Benchmarks (not tests): shardlab against what a PyTorch user writes, ratios measured in one run.

Each module runs with ``python -m experiments.bench.<module>`` and prints a table (``--help`` for its options):

- ``wrappers``: our layouts against torch's DDP, FSDP2 and ``parallelize_module`` on 4 processes (also
  ``python -m experiments.bench``);
- ``jit``: a whole single-device train step, eager and ``core.jit``, against the native model;
- ``optim``: ``core.optim.adamw`` against ``torch.optim.AdamW(foreach=True)``;
- ``random_normal``: ``core.random.normal`` against ``torch.randn``;
- ``pipeline``: pipeline parallelism's activation memory, bubble and step time;
- ``pipeline_torch``: our schedules against ``torch.distributed.pipelining``;
- ``native_gpt``: the anchor they measure against, ``models.gpt`` as ``nn.Module``\\s (not a benchmark);
- ``tables``: the CSV writer they share;
- ``compile_backend``: the ``--jit-backend`` option of ``wrappers`` and ``jit`` (``inductor``; ``aot_eager`` for tests).

``docs/performance.md`` has the numbers.
"""
