"""What a source file imports, read from its text (a helper of the architecture tests, not a test file)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def imports(path: Path, root: Path | None = None) -> set[str]:
    """Every module name ``path`` imports (absolute; relative imports resolved against its package)."""
    package = ".".join(path.relative_to(root or ROOT).with_suffix("").parts[:-1])
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
