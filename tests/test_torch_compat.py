"""shardings.runtime.compat: torch's private names in one place, and shardlab without simulated ranks on a torch
that lacks them (torch 2.11: no ``rank_map``). The older torch is played by deleting names from this one."""

import importlib
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import core
import models
import shardings
from shardings import Mesh
from shardings.runtime import compat
from tests.source_imports import imports

ROOT = Path(__file__).resolve().parents[1]
WANTED = [f"{module}.{name}" for module, names in compat._WANTED.items() for name in names]


def test_each_name_is_torchs_own_where_torch_has_it():
    for path in WANTED:
        module, name = path.rsplit(".", 1)
        if hasattr(importlib.import_module(module), name):
            assert getattr(compat, name) is getattr(importlib.import_module(module), name), path
        else:
            assert path in compat.MISSING
    assert compat.HAS_SIMULATION is not bool(compat.MISSING)


def test_lookup_names_each_missing_name_and_module():
    found, missing = compat._lookup(
        {"torch.distributed._local_tensor": ("LocalTensor", "no_such_name"), "torch.no_such_module": ("X",)}
    )
    assert found == {"LocalTensor": torch.distributed._local_tensor.LocalTensor}
    assert missing == ["torch.distributed._local_tensor.no_such_name", "torch.no_such_module.X"]


def test_the_error_names_what_needs_it_both_versions_and_the_fix():
    e = compat.unavailable("shardings.simulate", ["torch.distributed._local_tensor.rank_map"], "2.11.0")
    assert isinstance(e, RuntimeError)
    assert str(e).startswith(
        "shardings.simulate needs torch >= 2.13 (torch.distributed._local_tensor.rank_map); installed: 2.11.0. Fix: "
    )
    assert "shardings.launch" in str(e)


def test_simulate_refuses_before_starting_anything_where_torch_cannot_simulate(monkeypatch):
    monkeypatch.setattr(compat, "HAS_SIMULATION", False)
    monkeypatch.setattr(compat, "MISSING", ["torch.distributed._local_tensor.rank_map"])
    error = re.escape(f"needs torch >= 2.13 ({compat.MISSING[0]}); installed: {torch.__version__}.")
    with pytest.raises(compat.SimulationUnavailable, match=error), shardings.simulate(2):
        pytest.fail("the body ran")
    assert not dist.is_initialized()


def test_c10d_functional_op_is_none_for_an_op_torch_lacks():
    assert compat.c10d_functional_op("all_reduce") is torch.ops._c10d_functional.all_reduce
    assert compat.c10d_functional_op("no_such_op") is None


# Run in a fresh interpreter whose sitecustomize deletes names from torch (after torch's own modules took theirs).
_SITECUSTOMIZE = """
import importlib, os
import torch.distributed.tensor
for path in os.environ["SHARDLAB_DELETE"].split():
    module, name = path.rsplit(".", 1)
    if hasattr(importlib.import_module(module), name):  # torch 2.11 has no rank_map to delete
        delattr(importlib.import_module(module), name)
"""

_PROBE = """
import json
import torch, torch.distributed as dist
import experiments.train, models, shardings  # the imports that failed on torch 2.11
from shardings.runtime import compat
from tests.source_imports import imports
out = {"has_simulation": compat.HAS_SIMULATION, "missing": compat.MISSING,
       "is_local_tensor": isinstance(torch.ones(1), compat.LocalTensor),
       "mode": repr(compat.enabled_local_tensor_mode())}
try:
    with shardings.simulate(2):
        out["simulated"] = True
except compat.SimulationUnavailable as e:
    out["simulate"] = str(e)
try:
    compat.LocalTensor({0: torch.ones(1)})
except compat.SimulationUnavailable as e:
    out["LocalTensor"] = str(e)
with compat.maybe_disable_local_tensor_mode():
    out["decorated"] = compat.maybe_run_for_local_tensor(lambda r: r + 1)(1)
dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
out["rank_map"] = compat.rank_map(lambda r: torch.tensor(r + 7)).item()
dist.destroy_process_group()
"""


def _imported_from_torch(missing: list[str]) -> pytest.MarkDecorator:
    """xfail (strict) while a project module imports one of the ``missing`` names from torch itself: the fresh
    interpreter then fails on that import, as on a torch that lacks it. Gone once they import from compat."""
    found = {str(f.relative_to(ROOT)): sorted(imports(f) & set(missing))
             for package in ("core", "shardings", "models", "experiments") for f in (ROOT / package).rglob("*.py")}
    found = {f: names for f, names in sorted(found.items()) if names}
    return pytest.mark.xfail(bool(found), strict=True, reason=f"these import from torch what compat provides: {found}")


def _run_without(tmp_path: Path, missing: list[str], code: str) -> dict:
    """``code`` (which sets ``out``) run where torch lacks the ``missing`` names; ``out`` as JSON."""
    (tmp_path / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    env = {**os.environ, "SHARDLAB_DELETE": " ".join(missing),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    script = textwrap.dedent(code) + "\nimport json\nprint('OUT=' + json.dumps(out))\n"
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.split("OUT=")[-1])


RANK_MAP = ["torch.distributed._local_tensor.rank_map"]  # what torch 2.11 lacks


@pytest.mark.parametrize("missing", [pytest.param(RANK_MAP, marks=_imported_from_torch(RANK_MAP), id="torch-2.11"),
                                     pytest.param(WANTED, marks=_imported_from_torch(WANTED), id="none")])
def test_shardings_imports_and_runs_without_simulation_names(tmp_path, missing):
    out = _run_without(tmp_path, missing, _PROBE)
    assert out["has_simulation"] is False
    assert out["missing"] == missing
    assert "simulated" not in out
    assert out["simulate"].startswith(f"shardings.simulate needs torch >= 2.13 ({', '.join(missing)}); installed: ")
    assert torch.__version__ in out["simulate"]
    assert out["is_local_tensor"] is False
    assert out["mode"] == "None"
    assert out["decorated"] == 2
    assert out["rank_map"] == 7
    if "torch.distributed._local_tensor.LocalTensor" in missing:  # the stand-in refuses to be made
        assert out["LocalTensor"].startswith("torch.distributed._local_tensor.LocalTensor needs torch >= 2.13")


def _init_on_rank() -> dict:
    """Sharded init on real ranks (it takes each rank's block with rank_map) against the one-device init."""
    cfg = models.mlp.Config(vocab=13, dim=6, mlp=10, layers=1, seq_len=4)
    params = shardings.init(models.mlp.init, core.random.key(0), cfg, axes=models.mlp.axes(cfg), layout="zero3",
                            mesh=Mesh(dp=2))
    ref = models.mlp.init(core.random.key(0), cfg)
    gathered = shardings.gather(params)
    return {"fallback": compat.rank_map.__module__ == compat.__name__,
            "equal": all(torch.equal(a, b) for a, b in zip(core.tree.leaves(gathered), core.tree.leaves(ref)))}


@pytest.mark.multiprocess
@_imported_from_torch(RANK_MAP)
def test_sharded_init_on_real_ranks_without_rank_map(tmp_path):
    out = _run_without(tmp_path, RANK_MAP, """
        import shardings, tests.test_torch_compat as t
        out = shardings.launch(t._init_on_rank, 2, timeout=120)
    """)
    assert out == [{"fallback": True, "equal": True}] * 2


def test_the_suite_marks_a_test_that_simulates_through_helpers_and_fixtures(tmp_path):
    from tests.conftest import _simulating

    module = tmp_path / "test_sample.py"
    module.write_text(textwrap.dedent("""
        import pytest, shardings

        def _inner():
            with shardings.simulate(2):
                pass

        def _outer():
            _inner()

        @pytest.fixture
        def world():
            _outer()

        def test_via_helpers():
            _outer()

        @pytest.mark.parametrize("runtime", ["simulate"])  # data, not a use
        def test_on_one_device(runtime):
            shardings.launch(print, 2)
    """))
    assert _simulating(module) == {"_inner", "_outer", "world", "test_via_helpers"}


def test_zero_bubble_w_on_a_torch_that_cannot_says_so(monkeypatch):
    """torch 2.11's autograd.grad refuses GradientEdges of custom Function nodes ("_input_metadata ... legacy
    access pattern"); W then fails with the version and the schedules that work there, not torch's message."""
    import torch

    from shardings.runtime import compat

    def refuses(*args, **kwargs):
        raise RuntimeError("Attribute '_input_metadata' is invalid for this instance of _C._FunctionBase.")

    monkeypatch.setattr(torch.autograd, "grad", refuses)
    with pytest.raises(RuntimeError, match=r"zero-bubble schedule's W .*needs torch >= 2.13.*Fix: use gpipe, 1f1b"):
        compat.grad_from_edges([], [], [])
