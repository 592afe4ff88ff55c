"""Checkpoints of a whole train state over ``torch.distributed.checkpoint`` (DCP): atomic, verified, reshardable.

A state is any pytree: params and optimizer state (DTensors or plain tensors), the RNG key, the
data position, a config dict. Tensor leaves go to DCP, keyed by their ``core.tree.keystr`` path, so
each rank writes only its own shards; every other leaf (numbers, strings, ``None``) goes to
``manifest.json`` with the step, the global shape and dtype of every tensor, and the size and
SHA-256 of every file.

Layout on disk, under the root ``path``::

    step_120/            a complete checkpoint: DCP files + manifest.json (written last)
    step_130.tmp/        a save in flight (or one that crashed): ignored by latest() and load()

A save writes into ``step_N.tmp``; when every rank has finished, rank 0 writes the manifest and
renames the folder to ``step_N`` (a rename is atomic), then deletes all but the newest ``keep``.
So a crash at any point leaves the previous checkpoint intact, and ``latest`` never sees half a save.
A checkpoint damaged later (a file lost, truncated or corrupted on disk) fails :func:`load`; :func:`resume`
skips it, with a :class:`CheckpointWarning` naming it and why, and loads the newest one that verifies.

Loading reshards: ``like`` is a state in the target layout (say from ``shardings.init`` and
``step.init``, on another mesh), or plain tensors for one device; DCP reads each rank's blocks
from whichever saved shards overlap them. Before anything is read, every file is checked against
the manifest (missing, truncated or corrupted files are named), and every key path, shape and
dtype of ``like`` against the saved ones. Nothing untrusted is unpickled: tensor files are read by
DCP with ``torch.load(weights_only=True)``; DCP's ``.metadata`` is a pickle, read here by an
unpickler that only builds DCP's own metadata classes, ``torch.Size`` and dtypes, and only after
its SHA-256 matched the (JSON) manifest.

Under ``shardings.simulate`` (one process, a fake process group) each tensor is gathered and saved
whole from the one process; the files are the same format, so such checkpoints load on real ranks
and vice versa.

Saving is in :mod:`shardings.checkpoint.saving`, finding and loading in :mod:`shardings.checkpoint.loading`.
The on-disk side (manifest, hashes, the safe metadata reader) is in :mod:`shardings.checkpoint.files`;
how tensors become what DCP writes and reads (whole on simulated ranks, shards on real ones, another pipeline
stage's absent blocks skipped) in :mod:`shardings.checkpoint.tensors`.

May import: every other subpackage but ``testing``.
"""

from shardings.checkpoint.files import MANIFEST as MANIFEST  # the manifest's file name, read by tests
from shardings.checkpoint.files import CheckpointError, CheckpointWarning
from shardings.checkpoint.files import _describe_files as _describe_files  # re-exported: tests use it here
from shardings.checkpoint.files import _MetadataUnpickler as _MetadataUnpickler  # re-exported: tests use it here
from shardings.checkpoint.loading import latest, load, resume, saved_values
from shardings.checkpoint.saving import PendingSave, add_save_hook, save

__all__ = ["CheckpointError", "CheckpointWarning", "PendingSave", "add_save_hook", "latest", "load", "resume", "save",
           "saved_values"]
