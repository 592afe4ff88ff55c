"""The docs' rank_skew example shows what it promises: a difference, under the layout the command names."""

import re
import shlex
from pathlib import Path

from experiments.equivalence import main as equivalence

ROOT = Path(__file__).resolve().parents[2]
_COMMAND = re.compile(r"^python -m experiments\.equivalence (.*model\.name=tests\.experiments\.rank_skew.*)$", re.M)


def test_every_rank_skew_command_in_the_docs_fails_naming_unembed(capsys):
    commands = [(path.name, m.group(1)) for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
                for m in _COMMAND.finditer(path.read_text())]
    assert commands, "README.md or docs/ should show the rank_skew example as a command to run"
    for where, args in commands:
        assert equivalence(shlex.split(args)) == 1, f"{where}: `{args}` found no difference"
        assert "FAIL: first at step 1, grads ['unembed']" in capsys.readouterr().out, where
