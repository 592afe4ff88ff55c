"""The zoo: models written the way researchers write them, independent of ``models/``, run through every feature.

Each module (``tests.zoo.<name>``) has the model contract of docs/models.md: ``Config``, ``init``, ``axes``, ``loss``,
``stages`` and ``example_batch``. This file is the matrix as data: which layout families each model runs, which
features each cell is checked with, and the combinations a model cannot run, each with the error it gives (tested:
``tests/zoo/test_zoo_simulated.py``). docs/models.md shows it as a table (``zoo_table()``, kept in sync by a test).

The suite's form (``make test``) runs a deterministic sample of the cells that covers every model, every layout
family and every feature at least once (:func:`sample`); ``SHARDLAB_ZOO=full`` (``make test-zoo``) or
``HYPOTHESIS_PROFILE=explore`` runs every cell. The planner's column is per model (the planner picks the layout):
``PLANNER``, run by ``tests/zoo/test_zoo_planner.py``.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import random
from typing import Any

from experiments.build import ConfigError
from shardings import LaunchError
from shardings.testing import EquivalenceError

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
    "jit": "check_equivalence of train_step(jit=True) on real processes (inductor, the default backend), 1 AdamW step",
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
          "a model of other inputs trains through the API (shardings.train_step), as its other columns do. "
          "experiments.train refuses it before any process starts (experiments.data.mismatch)")
_DATA = "cannot train on experiments.train's data"

_BF16_EMBED = ("under bf16 on ZB-V's 8 ranks, the embedding's gradient ['tok'] lands at 1.01× the bf16 rule's "
               "allowance (relative norm 5.3e-2; every other leaf, the loss and the params within it), while the "
               "fp32 twin, which checks the layout at fp32 power, passes at 0.045×: bf16 rounding of a gradient "
               "summed over every token's row (the rule counts 1 term under bf16), not the layout; the RoPE's fp32 "
               "tables cast back to bf16 (as Llama's apply_rotary_emb does) add it. Open: a bf16 rule for "
               "scatter-added leaves")

# (model, family, feature) -> the error; family "*" for every family of the model's row. On real processes a rank's
# error comes as the LaunchError that names it.
DECLARED: dict[tuple[str, str, str], Declared] = {
    ("encoder", "*", "train"): Declared(ConfigError, _DATA, "a [CLS] classifier (labels one class per row) with "
                                        "its own vocab of 64 gets next-byte labels and byte ids up to 255: " + _BYTES),
    ("vit", "*", "train"): Declared(ConfigError, _DATA, "an image model (images, one class per image, no "
                                    "sequence length of its own) gets text: " + _BYTES),
    ("llama_gqa", "zero3+tp+pp", "bf16"): Declared(EquivalenceError, "grads differ from the single-device reference",
                                                   _BF16_EMBED),
}


# the planner column, per model (the planner picks the layout family): feature -> what a cell checks
PLANNER = {
    "plan": "python -m experiments.plan model.name=tests.zoo.<m> on 2 ranks of this machine's cluster: the ranked "
            "table, its winner run on fake tensors and within a rank's memory; then explain=true fits=true for the "
            "winner, from one more fake step, agreeing with the table",
    "auto": "experiments.train model.name=tests.zoo.<m> layout=auto on 2 simulated ranks: the planner's winner "
            "trains 1 step",
}
# (model, planner feature) -> the error: layout=auto trains through experiments.train, which refuses these models' data
PLANNER_DECLARED: dict[tuple[str, str], Declared] = {(m, "auto"): DECLARED[(m, "*", "train")]
                                                     for m in ("encoder", "vit")}


def planner_cells() -> list[tuple[str, str]]:
    """Every ``(model, planner feature)``."""
    return [(m, x) for m in MODELS for x in PLANNER]


def planner_selected() -> list[tuple[str, str]]:
    """The planner cells this run checks, declared ones left out (tested apart): all under ``SHARDLAB_ZOO=full`` or
    the explore profile; else the researcher's decoder (the issue's model) through both features, and the image
    model, whose rows' tokens the planner measures (its Config has no seq_len), planned."""
    chosen = planner_cells() if _full() else [("llama_gqa", "plan"), ("llama_gqa", "auto"), ("vit", "plan")]
    return [c for c in chosen if c not in PLANNER_DECLARED]


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
    return cells() if _full() else sample()


def _full() -> bool:
    return os.environ.get("SHARDLAB_ZOO") == "full" or os.environ.get("HYPOTHESIS_PROFILE") == "explore"


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
    """docs/models.md's zoo table: models × layout families, then the planner, with what each cell runs or the error
    it declares."""
    lines = ["| model | " + " | ".join(f"`{f}`" for f in LAYOUTS) + " | planner |",
             "|---|" + "---|" * (len(LAYOUTS) + 1)]
    for m in MODELS:
        row = []
        for f in LAYOUTS:
            if (m, f) in NOT_APPLICABLE:
                row.append("—")
                continue
            errs = [x for x in FEATURES if declared(m, f, x)]
            row.append("✓" + "".join(f" ({x}: `{_shown(declared(m, f, x))}`)" for x in errs))
        row.append("✓" + "".join(f" ({x}: `{_shown(PLANNER_DECLARED[m, x])}`)" for x in PLANNER
                                 if (m, x) in PLANNER_DECLARED))
        lines.append(f"| `{m}` | " + " | ".join(row) + " |")
    return "\n".join(lines)


def _shown(d: Declared) -> str:
    """A declared error as the table shows it: its type, or for a rank's error its own name."""
    return d.match if d.error is LaunchError else d.error.__name__
