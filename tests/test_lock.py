"""The lock: every dependency pinned, torch left to the machine, no CUDA packages, and this venv installed from it."""

import os
import re
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)\s*$")


def _lock() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = PIN.match(line)
        assert match, f"requirements.lock: not an exact pin: {line!r}"
        pins[canonicalize_name(match[1])] = match[2]
    return pins


def _declared() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in [*project["dependencies"], *project["optional-dependencies"]["dev"]]]


def test_every_declared_dependency_but_torch_is_pinned_within_its_range():
    pins = _lock()
    for req in _declared():
        name = canonicalize_name(req.name)
        if name == "torch":
            assert name not in pins  # the CPU wheel by default, or the user's GPU build: the Makefile's choice
            continue
        assert name in pins, f"{req} is declared in pyproject.toml but not locked: run `make lock`"
        assert req.specifier.contains(pins[name], prereleases=True), f"lock pins {name}=={pins[name]}, outside {req}"


def test_the_lock_never_pulls_cuda_packages():
    cuda = [n for n in _lock() if n.startswith("nvidia-") or n == "triton"]
    assert cuda == [], "the lock was resolved against a CUDA torch build; see `make lock`"


def test_the_install_recipe_uses_the_lock():
    makefile = (ROOT / "Makefile").read_text()
    stamp = re.search(r"^\$\(VENV\)/\.installed: (.*)$", makefile, re.M)
    assert stamp and "$(LOCK)" in stamp[1]  # a changed lock reinstalls
    assert "pip install -r $(LOCK)" in makefile and "pip install --no-deps -e ." in makefile
    # test-latest upgrades everything but torch: an eager upgrade of torch is the newest CUDA build (several GB)
    assert "--upgrade-strategy eager -c .venv-latest/torch.txt" in makefile


@pytest.mark.skipif(os.environ.get("SHARDLAB_UNLOCKED") == "1",
                    reason="make test-latest ignores the lock on purpose (newest releases)")
def test_this_environment_matches_the_lock():
    wrong = {}
    for name, version in _lock().items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            installed = None
        if installed != version:
            wrong[name] = (version, installed)
    assert wrong == {}, f"installed ≠ locked (locked, installed): {wrong}; run `make install`"
