"""The train step: sharded ``init`` (``initialize``), ``train_step`` (``train_step``: it chooses among three
gradient paths from data — ``local_step`` for layouts that split only the batch, ``pipeline_path`` for a pipelined
layout, ``dtensor_path`` otherwise — each handed the small named records of ``context`` and returning what it made —
and shares the ``update`` after them), which leaves a process holds and
updates (``ownership``), precision casts (``mixed``), batch placement (``batching``), and the whole-step picture
(``layout_view.describe``).

May import: everything above it (``spec``, ``runtime``, ``comm``, ``residency``, ``ops``, ``pipeline``).
"""
