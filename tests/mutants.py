"""Mutation drill: plant small bugs one at a time and check that the tests meant to catch each one do.

Run it as ``python -m tests.mutants`` (``--list`` shows the mutants, ``--only ID ...`` runs some). The
working tree is copied once to a temporary folder (no ``.venv``, ``.git``, caches or outputs); every
mutant is written into the copy only, its tests run there with ``PYTHONPATH`` on the copy (checked
first: the copy's modules must be the ones imported, not the editable install's), and the file is
restored. A mutant is *killed* when pytest fails (exit status 1), *survived* when it passes (0), an
*error* on a timeout or any other status (collection errors, unknown node ids), and *stale* when its
snippet no longer occurs exactly once in the code (the list is ``tests/mutant_catalog.py``;
``tests/test_mutants.py`` keeps it in sync).
Before any mutant, the union of the selected tests runs unmutated; a test failing there already
(someone's work in progress) is deselected from the runs of the mutants that list it, so a kill
always means the mutant broke something.

Each snippet is a realistic one-token-ish bug: a transpose that is not the transpose, an off-by-one,
a wrong dim, a sum for a max, a dropped collective, a rule in the wrong place. The exit status is
0 only when every mutant is killed or listed in ``EQUIVALENT`` with the reason it is not a bug.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.mutant_catalog import EQUIVALENT, MUTANTS, Mutant

ROOT = Path(__file__).resolve().parents[1]
_COPY_IGNORE = (".venv*", ".git", "__pycache__", ".pytest_cache", ".hypothesis", ".ruff_cache", "outputs",
                "multirun", "*.egg-info")
_PACKAGES = ("core", "shardings", "models", "experiments", "tests")

# -- the drill ---------------------------------------------------------------------------------------------


def check_snippet(m: Mutant, root: Path = ROOT) -> str | None:
    """``None`` when ``m.find`` occurs exactly once in ``root / m.file``, else what is wrong."""
    path = root / m.file
    if not path.is_file():
        return f"{m.file} does not exist"
    n = path.read_text().count(m.find)
    return None if n == 1 else f"snippet {'not found' if n == 0 else f'found {n} times'} in {m.file}: {m.find!r}"


def node_file(node: str) -> str:
    """The file of a node id (``tests/x.py::test_y[case]`` -> ``tests/x.py``)."""
    return node.split("::", 1)[0]


def _copy_tree(dest: Path) -> Path:
    copy = dest / "tree"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(*_COPY_IGNORE))
    return copy


def _env(copy: Path) -> dict[str, str]:
    # No bytecode: a mutant and its restore can share an mtime second and a size (">" vs "<"), and a
    # stale .pyc would then run the previous mutant's code.
    return {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"}


def _check_imports_from(copy: Path) -> None:
    code = "import sys, importlib; print('\\n'.join(importlib.import_module(p).__file__ for p in sys.argv[1:]))"
    out = subprocess.run([sys.executable, "-c", code, *_PACKAGES], cwd=copy, env=_env(copy), capture_output=True,
                         text=True, check=True).stdout.split()
    outside = [f for f in out if not Path(f).resolve().is_relative_to(copy.resolve())]
    if outside or len(out) != len(_PACKAGES):
        raise SystemExit(f"mutants: the copy's packages are not the ones imported ({outside or out}); "
                         "fix PYTHONPATH handling before trusting any kill")


def _run(copy: Path, tests: tuple[str, ...], timeout: float, log: Path, first_failure: bool = True,
         deselect: tuple[str, ...] = ()) -> tuple[int | None, float]:
    """pytest on ``tests`` (less ``deselect``) in the copy: ``(exit status or None on timeout, seconds)``."""
    shutil.rmtree(copy / ".hypothesis", ignore_errors=True)  # no example saved by a previous mutant replays
    cmd = [sys.executable, "-m", "pytest", *(["-x"] if first_failure else []), "-q", "-p", "no:cacheprovider",
           "-n", "0", *(f"--deselect={node}" for node in deselect), *tests]
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=copy, env=_env(copy), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:  # a timeout, or ^C: end the run and the ranks it launched (its own session)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return rc, time.monotonic() - start


def _failed(log: Path) -> list[str]:
    """The node ids pytest's summary lists as FAILED or ERROR, in order."""
    return re.findall(r"^(?:FAILED|ERROR) (\S+\.py(?:::.+?)?)(?: - |$)", log.read_text(errors="replace"), re.M)


def _selects(selection: str, node: str) -> bool:
    """Whether the pytest argument ``selection`` (a file, a test, or one case) includes ``node``."""
    return node == selection or node.startswith((selection + "::", selection + "["))


def _tail(log: Path, lines: int = 15) -> str:
    return "\n".join("    " + s for s in log.read_text(errors="replace").splitlines()[-lines:])


def _baseline(copy: Path, mutants: list[Mutant], timeout: float, log: Path) -> dict[str, tuple[str, ...]] | None:
    """Run every selected test unmutated: ``{mutant id: its tests that fail already}``, or ``None`` when pytest
    could not run them at all (a collection error, an unknown node id, a timeout). The drill deselects those
    (someone's work in progress, say): a mutant is judged by the rest of its tests."""
    union = tuple(dict.fromkeys(t for m in mutants for t in m.tests))
    rc, secs = _run(copy, union, 4 * timeout, log, first_failure=False)
    print(f"mutants: baseline (no mutant, {len(union)} test selections): exit {rc} in {secs:.0f} s", flush=True)
    if rc not in (0, 1):
        print(_tail(log, 30))
        return None
    failed = _failed(log)
    return {m.id: tuple(n for n in failed if any(_selects(t, n) for t in m.tests)) for m in mutants}


def drill(mutants: list[Mutant], timeout: float, baseline: bool, keep: bool) -> int:
    work = Path(tempfile.mkdtemp(prefix="shardlab-mutants-"))
    width = max(len(m.id) for m in mutants)
    try:
        copy = _copy_tree(work)
        _check_imports_from(copy)
        print(f"mutants: working tree copied to {copy}; its packages are the ones imported", flush=True)
        runnable = [m for m in mutants if check_snippet(m, copy) is None]
        broken = _baseline(copy, runnable, timeout, work / "baseline.log") if baseline and runnable else {}
        if broken is None:
            print("mutants: the selected tests cannot run without any mutant; fix that first")
            return 2
        rows = []
        for m in mutants:
            problem = check_snippet(m, copy)
            if problem is not None:
                rows.append((m, "stale", 0.0, problem))
                print(f"  {m.id:{width}} {'stale':9} {0:6.0f} s  {problem}", flush=True)
                continue
            deselect = broken.get(m.id, ())
            path = copy / m.file
            original = path.read_text()
            path.write_text(original.replace(m.find, m.replace))
            try:
                log = work / f"{m.id}.log"
                rc, secs = _run(copy, m.tests, timeout, log, deselect=deselect)
            finally:
                path.write_text(original)
            status = {0: "survived", 1: "killed"}.get(rc, "error")
            note = {0: "its tests pass", 1: (_failed(log) or [""])[0], None: "timeout"}.get(rc, f"pytest exit {rc}")
            if deselect:
                more = f" and {len(deselect) - 1} more" if len(deselect) > 1 else ""
                note += f" (deselected, failing unmutated: {deselect[0]}{more})"
            if status == "error":
                note += "\n" + _tail(log)
            rows.append((m, status, secs, note))
            print(f"  {m.id:{width}} {status:9} {secs:6.0f} s  {note}", flush=True)
        return _report(rows, width)
    finally:
        if keep:
            print(f"mutants: copy and logs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def _report(rows: list[tuple[Mutant, str, float, str]], width: int) -> int:
    print(f"\n{'id':{width}} {'status':10} {'s':>5}  description")
    for m, status, secs, _ in rows:
        shown = "equivalent" if status == "survived" and m.id in EQUIVALENT else status
        print(f"{m.id:{width}} {shown:10} {secs:5.0f}  {m.what}")
    count = lambda s: sum(st == s for _, st, _, _ in rows)
    equivalent = [m for m, st, _, _ in rows if st == "survived" and m.id in EQUIVALENT]
    survivors = [m for m, st, _, _ in rows if st == "survived" and m.id not in EQUIVALENT]
    scored = len(rows) - len(equivalent)
    killed = count("killed")
    rate = f"{100 * killed / scored:.0f}%" if scored else "n/a"
    print(f"\nkill rate: {killed}/{scored} = {rate} (killed / mutants not equivalent); equivalent {len(equivalent)}, "
          f"survived {len(survivors)}, error {count('error')}, stale {count('stale')}")
    for m in equivalent:
        print(f"  equivalent {m.id}: {EQUIVALENT[m.id]}")
    for m, st, _, _ in rows:
        if st == "killed" and m.id in EQUIVALENT:
            print(f"  note: {m.id} is listed in EQUIVALENT but was killed: take it off the list")
    for m in survivors:
        print(f"  SURVIVED {m.id}: {m.what}; add a test that kills it, or a reason to EQUIVALENT")
    return 1 if survivors or count("error") or count("stale") else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.mutants", description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list the mutants and their tests, run nothing")
    parser.add_argument("--only", nargs="+", metavar="ID", help="run only these mutants")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per mutant (default 600)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the selected tests")
    parser.add_argument("--keep", action="store_true", help="keep the copy and the pytest logs")
    args = parser.parse_args(argv)
    by_id = {m.id: m for m in MUTANTS}
    unknown = [i for i in args.only or () if i not in by_id]
    if unknown:
        parser.error(f"unknown mutant ids {unknown}; --list shows them")
    chosen = [by_id[i] for i in args.only] if args.only else list(MUTANTS)
    if args.list:
        for m in chosen:
            problem = check_snippet(m)
            print(f"{m.id}  ({m.file}){'  STALE: ' + problem if problem else ''}\n    {m.what}")
            for t in m.tests:
                print(f"    - {t}")
        return 0
    return drill(chosen, args.timeout, not args.no_baseline, args.keep)


if __name__ == "__main__":
    sys.exit(main())
