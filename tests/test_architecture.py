"""Imports go one way: ``core`` knows nothing of ranks or of the packages built on it.

Checked on the source (every ``import``/``from ... import``, function-level ones included), so a lazy import
cannot slip past.
"""

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def imports(path: Path) -> set[str]:
    """Every module name ``path`` imports (absolute; relative imports resolved against its package)."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join([*parts[: len(parts) - node.level + 1], *([base] if base else [])])
            found |= {base} | {f"{base}.{a.name}" for a in node.names}
    return found


def offending(package: str, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    bad = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        hits = sorted(m for m in imports(path) if any(m == f or m.startswith(f + ".") for f in forbidden))
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
