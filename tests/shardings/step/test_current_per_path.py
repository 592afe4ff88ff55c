"""docs/layouts.md's table of ``shardings.current()`` per path holds: each row's layout, run for a step, sees that
mesh (or none) inside its loss (#29 item 5)."""

import dataclasses
import re
from pathlib import Path

import pytest

import core
import models
import shardings
from shardings import Mesh

DOC = Path(__file__).resolve().parents[3] / "docs" / "layouts.md"
_ROW = re.compile(r"^\| `([\w+]+)` on `(Mesh\([^)]*\))`(, `local=False`)? \| ([\w ]+) \| `([^`]+)` \|$", re.M)
CFG = models.mlp.Config(vocab=32, dim=16, mlp=32, layers=2, seq_len=8)
BATCH = models.mlp.example_batch(CFG, 4)


def _rows():
    text = DOC.read_text()
    table = text[text.index("<!-- current-per-path:begin -->"):text.index("<!-- current-per-path:end -->")]
    return [(layout, eval(mesh, {"Mesh": Mesh}), not no_local, path, want)
            for layout, mesh, no_local, path, want in _ROW.findall(table)]


def test_the_table_has_every_path():
    assert {path for *_, path, _ in _rows()} == {"local", "DTensor", "pipeline stage"} and len(_rows()) == 7


@pytest.mark.parametrize(("layout", "mesh", "local", "path", "want"), _rows(), ids=lambda v: str(v))
def test_current_inside_the_loss_is_what_the_docs_say(layout, mesh, local, path, want):
    seen = []

    def record():
        ctx = shardings.current()
        seen.append("None" if ctx is None else repr(ctx.mesh))

    stages = models.mlp.stages(CFG)
    first = stages.first
    stages = dataclasses.replace(stages, first=lambda params, batch: (record(), first(params, batch))[1])
    loss = stages if "pp" in layout else lambda params, batch: (record(), stages.loss(params, batch))[1]
    with shardings.simulate(mesh.size):
        params = shardings.init(models.mlp.init, core.random.key(0), CFG, axes=models.mlp.axes(CFG), layout=layout,
                                mesh=mesh)
        plan = shardings.pipeline.plan(layout, mesh, params) if "pp" in layout else None
        step = shardings.train_step(loss, core.optim.sgd(0.1), layout=layout, mesh=mesh,
                                    axes=models.mlp.axes(CFG), local=local, plan=plan)
        step(params, step.init(params), BATCH)
    assert seen and set(seen) == {want}, (path, seen)
