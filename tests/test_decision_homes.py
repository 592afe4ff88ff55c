"""One home per decision (DESIGN §1, #39 item 2): each default below is a name the others import, and this test
finds a literal copy of it if one comes back.

| decision | its one home |
|---|---|
| the schedule a pipelined run gets when it names none | ``shardings.pipeline.DEFAULT_SCHEDULE`` |
| a pipelined run's microbatches when none are asked for | ``shardings.pipeline.default_microbatches`` |
| the named precision policies (fp32, bf16, fp16) | ``core.precision.NAMED`` (``named``, ``name_of``) |
| a global batch splits evenly over data ranks × microbatches | ``shardings.check_batch_rows`` |
| the jit backend when none is named | ``shardings.DEFAULT_JIT_BACKEND`` |
| the bucket size of bucketed collectives | ``shardings.comm.buckets.DEFAULT_BUCKET_MB`` |
"""

import ast
from pathlib import Path

import core
import shardings

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("shardings", "experiments", "models", "core")
HOMES = {  # the files where a decision's literal is its definition
    "schedule": ("shardings/pipeline/",),  # each schedule registers its name where it is defined
    "precision": ("core/precision.py",),
    "jit_backend": ("shardings/step/compiled.py",),
    "divisible": ("shardings/step/batching.py",),
    "bucket": ("shardings/comm/buckets.py",),
    "microbatches": ("shardings/pipeline/plan.py",),
}
PRECISION_NAMES = set(core.precision.NAMED)
DTYPE_NAMES = {"float32", "bfloat16", "float16"}


def _str(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _defaults(tree: ast.AST):
    """Every expression that is a default: ``x or <d>``, a parameter's default, ``.get(key, <d>)``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or):
            yield from node.values[1:]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from [d for d in [*node.args.defaults, *node.args.kw_defaults] if d is not None]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
              and len(node.args) == 2):
            yield node.args[1]


def _defaults_and_parts(tree: ast.AST):
    """Every default, and each element of a default that is a tuple (a probe's ``(schedule, first, last)``)."""
    for node in _defaults(tree):
        yield node
        if isinstance(node, ast.Tuple):
            yield from node.elts


def findings(path: Path, rel: str, schedules: set[str]) -> list[str]:
    """What in one file decides again what its home decides (``decision: line: what``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    home = {d for d, files in HOMES.items() if any(rel.startswith(f) for f in files)}
    out = []
    for node in _defaults_and_parts(tree):
        value = _str(node)
        if value in schedules and "schedule" not in home:
            out.append(f"schedule: {node.lineno}: default {value!r} (use shardings.pipeline.DEFAULT_SCHEDULE)")
        if value in {"inductor", "aot_eager"} and "jit_backend" not in home:
            out.append(f"jit_backend: {node.lineno}: default {value!r} (use shardings.DEFAULT_JIT_BACKEND)")
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict) and "precision" not in home:
            keys, values = {_str(k) for k in node.keys if k is not None}, {_str(v) for v in node.values}
            named = len(keys & DTYPE_NAMES) >= 2 and len(values & PRECISION_NAMES) >= 2  # dtype -> precision name
            if len(keys & PRECISION_NAMES) >= 2 or named:
                out.append(f"precision: {node.lineno}: a table of precision names (use core.precision.NAMED)")
        if isinstance(node, ast.Tuple) and "precision" not in home and {_str(e) for e in node.elts} >= PRECISION_NAMES:
            out.append(f"precision: {node.lineno}: the precision names spelled out (use core.precision.NAMED)")
        if (isinstance(node, ast.IfExp) and "microbatches" not in home and "> 1" in ast.unparse(node.test)
                and "pp" in ast.unparse(node.orelse)):
            out.append(f"microbatches: {node.lineno}: the pipeline's microbatch default (use "
                       "shardings.pipeline.default_microbatches)")
        text = "".join(_str(v) or "" for v in node.values) if isinstance(node, ast.JoinedStr) else _str(node) or ""
        if "not divisible" in text and "data-parallel" in text and "divisible" not in home:
            out.append(f"divisible: {node.lineno}: a batch divisibility message (use shardings.check_batch_rows)")
        if (isinstance(node, ast.Attribute) and node.attr == "default" and isinstance(node.value, ast.Subscript)
                and "signature" in ast.unparse(node.value)):
            out.append(f"default: {node.lineno}: a default read back from a signature (import its name)")
        if (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult) and "bucket" not in home
                and ast.unparse(node).replace(" ", "") in ("25*2**20", "25*1024*1024")):
            out.append(f"bucket: {node.lineno}: the bucket size copied (use buckets.DEFAULT_BUCKET_MB)")
    return out


def all_findings(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, list[str]]:
    schedules = set(shardings.pipeline.SCHEDULES) | {"1f1b"}
    out = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            found = findings(path, rel, schedules)
            if found:
                out[rel] = found
    return out


def test_each_default_has_one_home():
    assert all_findings() == {}


def test_the_check_finds_each_kind_of_copy(tmp_path):
    (tmp_path / "experiments").mkdir()
    (tmp_path / "experiments" / "bad.py").write_text(
        'import inspect\n'
        'def f(schedule=None, backend="inductor"):\n'
        '    name = schedule or "gpipe"\n'
        '    probe, *ends = peak_probe or ("zb_h1", True, True)\n'
        '    names = {"float32": "fp32", "bfloat16": "bf16"}\n'
        '    precisions = ("fp32", "bf16", "fp16")\n'
        '    raise ValueError(f"batch {3} is not divisible by {2} data-parallel ranks")\n'
        'D = inspect.signature(f).parameters["backend"].default\n'
        'B = 25 * 2**20\n'
        'M = accum if accum > 1 else sizes.get("pp", 1)\n')
    found = all_findings(tmp_path, ("experiments",))["experiments/bad.py"]
    assert sorted(f.split(":")[0] for f in found) == ["bucket", "default", "divisible", "jit_backend", "microbatches",
                                                      "precision", "precision", "schedule", "schedule"], found


def test_the_planner_s_whole_step_program_runs_the_default_schedule():
    """Its schedule is the one home's (``exact.WHOLE_STEP_PROGRAM``'s comment says why any would count the same)."""
    from shardings.planner import exact

    assert exact.WHOLE_STEP_PROGRAM == (shardings.pipeline.DEFAULT_SCHEDULE, True, True)
