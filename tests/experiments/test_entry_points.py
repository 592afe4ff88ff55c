"""Every ``python -m experiments.<module>`` entry point answers ``--help`` (exit 0, its usage on stdout), Hydra apps
included (``experiments.plan`` and ``experiments.equivalence`` compose with Hydra's API, which does not take
``--help`` itself: it used to end in ``LexerNoViableAltException``). All in one child process: one import of torch."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_RUN_ALL = '''
import contextlib, io, json, runpy, sys, warnings
warnings.simplefilter("ignore")
out = {}
for name in sys.argv[1:]:
    sys.argv = [name, "--help"]
    buf, code = io.StringIO(), 0
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
            runpy.run_module(name, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code or 0
    except Exception as e:
        code = f"{type(e).__name__}: {e}"
    out[name] = [code, buf.getvalue()[:400]]
print("RESULTS" + json.dumps(out))
'''


def entry_points() -> list[str]:
    """``experiments`` modules run as ``__main__``: an ``if __name__ == "__main__"`` or a package's ``__main__.py``."""
    names = []
    for path in sorted((ROOT / "experiments").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        if path.name == "__main__.py":
            names.append(module.removesuffix(".__main__"))
        elif 'if __name__ == "__main__"' in path.read_text():
            names.append(module)
    return names


def test_every_entry_point_answers_help():
    names = entry_points()
    assert {"experiments.train", "experiments.plan", "experiments.equivalence", "experiments.bench"} <= set(names)
    proc = subprocess.run([sys.executable, "-c", _RUN_ALL, *names], capture_output=True, text=True, timeout=600,
                          cwd=ROOT)
    results = json.loads(proc.stdout.split("RESULTS", 1)[1])
    bad = {name: code for name, (code, _) in results.items() if code != 0}
    assert bad == {}, proc.stderr[-2000:]
    empty = [name for name, (_, text) in results.items() if len(text.strip()) < 40]
    assert empty == []
    for app in ("experiments.plan", "experiments.equivalence"):
        assert results[app][1].startswith(f"``python -m {app}"), results[app][1]
