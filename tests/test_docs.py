"""The docs cannot rot: every Python block in README.md and docs/*.md runs, and the names they use exist.

The blocks of one file run in order in one namespace (a later block may use an earlier one's
names), each file in a fresh one.
"""

import re
from pathlib import Path

import pytest

from shardings.spec.layouts import LOGICAL_NAMES
from shardings.step.layout_view import rules_table

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_TABLE = re.compile(r"<!-- rules-table:begin -->\n(.*?)\n<!-- rules-table:end -->", re.S)


def _blocks(path: Path) -> list[tuple[int, str]]:
    text = path.read_text()
    return [(text[: m.start()].count("\n") + 2, m.group(1)) for m in _BLOCK.finditer(text)]


@pytest.mark.parametrize("path", [p for p in DOCS if _blocks(p)], ids=lambda p: p.name)
def test_every_python_block_runs(path):
    namespace: dict = {"__name__": f"docs_{path.stem}"}
    for line, code in _blocks(path):
        try:
            exec(compile(code, f"{path.relative_to(ROOT)}:{line}", "exec"), namespace)
        except Exception as e:  # name the block, keep the traceback
            raise AssertionError(f"{path.relative_to(ROOT)}, the python block at line {line} failed: {e!r}") from e


def test_the_rules_table_is_generated_from_the_rules():
    text = (ROOT / "docs" / "models.md").read_text()
    found = _TABLE.search(text)
    assert found, "docs/models.md lost its <!-- rules-table --> markers"
    assert found.group(1) == rules_table(), (
        "docs/models.md's logical-name table is out of date. Fix: replace it with the output of "
        "`python -c 'from shardings.step.layout_view import rules_table; print(rules_table())'`"
    )


_EXAMPLE = re.compile(r"^<!-- encoder: (\S+) -->\n```python\n(.*?)^```", re.S | re.M)


def test_the_models_worked_example_is_the_module_the_tests_import():
    """docs/models.md shows the encoder the checker's tests use: one source, two places, kept identical."""
    text = (ROOT / "docs" / "models.md").read_text()
    found = _EXAMPLE.search(text)
    assert found, "docs/models.md lost its <!-- encoder: tests/zoo/encoder.py --> block"
    source = (ROOT / found.group(1)).read_text()
    code = source[source.index('"""', 3) + 3:].lstrip("\n")  # below the module docstring
    assert found.group(2) == code, (
        f"docs/models.md's encoder block differs from {found.group(1)}. Fix: copy the module's code below its "
        "docstring into the block (or the block into the module)."
    )


def test_every_logical_name_the_docs_map_exists():
    """``name→axis`` in prose and tables: the left side must be a logical name the layouts know."""
    known = set(LOGICAL_NAMES) | {"kv_seq"}
    unknown = []
    for path in DOCS:
        text = _TABLE.sub("", path.read_text())
        for m in re.finditer(r"([A-Za-z_/]+)→", text):
            for name in m.group(1).split("/"):
                if name not in known:
                    line = text[: m.start()].count("\n") + 1
                    unknown.append(f"{path.relative_to(ROOT)}:{line}: {name!r}")
    assert not unknown, f"logical names no rule knows (known: {sorted(known)}):\n" + "\n".join(unknown)


_PATH = re.compile(r"\b((?:core|shardings|models|experiments|tests)/[\w/]*\w\.py)\b")
_SUBPATH = re.compile(r"(?<![\w/])((?:spec|runtime|comm|residency|ops|step|checkpoint|testing)/\w+\.py)\b")
_MODULE = re.compile(r"\bshardings\.((?:spec|runtime|comm|residency|ops|step|checkpoint|testing)(?:\.\w+)*)")
_LINK = re.compile(r"\]\(((?!https?:)[^)#\s]+)")


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_file_module_and_link_the_docs_name_exists(path):
    """A file moved or renamed (shardings/ was reorganized by concern) cannot leave the docs pointing at nothing."""
    import importlib

    text = path.read_text()
    missing = [p for p in _PATH.findall(text) if not (ROOT / p).exists()]
    missing += [p for p in _SUBPATH.findall(text) if not (ROOT / "shardings" / p).exists()]  # internals.md's
    missing += [link for link in _LINK.findall(text) if not (path.parent / link).exists()]
    for dotted in set(_MODULE.findall(text)):
        parts = f"shardings.{dotted}".split(".")
        for end in range(len(parts), 1, -1):  # the longest importable prefix, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:end]))
            except ModuleNotFoundError:
                continue
            for attr in parts[end:]:
                obj = getattr(obj, attr, None)
            if obj is None:
                missing.append(f"shardings.{dotted}")
            break
        else:
            missing.append(f"shardings.{dotted}")
    assert missing == [], f"{path.name} names what does not exist: {missing}"


_SCHEDULE_LIST = re.compile(r'schedule="(\w+)"((?:`?/`?"\w+")*)')
_SCHEDULE_ROW = re.compile(r"^\| `(\w+)`", re.M)


def test_every_list_of_schedules_is_the_registry():
    """Every ``schedule="a"``/``"b"``/... list in README.md and docs/*.md, and docs/pipeline.md's table of schedules,
    names exactly the schedules shardlab registers (``shardings.pipeline.SCHEDULES``, in its order; docs/pipeline.md's
    own example registers one more when its blocks have run, which no list names)."""
    from shardings.pipeline import SCHEDULES

    builtin = [name for name, build in SCHEDULES.items() if build.__module__.startswith("shardings.")]

    lists = {}
    for path in DOCS:
        for m in _SCHEDULE_LIST.finditer(path.read_text()):
            names = [m.group(1), *re.findall(r'"(\w+)"', m.group(2))]
            if len(names) > 1:  # one name is an example, not a list
                lists[f"{path.name}: {'/'.join(names)}"] = names
    text = (ROOT / "docs" / "pipeline.md").read_text()
    table = text[text.index("| `build(name, p, m)`"):]
    table = table[:table.index("\n\n")]
    lists["pipeline.md's table"] = _SCHEDULE_ROW.findall(table)
    assert len(lists) >= 3, f"the schedule lists moved: found {sorted(lists)}"
    stale = {where: names for where, names in lists.items() if names != builtin}
    assert not stale, f"lists of schedules that are not the registry's {builtin}: {stale}"
