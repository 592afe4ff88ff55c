"""tests/mutants.py stays in sync with the code: each snippet occurs exactly once, each listed test exists.

The drill itself (``python -m tests.mutants``) runs the tests once per mutant, far too slow for the suite;
this keeps a refactor from silently turning a mutant stale.
"""

import re

import pytest

from tests.mutant_catalog import EQUIVALENT, MUTANTS
from tests.mutants import ROOT, check_snippet, node_file


def test_ids_are_unique_and_equivalents_are_mutants_with_a_reason():
    ids = [m.id for m in MUTANTS]
    assert len(ids) == len(set(ids))
    assert set(EQUIVALENT) <= set(ids)
    assert all(reason.strip() for reason in EQUIVALENT.values())


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.id)
def test_snippet_occurs_once_and_the_mutated_file_still_parses(mutant):
    assert check_snippet(mutant) is None, check_snippet(mutant)
    assert mutant.find != mutant.replace and mutant.what and mutant.tests
    source = (ROOT / mutant.file).read_text()
    compile(source.replace(mutant.find, mutant.replace), mutant.file, "exec")  # a bug, not a syntax error


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.id)
def test_every_listed_test_exists(mutant):
    for node in mutant.tests:
        path = ROOT / node_file(node)
        assert path.is_file() and path.name.startswith("test_"), node
        if "::" in node:
            name = node.split("::", 1)[1].split("[", 1)[0]
            assert re.search(rf"^def {re.escape(name)}\(", path.read_text(), re.M), f"no test {name} in {path}"
