"""The benchmarks' pre-#28 module names still work for one release, and warn with the new name."""

import importlib
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

import experiments
from experiments.bench import wrappers
from experiments.bench.old_names import MOVED

ROOT = Path(__file__).resolve().parents[3]
RUNNABLE = {old: new for old, new in MOVED.items() if hasattr(importlib.import_module(new), "main")}


def _warns(old: str, new: str) -> pytest.WarningsRecorder:
    return pytest.warns(DeprecationWarning, match=rf"^{re.escape(old)} is deprecated .*use {re.escape(new)} ")


@pytest.mark.parametrize(("old", "new"), MOVED.items())
def test_importing_an_old_name_warns_and_gives_the_new_module(old, new, monkeypatch):
    monkeypatch.delitem(sys.modules, old, raising=False)  # the warning comes with the first import in a process
    with _warns(old, new):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert getattr(experiments, old.rpartition(".")[2]) is module  # so `from experiments import native_gpt` too


@pytest.mark.parametrize(("old", "new"), RUNNABLE.items())
def test_python_m_an_old_name_runs_the_new_main_with_its_arguments(old, new, monkeypatch):
    calls = []
    monkeypatch.setattr(importlib.import_module(new), "main", lambda: calls.append(sys.argv[1:]))
    monkeypatch.setattr(sys, "argv", ["-m", "--quick"])
    monkeypatch.delitem(sys.modules, old, raising=False)  # imported, runpy would find the new module under it
    with _warns(old, new):
        runpy.run_module(old, run_name="__main__", alter_sys=True)
    assert calls == [["--quick"]]


def test_python_m_the_package_runs_the_wrappers_bench(monkeypatch):
    calls = []
    monkeypatch.setattr(wrappers, "main", lambda: calls.append(sys.argv[1:]))
    monkeypatch.setattr(sys, "argv", ["-m", "--quick"])
    runpy.run_module("experiments.bench", run_name="__main__", alter_sys=True)
    assert calls == [["--quick"]]


def test_an_old_name_run_from_the_shell_shows_the_warning_and_the_table():
    """Python shows a DeprecationWarning by default only when it is attributed to ``__main__``."""
    proc = subprocess.run([sys.executable, "-m", "experiments.bench_random", "--sizes", "1024", "--repeats", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "DeprecationWarning: experiments.bench_random is deprecated" in proc.stderr
    assert "python -m experiments.bench.random_normal" in proc.stderr
    assert "ours/randn" in proc.stdout
