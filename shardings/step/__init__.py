"""The train step: sharded ``init`` (``initialize``), ``train_step`` and its DTensor path (``train_step``), the
local path for layouts that split only the batch (``local_step``), and the whole-step picture
(``layout_view.describe``).

May import: everything above it (``spec``, ``runtime``, ``comm``, ``residency``, ``ops``).
"""
