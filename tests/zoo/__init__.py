"""The zoo: models written the way researchers write them, independent of ``models/``, run through every feature.

Each module (``tests.zoo.<name>``) has the model contract of docs/models.md: ``Config``, ``init``, ``axes``, ``loss``,
``stages`` and ``example_batch``. This file is the matrix as data: which layout families each model runs, which
features each cell is checked with, and the combinations a model cannot run, each with the error it gives (tested:
``tests/zoo/test_zoo_simulated.py``). docs/models.md shows it as a table (``zoo_table()``, kept in sync by a test).

The suite's form (``make test``) runs a deterministic sample of the cells that covers every model, every layout
family and every feature at least once (:func:`sample`); ``SHARDLAB_ZOO=full`` (``make test-zoo``) or
``HYPOTHESIS_PROFILE=explore`` runs every cell.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import random
from typing import Any

from shardings import LaunchError

MODELS = ("llama_gqa", "gpt2", "encoder", "vit", "moe_top2", "gated_conv")

# family -> (layout, mesh sizes, pipeline schedule): pp families under a zero-bubble schedule (ZB-V: 2 stages a rank)
LAYOUTS: dict[str, tuple[str, dict[str, int], str | None]] = {
    "dp": ("dp", {"dp": 2}, None),
    "zero3": ("zero3", {"dp": 2}, None),
    "tp+sp": ("tp+sp", {"tp": 2}, None),
    "zero3+tp+sp": ("zero3+tp+sp", {"dp": 2, "tp": 2}, None),
    "cp": ("cp", {"cp": 2}, None),
    "ep": ("ep", {"ep": 2}, None),
    "dp+pp": ("dp+pp", {"dp": 2, "pp": 2}, "zb_h1"),
    "zero3+tp+pp": ("zero3+tp+pp", {"dp": 2, "tp": 2, "pp": 2}, "zb_v"),
}

# feature -> what a cell checks
FEATURES = {
    "simulated": "check_equivalence on simulated ranks, fp32, 2 SGD steps",
    "bf16": "check_equivalence on simulated ranks under Policy.bf16_mixed(), and its fp32 twin, 1 AdamW step",
    "real": "check_equivalence on real processes (gloo), fp32, 1 AdamW step",
    "jit": "check_equivalence of train_step(jit=True) on real processes (aot_eager), 1 AdamW step",
    "train": "experiments.train's training loop (model.name=tests.zoo.<m>) on real processes, 2 steps",
    "resume": "a checkpoint (params and momentum) saved after step 1 under the cell's layout, resumed under another, "
              "equal to the uninterrupted run after step 2",
}

# model -> why a family is not a column of its row (not an error: the layout has nothing to split there)
NOT_APPLICABLE: dict[tuple[str, str], str] = {
    **{(m, "ep"): "no expert weights: ep would split only the batch (dp)" for m in MODELS if m != "moe_top2"},
}


@dataclasses.dataclass(frozen=True)
class Declared:
    """A combination a model cannot run: the exception it raises, a fragment of its message, and why."""

    error: type[BaseException]
    match: str
    why: str


_BYTES = ("experiments.train feeds packed byte text (tokens and next-token labels of vocab 256, data.py); "
          "a model of other inputs trains through the API (shardings.train_step), as its other columns do")

_INDUCTOR_VIEW = ("under jit=True with inductor (the default backend), zero3 composed with tp fails to compile gpt2's "
                  "written-out attention: AOTAutograd, with inductor's decompositions, runs torch._decomp's matmul "
                  "on `q @ keys.transpose(-2, -1)`, whose reshape of the keys DTensor runs as a view of each local "
                  "block, and a block of shape (4, 2, 8, 8), strides (128, 8, 1, 16) (laid out (b, s, h, d) by "
                  "torch.einsum's 'bse,ehd->bhsd') cannot be viewed as (8, 8, 8): the global layout DTensor "
                  "records for it presumably differs from the local one. aot_eager (no decompositions) compiles both "
                  "cells and equals one device, measured; eager runs them: open")

# (model, family, feature) -> the error; family "*" for every family of the model's row. On real processes a rank's
# error comes as the LaunchError that names it.
DECLARED: dict[tuple[str, str, str], Declared] = {
    ("encoder", "*", "train"): Declared(IndexError, "index out of range", "a [CLS] classifier with its own vocab "
                                        "of 64 gets byte ids up to 255: " + _BYTES),
    ("vit", "*", "train"): Declared(AttributeError, "has no attribute 'seq_len'", "an image model has no "
                                    "sequence length for the text pipeline: " + _BYTES),
    **{("gpt2", f, "jit"): Declared(LaunchError, "Cannot view a tensor with shape", _INDUCTOR_VIEW)
       for f in ("zero3+tp+sp", "zero3+tp+pp")},
}


def module(name: str) -> Any:
    return importlib.import_module(f"tests.zoo.{name}")


def families(model: str) -> list[str]:
    return [f for f in LAYOUTS if (model, f) not in NOT_APPLICABLE]


def declared(model: str, family: str, feature: str) -> Declared | None:
    return DECLARED.get((model, family, feature)) or DECLARED.get((model, "*", feature))


def cells() -> list[tuple[str, str, str]]:
    """Every ``(model, family, feature)`` of the matrix."""
    return [(m, f, x) for m in MODELS for f in families(m) for x in FEATURES]


def sample(seed: int = 0) -> list[tuple[str, str, str]]:
    """A deterministic subset of :func:`cells` covering every model, family and feature at least once: a greedy set
    cover, each time the cell that covers the most not yet covered per unit of cost (ties: a seeded order)."""
    order = [c for c in cells() if not declared(*c)]
    random.Random(seed).shuffle(order)
    kept, seen = [], set()
    items = lambda c: {("model", c[0]), ("family", c[1]), ("feature", c[2])}
    while True:
        best = max(order, key=lambda c: len(items(c) - seen) / _cost(c))  # max keeps the first of equals
        if not items(best) - seen:
            return kept
        kept.append(best)
        seen |= items(best)


def selected() -> list[tuple[str, str, str]]:
    """The cells this run checks: all of them under ``SHARDLAB_ZOO=full`` or the explore profile, else
    :func:`sample`."""
    full = os.environ.get("SHARDLAB_ZOO") == "full" or os.environ.get("HYPOTHESIS_PROFILE") == "explore"
    return cells() if full else sample()


# a feature's rough cost (seconds of a cell here), and an 8-rank mesh's factor
_COST = {"simulated": 1, "bf16": 2, "resume": 2, "real": 3, "train": 3, "jit": 6}


def _cost(cell: tuple[str, str, str]) -> int:
    ranks = 1
    for n in LAYOUTS[cell[1]][1].values():
        ranks *= n
    compiles_more = cell[2] == "jit" and cell[1] not in ("dp", "zero3")  # DTensor graphs: minutes to compile here
    return _COST[cell[2]] * (4 if ranks > 4 else 1) * (2 if LAYOUTS[cell[1]][2] else 1) * (3 if compiles_more else 1)


def config(model: str, family: str) -> Any:
    """The cell's model config: the module's defaults, 4 blocks under ZB-V (2 stages on each of 2 ranks)."""
    cfg = module(model).Config()
    return dataclasses.replace(cfg, layers=4) if LAYOUTS[family][2] == "zb_v" else cfg


def zoo_table() -> str:
    """docs/models.md's zoo table: models × layout families, with what each cell runs or the error it declares."""
    lines = ["| model | " + " | ".join(f"`{f}`" for f in LAYOUTS) + " |", "|---|" + "---|" * len(LAYOUTS)]
    for m in MODELS:
        row = []
        for f in LAYOUTS:
            if (m, f) in NOT_APPLICABLE:
                row.append("—")
                continue
            errs = [x for x in FEATURES if declared(m, f, x)]
            row.append("✓" + "".join(f" ({x}: `{_shown(declared(m, f, x))}`)" for x in errs))
        lines.append(f"| `{m}` | " + " | ".join(row) + " |")
    return "\n".join(lines)


def _shown(d: Declared) -> str:
    """A declared error as the table shows it: its type, or for a rank's error its own name."""
    return d.match if d.error is LaunchError else d.error.__name__
