"""Imports go one way: ``core`` knows nothing of ranks or of the packages built on it; inside ``shardings`` the
subpackages import down their order; code outside ``shardings`` uses its public facade; private torch names come
through ``shardings/runtime/compat.py``; ``tests/shardings`` mirrors the subpackages.

Checked on the source (every ``import``/``from ... import``, function-level ones included), so a lazy import
cannot slip past.
"""

import ast
import sys
from pathlib import Path

import shardings
from tests.source_imports import imports

ROOT = Path(__file__).resolve().parents[1]


def offending(package: str, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    bad = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        hits = sorted(m for m in imports(path, ROOT) if any(m == f or m.startswith(f + ".") for f in forbidden))
        if hits:
            bad[str(path.relative_to(ROOT))] = hits
    return bad


def test_core_is_distribution_free():
    assert offending("core", ("torch.distributed", "shardings", "models", "experiments")) == {}


def test_models_do_not_import_experiments():
    assert offending("models", ("experiments",)) == {}


def test_the_checker_sees_imports(tmp_path, monkeypatch):
    bad = tmp_path / "core" / "sneaky.py"
    bad.parent.mkdir()
    bad.write_text("def f():\n    from torch.distributed import tensor\n    from . import x\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert offending("core", ("torch.distributed", "core.x")) == {"core/sneaky.py": ["core.x", "torch.distributed",
                                                                                    "torch.distributed.tensor"]}


# shardings/: subpackages by concern, imports one way (shardings/__init__.py's docstring)
LAYERS = ["spec", "runtime", "comm", "residency", "ops", "pipeline", "step", "checkpoint", "testing", "planner"]
# The one module every layer may import, whatever its place: the private torch names (it imports only spec.errors).
TORCH_ADAPTER = "shardings.runtime.compat"


def layer_violations(root: Path = ROOT) -> dict[str, list[str]]:
    """Per file under ``shardings/<layer>/``, the shardings imports that go up the order or through the facade
    (``from shardings import X``: only ``testing``, the top, may use the public surface); the torch adapter
    (``runtime/compat.py``) is below every layer, and imports nothing of shardings but ``spec.errors``."""
    bad = {}
    for i, layer in enumerate(LAYERS):
        for path in sorted((root / "shardings" / layer).rglob("*.py")):
            hits = []
            for m in imports(path, root):
                parts = m.split(".")
                if parts[0] != "shardings" or m == TORCH_ADAPTER or m.startswith(TORCH_ADAPTER + "."):
                    continue
                target = parts[1] if len(parts) > 1 else None
                if path == root / "shardings" / "runtime" / "compat.py":
                    if not m.startswith("shardings.spec.errors"):
                        hits.append(m)
                elif target in LAYERS:
                    if LAYERS.index(target) > i:
                        hits.append(m)
                elif layer != "testing":
                    hits.append(m)
            if hits:
                bad[str(path.relative_to(root))] = sorted(hits)
    return bad


def test_shardings_subpackages_import_one_way():
    assert layer_violations() == {}


def test_shardings_has_no_loose_modules():
    loose = sorted(p.name for p in (ROOT / "shardings").glob("*.py") if p.name != "__init__.py")
    packages = sorted(p.name for p in (ROOT / "shardings").iterdir() if (p / "__init__.py").exists())
    assert loose == [] and packages == sorted(LAYERS)


def test_the_layer_check_sees_an_upward_import(tmp_path):
    for layer in LAYERS:
        (tmp_path / "shardings" / layer).mkdir(parents=True)
    (tmp_path / "shardings" / "spec" / "bad.py").write_text(
        "from shardings.step import train_step\nfrom shardings import Mesh\nfrom shardings.spec import mesh\n"
        "from shardings.runtime.compat import rank_map\n")
    (tmp_path / "shardings" / "step" / "ok.py").write_text("from shardings.spec.mesh import Mesh\n")
    (tmp_path / "shardings" / "runtime" / "compat.py").write_text(
        "from shardings.spec.errors import sharding_error\nfrom shardings.spec.mesh import Mesh\n")
    assert layer_violations(tmp_path) == {
        "shardings/spec/bad.py": ["shardings", "shardings.Mesh", "shardings.step", "shardings.step.train_step"],
        "shardings/runtime/compat.py": ["shardings.spec.mesh", "shardings.spec.mesh.Mesh"]}


# Code outside shardings/ uses its public surface only (DESIGN §1): a name in ``shardings.__all__``, or in the
# ``__all__`` of a public subpackage it lists (``shardings.pipeline``, ``testing``, ``checkpoint``); never a module
# inside it, never a private name.
FACADE_USERS = ("models", "experiments")


def _public(name: str) -> bool:
    """Whether the dotted ``shardings...`` name an import line reaches is part of the public surface."""
    import shardings

    parts = name.split(".")[1:]
    if len(parts) <= 1:
        return not parts or parts[0] in shardings.__all__
    package = getattr(shardings, parts[0], None) if parts[0] in shardings.__all__ else None
    return len(parts) == 2 and hasattr(package, "__path__") and parts[1] in getattr(package, "__all__", ())


def facade_violations(folders: tuple[str, ...], root: Path = ROOT) -> dict[str, list[str]]:
    """Per file under ``folders``, the ``shardings`` names it imports that are not public."""
    bad = {}
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            hits = sorted(m for m in imports(path, root) if m.split(".")[0] == "shardings" and not _public(m))
            if hits:
                bad[str(path.relative_to(root))] = hits
    return bad


def test_code_outside_shardings_imports_only_its_facade():
    assert facade_violations(FACADE_USERS) == {}


def test_the_facade_check_sees_internal_and_private_imports(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "sneaky.py").write_text(
        "import shardings\nfrom shardings import Mesh, pipeline\nfrom shardings.pipeline import Stages\n"
        "from shardings.testing import assert_close\nfrom shardings.pipeline.execute import _Saved\n"
        "def f():\n    from shardings.spec.errors import sharding_error\n    from shardings import _private\n")
    assert facade_violations(("models",), tmp_path) == {"models/sneaky.py": [
        "shardings._private", "shardings.pipeline.execute", "shardings.pipeline.execute._Saved",
        "shardings.spec.errors", "shardings.spec.errors.sharding_error"]}


def test_the_facade_re_exports_what_its_callers_need():
    for name in ("layouts", "pipeline", "testing", "checkpoint", "Layout", "param_specs", "from_callback",
                 "default_token_count", "rank_map", "maybe_disable_local_tensor_mode", "simulated"):
        assert name in shardings.__all__ and hasattr(shardings, name), name


# Private torch names (a module or a name starting with "_" under torch), imported or reached by attribute, are used
# in the compat modules only (shardings/runtime/compat.py and, below shardings, core/compat.py).
COMPAT = ("shardings/runtime/compat.py", "core/compat.py")
PRIVATE_TORCH_EXEMPT = {
    # core may not import shardings (the layer test above): its pytree layer wraps torch.utils._pytree itself
    "core/tree.py": "core is below shardings",
    # benchmarks of torch.compile read the compiler's own graph-break and recompile counters and switch its tracing
    # of autograd ops, which no public torch API exposes; they measure torch, not shardlab, so they do not go
    # through shardlab's compat layer
    "experiments/bench/rows.py": "torch._dynamo.utils.counters",
    "experiments/bench/jit.py": "torch._dynamo.config.patch(trace_autograd_ops=True)",
}


# Reached by attribute and not counted: operator namespaces (torch.ops.<ns>.<op>: the dispatcher's registry, named
# by torch's own op schemas) and the documented way to build a tensor subclass that wraps others.
PUBLIC_ENOUGH = ("torch.ops.", "torch.Tensor._make_wrapper_subclass")


def _private(dotted: str) -> bool:
    parts = dotted.split(".")
    return parts[0] == "torch" and any(p.startswith("_") and not p.startswith("__") for p in parts[1:])


def _dotted(node: ast.AST) -> str | None:
    """``torch.a.b`` for an attribute chain rooted at a plain name, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base is not None else None
    return None


def private_attributes(path: Path) -> set[str]:
    """The private torch names ``path`` reaches without importing them: ``torch._x`` (the first private step of an
    attribute chain), ``getattr(torch..., "_x...")`` and private packages spelled as strings (``"torch._x.y"``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        dotted = _dotted(node) if isinstance(node, ast.Attribute) else None
        if (dotted and _private(dotted) and not _private(dotted.rpartition(".")[0])
                and not dotted.startswith(PUBLIC_ENOUGH)):
            found.add(dotted)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                and len(node.args) >= 2 and (_dotted(node.args[0]) or "").split(".")[0] == "torch"):
            name = node.args[1]
            text = name.value if isinstance(name, ast.Constant) else ast.unparse(name).lstrip("f'\"")
            if isinstance(text, str) and text.startswith("_") and not text.startswith("__"):
                found.add(f"getattr({_dotted(node.args[0])}, {ast.unparse(name)})")
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("torch._"):
            found.add(repr(node.value))
    return found


def private_torch_imports(root: Path = ROOT, packages: tuple[str, ...] = ("shardings", "experiments", "models",
                                                                         "core")) -> dict[str, list[str]]:
    """Per file, the private torch modules or names it imports (``torch.x._y``, ``from torch.x import _y``) or
    reaches by attribute (:func:`private_attributes`)."""
    bad = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel in COMPAT or rel in PRIVATE_TORCH_EXEMPT:
                continue
            hits = sorted({m for m in imports(path, root) if _private(m)} | private_attributes(path))
            if hits:
                bad[rel] = hits
    return bad


def test_private_torch_names_come_through_compat_only():
    assert private_torch_imports() == {}


def test_the_private_name_check_sees_modules_and_names(tmp_path):
    (tmp_path / "shardings").mkdir()
    (tmp_path / "shardings" / "x.py").write_text(
        "import torch.distributed._functional_collectives as funcol\nfrom torch.utils import _pytree\n"
        "from torch.distributed.tensor.placement_types import _StridedShard\nfrom torch.distributed import tensor\n")
    assert private_torch_imports(tmp_path, ("shardings",)) == {"shardings/x.py": [
        "torch.distributed._functional_collectives", "torch.distributed.tensor.placement_types._StridedShard",
        "torch.utils._pytree"]}


def test_the_private_name_check_sees_attributes_getattr_and_module_strings(tmp_path):
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "x.py").write_text(
        "import torch\nwith torch._functorch.config.patch(a=1):\n    torch._C._current_graph_task_id()\n"
        "f = getattr(torch, f'_foreach_{name}')\nM = 'torch._functorch._aot_autograd.runtime_wrappers'\n"
        "v = torch.__version__\nok = torch.compiler.reset\n")
    assert private_torch_imports(tmp_path, ("core",)) == {"core/x.py": [
        "'torch._functorch._aot_autograd.runtime_wrappers'", "getattr(torch, f'_foreach_{name}')", "torch._C",
        "torch._functorch"]}


def test_tests_mirror_the_shardings_subpackages():
    """``tests/shardings/<subpackage>/`` for each subpackage, and no loose test files beside them."""
    tests = ROOT / "tests" / "shardings"
    folders = sorted(p.name for p in tests.iterdir() if p.is_dir() and p.name != "__pycache__")
    loose = sorted(p.name for p in tests.glob("*.py") if p.name != "__init__.py")
    assert folders == sorted(LAYERS) and loose == []


def test_files_import_cases_not_other_test_files():
    """Shared cases live in a module of cases (``tests/shardings/step/layout_cases.py``, ...), not in a test file."""
    bad = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        hits = sorted(m for m in imports(path, ROOT) if m.startswith("tests.") and any(
            part.startswith("test_") for part in m.split(".")[1:]))
        if hits:
            bad[path.relative_to(ROOT).as_posix()] = hits
    assert bad == {}


def import_cycles(package: str, root: Path = ROOT) -> list[list[str]]:
    """The import circles among ``package``'s modules (lazy and type-only imports count): each strongly connected
    component of more than one module, its members sorted. An import of a package counts as one of its
    ``__init__``; ``from a import b`` as one of ``a.b`` when that is a module."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {m: sorted({i for i in imports(path, root) if i in modules and i != m}) for m, path in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(m: str) -> None:  # Tarjan's strongly connected components
        index[m] = low[m] = len(index)
        stack.append(m)
        for n in graph[m]:
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            component = []
            while not component or component[-1] != m:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for m in graph:
        if m not in index:
            visit(m)
    return sorted(cycles)




def test_experiments_import_one_way():
    """No circle among the experiments' modules: ``build`` and ``plan`` import ``auto`` (layout=auto and the
    clusters) and not each other's way back; ``calibrate`` and ``bench.plan`` import neither ``plan`` nor ``build``."""
    assert import_cycles("experiments") == []


def test_the_cycle_check_sees_a_lazy_circle(tmp_path):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "sub" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from pkg.sub import c\n")
    (tmp_path / "pkg" / "sub" / "c.py").write_text("def f():\n    from pkg import a\n")
    (tmp_path / "pkg" / "b.py").write_text("import pkg.a\n")
    assert import_cycles("pkg", tmp_path) == [["pkg.a", "pkg.sub.c"]]
