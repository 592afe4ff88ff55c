"""Mutation drill: plant small bugs one at a time and check that the tests meant to catch each one do.

Run it as ``python -m tests.mutants`` (``--list`` shows the mutants, ``--only ID ...`` runs some). The
working tree is copied once to a temporary folder (no ``.venv``, ``.git``, caches or outputs); every
mutant is written into the copy only, its tests run there with ``PYTHONPATH`` on the copy (checked
first: the copy's modules must be the ones imported, not the editable install's), and the file is
restored. A mutant is *killed* when pytest fails (exit status 1), *survived* when it passes (0), an
*error* on a timeout or any other status (collection errors, unknown node ids), and *stale* when its
snippet no longer occurs exactly once in the code (``tests/test_mutants.py`` keeps the list in sync).
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
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
_COPY_IGNORE = (".venv*", ".git", "__pycache__", ".pytest_cache", ".hypothesis", ".ruff_cache", "outputs",
                "multirun", "*.egg-info")
_PACKAGES = ("core", "shardings", "models", "experiments", "tests")


class Mutant(NamedTuple):
    """One planted bug: ``find`` (which must occur exactly once in ``file``) becomes ``replace``."""

    id: str
    file: str  # relative to the repository root
    find: str
    replace: str
    what: str  # one line: the bug, in words
    tests: tuple[str, ...]  # pytest node ids or files expected to catch it, fastest first


# Node ids; a parametrized case's id (the part in brackets) is pytest's and is checked only by running.
T_COLL = "tests/shardings/test_collectives.py"
T_LOCAL = ("tests/shardings/test_local_step.py::"
           "test_local_path_matches_the_single_device_reference_with_accumulation_clipping_and_small_buckets")
T_RING = "tests/shardings/test_ring_attention.py"
T_RULES = "tests/shardings/test_rules.py"
T_DESIGN = "tests/shardings/test_layouts.py::test_design_table"
T_CP_EP = "tests/shardings/test_layouts_cp_ep.py"  # written for the drill: rule changes equivalence cannot see
T_MOE = "tests/models/test_moe.py::test_moe_mlp_equals_loop_reference"
T_MOE_HAND = "tests/models/test_moe.py::"  # + a hand-computed case (an oracle calling moe.capacity cannot catch it)
T_NLL = ("tests/shardings/test_vocab_parallel.py::"
         "test_per_token_nll_equals_torchs_cross_entropy_with_three_small_all_reduces")
T_CKPT = "tests/shardings/test_checkpoint.py"

MUTANTS: tuple[Mutant, ...] = (
    # -- the collectives' transposes (shard_map's check_rep=False convention) --------------------------
    Mutant("psum-transpose-identity", "shardings/comm/collectives.py",
           "return _PSum.apply(g, ctx.ax), None",
           "return g, None",
           "psum's backward passes the cotangent through instead of psumming it",
           (f"{T_COLL}::test_psum_and_pmean",)),
    Mutant("all-gather-transpose-dim0", "shardings/comm/collectives.py",
           "return _PSumScatter.apply(g, ctx.ax, ctx.dim), None, None",
           "return _PSumScatter.apply(g, ctx.ax, 0), None, None",
           "all_gather's backward reduce-scatters along dim 0 whatever dim was gathered",
           (f"{T_COLL}::test_all_gather",)),
    Mutant("psum-scatter-transpose-mean", "shardings/comm/collectives.py",
           "return _AllGather.apply(g, ctx.ax, ctx.dim), None, None",
           "return _AllGather.apply(g / ctx.ax.size, ctx.ax, ctx.dim), None, None",
           "psum_scatter's backward all-gathers the cotangent divided by the axis size (a mean's transpose)",
           (f"{T_COLL}::test_psum_scatter",)),
    Mutant("all-to-all-transpose-not-reversed", "shardings/comm/collectives.py",
           "return _AllToAll.apply(g, ctx.ax, ctx.concat, ctx.split), None, None, None",
           "return _AllToAll.apply(g, ctx.ax, ctx.split, ctx.concat), None, None, None",
           "all_to_all's backward repeats the forward exchange instead of reversing split and concat",
           (f"{T_COLL}::test_all_to_all",)),
    Mutant("flattened-axis-scatter-order-not-inverted", "shardings/comm/axis_comm.py",
           "x = _reorder(x, _inverse(ax.order)).contiguous()\n    return _wait(funcol.reduce_scatter_single(",
           "x = _reorder(x, ax.order).contiguous()\n    return _wait(funcol.reduce_scatter_single(",
           "a reduce-scatter over axes named out of mesh order permutes blocks by the order, not its inverse "
           "(psum_scatter, and all_gather's transpose)",
           (f"{T_COLL}::test_psum_scatter", f"{T_COLL}::test_all_gather")),
    # -- the lowering: logical names -> P -> placements ----------------------------------------------
    Mutant("rules-fallback-reuses-axis", "shardings/spec/rules.py",
           "if name == rule_name and chosen[dim] is None and used.isdisjoint(axes):",
           "if name == rule_name and chosen[dim] is None:",
           "logical_to_spec gives a mesh axis to a dim although another dim of the tensor already uses it",
           (f"{T_RULES}::test_fallback_cases", f"{T_RULES}::test_flax_semantics")),
    Mutant("lower-split-factor-reversed", "shardings/spec/lower.py",
           "for earlier in axes[:k] if index[earlier] > index[name])",
           "for earlier in axes[:k] if index[earlier] < index[name])",
           "a tuple of axes out of mesh order gets the split factors of the opposite order (_StridedShard)",
           ("tests/shardings/test_lower.py::test_to_placements_examples",
            "tests/shardings/test_lower.py::test_to_placements_three_axes_split_factors")),
    Mutant("lower-chunk-floor", "shardings/spec/lower.py",
           "step = -(-(stop - start) // n_chunks)",
           "step = (stop - start) // n_chunks",
           "local_block cuts uneven dims with floor instead of torch.chunk's ceil (the last elements go nowhere)",
           ("tests/shardings/test_lower.py::test_local_block_examples",
            "tests/shardings/test_lower.py::test_local_blocks_cover_each_element_once_per_replica")),
    # -- the layout rules (presets) ------------------------------------------------------------------
    Mutant("hsdp-shards-over-dp", "shardings/spec/layouts.py",
           '_HSDP = _shard_params_over("fsdp")',
           "_HSDP = _shard_params_over(DATA_AXES)",
           "hsdp shards parameters over dp too (it becomes zero3: no replica axis)",
           (T_DESIGN,)),
    Mutant("sp-outranks-tp", "shardings/spec/layouts.py",
           'group="sp", needs=(("tp",),), after=("tp",), rank=20)',
           'group="sp", needs=(("tp",),), after=("tp",), rank=5)',
           "sp's seq -> tp rule ranks before tp's, so attention and MLP activations put seq on tp, not heads/mlp",
           (T_DESIGN,)),
    Mutant("cp-kv-seq-replicated", "shardings/spec/layouts_cp_ep.py",
           'register("cp", Layout(batch=_SEQ, activations=_SEQ + Rules([("kv_seq", CP_AXIS)])),',
           'register("cp", Layout(batch=_SEQ, activations=_SEQ + Rules([("kv_seq", None)])),',
           "preset cp replicates kv_seq: attention all-gathers K/V (cp_allgather's memory) instead of the ring",
           (f"{T_CP_EP}::test_cp_rings_kv_and_cp_allgather_gathers_them",
            f"{T_RING}::test_ring_passes_kv_cp_minus_one_times_forward_and_kv_dkv_in_backward")),
    Mutant("ep-ranks-after-data", "shardings/spec/layouts_cp_ep.py",
           "group=\"ep\", needs=((EP_AXIS,),), rank=-10)",
           "group=\"ep\", needs=((EP_AXIS,),), rank=30)",
           "ep's rules rank after the data presets' and tp's: tokens stop splitting over ep (ep ranks duplicate "
           "work) and tp's expert -> None wins",
           (f"{T_CP_EP}::test_ep_splits_tokens_over_ep_and_experts_in_every_role",
            "tests/shardings/test_review_guards.py::test_ep_layouts_persistent_bytes_per_role_and_collectives_per_step")),
    # -- bucket and microbatch averaging ----------------------------------------------------------------
    Mutant("local-token-total-not-all-reduced", "shardings/step/local_step.py",
           'counts = fc.wait(funcol.all_reduce(counts, "sum", comm.group(m)))',
           "counts = counts",
           "each rank weighs its loss by its share of its own tokens, not of the global batch's (grads x ranks)",
           (f"{T_LOCAL}[dp-mesh0]",)),
    Mutant("local-accumulation-dropped", "shardings/step/local_step.py",
           "ready[j][i] = g + acc[i] if i in acc else g",
           "ready[j][i] = g",
           "a bucket's reduction keeps only the last microbatch's gradient, dropping the accumulated ones",
           (f"{T_LOCAL}[dp-mesh0]",)),
    Mutant("dtensor-microbatch-weight-uniform", "shardings/step/train_step.py",
           "weight = self.token_count(mb) / total_tokens",
           "weight = 1 / self.accum_steps",
           "the DTensor path averages microbatch means instead of weighing each by its share of the tokens",
           ("tests/shardings/test_layout_matrix.py::test_layout_matrix_matches_the_single_device_reference",)),
    Mutant("reduce-scatter-pack-leaf-major", "shardings/comm/flat_comm.py",
           "flat = torch.cat([c[r].reshape(-1) for r in range(n) for c in chunks])",
           "flat = torch.cat([c[r].reshape(-1) for c in chunks for r in range(n)])",
           "a bucket's flat buffer is packed leaf-major, so the reduce-scatter hands ranks the wrong chunks",
           (f"{T_LOCAL}[zero2-mesh2]",)),
    # -- ZeRO-3's backward re-gather -------------------------------------------------------------------
    Mutant("zero3-regather-wrong-leaf", "shardings/residency/gather_params.py",
           "self.gathered(saved.bucket)[saved.pos]",
           "self.gathered(saved.bucket)[-1]",
           "backward's re-gather hands autograd the bucket's last leaf for every saved weight",
           (f"{T_LOCAL}[zero3-mesh3]",)),
    Mutant("zero3-prefetch-wrong-way", "shardings/residency/gather_params.py",
           "nxt = self.buckets[self.order[at + 1]]",
           "nxt = self.buckets[self.order[at - 1]]",
           "backward prefetches the bucket it already re-gathered (at the first: the last one) instead of the next",
           ("tests/shardings/test_local_step.py::test_zero3_regathers_buckets_in_backward_prefetching_the_next",
            "tests/shardings/test_review_guards.py::"
            "test_dtensor_path_zero3_regathers_buckets_in_backward_prefetching_the_next")),
    # -- ring attention: the mask and the online-softmax merge ------------------------------------------
    Mutant("ring-diagonal-mask-strict", "shardings/ops/ring_attention.py",
           "    return pos[:, None] >= pos[None, :]",
           "    return pos[:, None] > pos[None, :]",
           "the ring's diagonal block masks each query's own key (strict causal mask)",
           (f"{T_RING}::test_equals_reference_values_and_grads",)),
    Mutant("ring-merge-no-rescale", "shardings/ops/ring_attention.py",
           "out[:, qi] = out[:, qi] * to_rows(lse[..., qi]) + o * to_rows(block_lse)",
           "out[:, qi] = out[:, qi] + o * to_rows(block_lse)",
           "the online-softmax merge does not rescale the running output by its old log-sum-exp",
           (f"{T_RING}::test_equals_reference_values_and_grads",)),
    # -- MoE: router and capacity -----------------------------------------------------------------------
    Mutant("moe-capacity-floor", "models/moe.py",
           "return min(seq, math.ceil(cfg.capacity_factor * seq * cfg.top_k / cfg.experts))",
           "return min(seq, int(cfg.capacity_factor * seq * cfg.top_k / cfg.experts))",
           "capacity rounds the fair share down instead of up",
           (f"{T_MOE_HAND}test_capacity_by_hand",)),
    Mutant("moe-slot-positions-one-based", "models/moe.py",
           "position = ((order.cumsum(1) - 1) * order).sum(-1)",
           "position = (order.cumsum(1) * order).sum(-1)",
           "queue positions count from 1: each expert keeps one assignment fewer than its capacity",
           (f"{T_MOE_HAND}test_drops_earlier_tokens_first_by_hand", T_MOE)),
    Mutant("moe-router-weights-not-renormalized", "models/moe.py",
           "weights = top_p / top_p.sum(-1, keepdim=True)",
           "weights = top_p",
           "the chosen experts' weights are the raw router probabilities, not renormalized over the top k",
           (f"{T_MOE_HAND}test_top_k_routing_and_renormalized_weights_by_hand", T_MOE)),
    # -- vocab-parallel cross-entropy -------------------------------------------------------------------
    Mutant("vocab-max-shift-summed", "shardings/ops/vocab_parallel.py",
           'shift = reduce(block.detach().amax(-1), "max")',
           'shift = reduce(block.detach().amax(-1), "sum")',
           "the logsumexp shift sums the blocks' maxima instead of taking their max (exact in math; exp underflows)",
           ("tests/shardings/test_review_guards.py::"
            "test_vocab_parallel_cross_entropy_on_logits_of_magnitude_1e4_equals_one_device_and_torch",)),
    Mutant("vocab-target-not-all-reduced", "shardings/ops/vocab_parallel.py",
           'target = reduce(block.gather(-1, idx[..., None]).squeeze(-1) * hit, "sum")',
           "target = block.gather(-1, idx[..., None]).squeeze(-1) * hit",
           "the target logit is not all-reduced: ranks without the label subtract 0",
           (T_NLL,)),
    # -- the optimizer ----------------------------------------------------------------------------------
    Mutant("adam-bias2-not-sqrt", "core/optim/transforms.py",
           "bias1, bias2_sqrt = _one_minus_pow(b1, t), _one_minus_pow(b2, t).sqrt()",
           "bias1, bias2_sqrt = _one_minus_pow(b1, t), _one_minus_pow(b2, t)",
           "Adam divides the root second moment by 1 - b2^t instead of its square root",
           ("tests/core/optim/test_aliases.py::test_adamw_matches_torch",)),
    Mutant("fused-adamw-ignores-mask", "core/optim/fused.py",
           "weight_decay=weight_decay if decay else 0.0, eps=eps",
           "weight_decay=weight_decay, eps=eps",
           "the fused AdamW step decays every parameter, ignoring the weight-decay mask",
           ("tests/core/optim/test_fused.py::test_fused_step_equals_update_then_apply",)),
    # -- checkpoint resharding --------------------------------------------------------------------------
    Mutant("ckpt-placements-reversed", "shardings/checkpoint/__init__.py",
           "return distribute_tensor(local, like.device_mesh, like.placements, src_data_rank=None)",
           "return distribute_tensor(local, like.device_mesh, like.placements[::-1], src_data_rank=None)",
           "a simulated load lays each tensor out with the target's placements in reversed mesh-dim order",
           (f"{T_CKPT}::test_a_simulated_load_onto_a_2d_mesh_puts_each_block_on_its_rank",
            f"{T_CKPT}::test_simulated_ranks_save_and_load_across_meshes")),
    Mutant("ckpt-loads-whole-on-real-ranks", "shardings/checkpoint/__init__.py",
           "return torch.empty_like(x)",
           "return torch.empty(x.shape, dtype=x.dtype)",
           "a load on real ranks reads every tensor whole into a plain tensor instead of each rank's shards",
           (f"{T_CKPT}::test_resharding_matrix_across_layouts_meshes_world_sizes_and_one_device",)),
)

# Mutants that change no behaviour a user could observe, each with the reason; they may survive.
EQUIVALENT: dict[str, str] = {}


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
