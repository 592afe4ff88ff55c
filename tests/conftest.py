"""Strict, deterministic test configuration shared by the whole suite."""

import ast
import functools
import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, register_random, settings

from shardings.runtime import compat

# Deterministic by default (CI and local runs see the same examples); HYPOTHESIS_PROFILE=explore
# searches with fresh randomness and more examples when hunting bugs.
settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=25,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "explore", deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

torch.set_default_dtype(torch.float32)
# Two cores shared by pytest-xdist workers (and simulated ranks): one intra-op thread per worker
# avoids oversubscription, which made DTensor-heavy tests several times slower.
torch.set_num_threads(1)


class _TorchGlobalRandom:
    """torch's global RNG in the shape hypothesis manages (seed/getstate/setstate). Registered, every example
    starts from the same torch state, so a failing example replays with the same tensors; unregistered, a
    test drawing tensors with ``torch.randn`` saw new values on the replay and failed as ``FlakyFailure``."""

    def seed(self, n: int) -> None:
        torch.manual_seed(n)

    def getstate(self) -> torch.Tensor:
        return torch.get_rng_state()

    def setstate(self, state: torch.Tensor) -> None:
        torch.set_rng_state(state)


_TORCH_RANDOM = _TorchGlobalRandom()  # hypothesis keeps a weak reference only
register_random(_TORCH_RANDOM)


# Simulated ranks need torch >= 2.13 (shardings/runtime/compat.py); GPU images ship 2.11. A test that uses them
# is marked `simulated` when its source says so (it, or a function or fixture of its module it uses, names
# simulate/LocalTensor/rank_map) or by hand, and on a torch that cannot simulate it is skipped with the reason.
# So is a test that gets there another way, when it does (check_equivalence's default runtime, a docs block, a
# helper's import, a child process such as a sweep job), and a test module whose import needs such a name.
_SIMULATION_NAMES = frozenset({"simulate", "LocalTensor", "LocalTensorMode", "rank_map"})


@functools.cache
def _simulating(path: Path) -> frozenset[str]:
    """The functions of a test module that reach simulated ranks, directly or via each other."""
    uses: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):  # not the decorators: parametrize ids are data
            uses.setdefault(node.name, set()).update(
                n.id if isinstance(n, ast.Name) else n.attr
                for part in [*node.args.defaults, *node.body]
                for n in ast.walk(part)
                if isinstance(n, ast.Name | ast.Attribute)
            )
    found: set[str] = set()
    while new := {f for f, used in uses.items() if f not in found and used & (_SIMULATION_NAMES | found)}:
        found |= new
    return frozenset(found)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if isinstance(item, pytest.Function) and _simulating(item.path) & {item.originalname, *item.fixturenames}:
            item.add_marker(pytest.mark.simulated)
        if item.get_closest_marker("simulated") and not compat.HAS_SIMULATION:  # set above or by hand
            item.add_marker(pytest.mark.skip(reason=str(compat.unavailable("this test (simulated ranks)"))))


def _needs_simulation(error: BaseException | None) -> str | None:
    """Why ``error`` (or an error it was raised from) says this torch cannot simulate ranks; None if it does not."""
    seen = set()
    while error is not None and id(error) not in seen and not compat.HAS_SIMULATION:
        seen.add(id(error))
        if isinstance(error, compat.SimulationUnavailable):
            return str(error)
        if isinstance(error, ImportError) and error.name in compat.SIMULATION_MODULES:
            return str(compat.unavailable(f"this test (it imports from {error.name})"))
        if f"{compat.SimulationUnavailable.__name__}: " in str(error):  # a child process's, in the failure's text
            return str(compat.unavailable("this test (a process it started)"))
        error = error.__cause__ or error.__context__
    return None


class _ModuleWithoutSimulation(pytest.Module):
    """A test module collected on a torch that cannot simulate: an import that needs simulation skips it."""

    def collect(self):
        try:
            return super().collect()
        except self.CollectError as e:
            if reason := _needs_simulation(e):
                pytest.skip(reason, allow_module_level=True)
            raise


def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> pytest.Module | None:
    return None if compat.HAS_SIMULATION else _ModuleWithoutSimulation.from_parent(parent, path=module_path)


def _skip_if_it_needed_simulation():
    """A hook wrapper: an exception that says simulated ranks are missing becomes a skip with that reason."""
    try:
        return (yield)
    except Exception as e:
        if reason := _needs_simulation(e):
            pytest.skip(reason)
        raise


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):  # a fixture that simulates
    return (yield from _skip_if_it_needed_simulation())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    return (yield from _skip_if_it_needed_simulation())
