"""A mesh axis the layout leaves idle is said once (#29 item 5): ``zero3`` on ``Mesh(dp=2, tp=2)`` runs with every tp
pair holding and computing the same (twice ``dp4``'s memory); ``train_step`` warns, naming the axis and the fix."""

import warnings

import pytest

import core
import models
import shardings
from shardings import Mesh
from shardings.spec import layouts


@pytest.mark.parametrize(("layout", "mesh", "idle"), [
    ("zero3", Mesh(dp=2, tp=2), ("tp",)),
    ("dp", Mesh(dp=2, cp=2), ("cp",)),
    ("tp", Mesh(dp=2, tp=2), ("dp",)),
    ("zero3+tp", Mesh(dp=2, tp=2), ()),
    ("hsdp", Mesh(dp=2, fsdp=2), ()),
    ("dp", Mesh(dp=2, fsdp=2), ()),  # dp's batch rule spans fsdp too
    ("dp+pp", Mesh(dp=2, pp=2), ()),
    ("zero3+ep", Mesh(dp=2, ep=2), ()),
    ("zero3", Mesh(dp=4, tp=1), ()),  # an axis of size 1 is no axis
])
def test_idle_axes(layout, mesh, idle):
    assert layouts.idle_axes(layouts.get(layout), mesh) == idle


def _step(layout, mesh):
    return shardings.train_step(models.mlp.loss, core.optim.sgd(0.1), layout=layout, mesh=mesh,
                                axes=models.mlp.axes(models.mlp.Config()))


def test_train_step_warns_once_naming_the_axis_and_the_fix():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # Python's own: once per place and message
        for _ in range(2):
            _step("zero3", Mesh(dp=2, tp=2))
        _step("zero3+tp", Mesh(dp=2, tp=2))
    said = [str(w.message) for w in caught if issubclass(w.category, layouts.IdleAxisWarning)]
    assert said == ["layout 'zero3' leaves mesh axis 'tp' (size 2) of Mesh(dp=2, tp=2) idle: its ranks hold and "
                    "compute the same, so each holds as much as on a mesh without it. Fix: add a preset that uses it "
                    "(zero3+tp), or give its ranks to 'dp' (Mesh(dp=4, ...))."]
