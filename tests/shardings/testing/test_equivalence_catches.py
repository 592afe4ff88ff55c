"""check_equivalence earns its claim: a bug planted where the work is done fails it, and the same case passes
without the bug (so the bug, not the case, is what fails it).

Each bug is planted with ``monkeypatch`` on the library function that does the work (never on the checker):

1. one bucket of the local path's gradient all-reduce scaled by 1.01 (``flat_comm.launch_reduce``);
2. HSDP's replica all-reduce over ``dp`` dropped (``flat_comm.launch_reduce``'s loop over the data dims);
3. the ``wq`` gradient scaled by 1.1 under ``tp`` (``buckets.reduce``, the DTensor path's gradient reduction),
   with SGD and with AdamW (nearly blind to a leaf's gradient scale: its update is about lr·sign(g)); the grads
   rows catch it at every step, where the params rows may not (an SGD step of lr·10% of a small gradient);
4. one rank's shard of a ZeRO-3 backward re-gather one step stale (``local_step._Gathered._launch`` on the
   local path, ``gather_buckets._Bucket.launch`` on the DTensor path).

And the checker's own rules: each leaf judged by its own scale, tree structures compared.
"""

import functools
import math
import re

import pytest
import torch

import core
import models.gpt as gpt
import shardings
from core import tree
from shardings import Mesh
from shardings.comm import buckets, flat_comm
from shardings.residency import gather_buckets
from shardings.runtime.compat import LocalTensor
from shardings.step import local_step
from shardings.testing import EquivalenceError, check_equivalence, compare_trees

CFG = gpt.Config(vocab=32, dim=16, layers=2, heads=2, mlp=32, seq_len=8)
BATCH = gpt.example_batch(CFG, 4)  # built outside simulate(): one global batch
SGD = functools.partial(core.optim.sgd, 0.1)
ADAMW = functools.partial(core.optim.adamw, 1e-3)
SMALL_BUCKETS = 0.004  # 4 kB: CFG's 21 gradients fall into 10 buckets on the local path
PATHS = [tree.keystr(p) for p, _ in tree.leaves_with_path(gpt.init(core.random.key(0), CFG))]


def _check(layout, mesh, **kw):
    kw = {"steps": 2, "optimizer": SGD, **kw}
    return check_equivalence(gpt.init, gpt.loss, gpt.axes, CFG, BATCH, layouts=[layout], mesh=mesh, **kw)


def _failing_rows(error: EquivalenceError) -> list[tuple[int, str, str]]:
    """``(step, quantity, worst path)`` of every FAIL row of the report in the error's message."""
    rows = re.findall(r"^\S+\s+(\d+) (\w+)\s.*\bFAIL (.*)$", str(error), flags=re.M)
    return [(int(step), quantity, path) for step, quantity, path in rows]


def _local_plan(layout, mesh, bucket_mb):
    with shardings.simulate(mesh.size):
        params = shardings.init(gpt.init, core.random.key(0), CFG, axes=gpt.axes(CFG), layout=layout, mesh=mesh)
        step = shardings.train_step(functools.partial(gpt.loss, cfg=CFG), SGD(), layout=layout, mesh=mesh,
                                    bucket_mb=bucket_mb)
        return step.plan(params).local


# -- the rules: per leaf, structure ----------------------------------------------------------------------------


def test_each_leaf_is_judged_by_its_own_scale():
    """A 1% error in a small leaf beside a large exact one fails (a norm over the whole tree would hide it)."""
    gen = torch.Generator().manual_seed(0)
    want = {"large": 1e3 * torch.randn(4096, generator=gen), "small": torch.randn(4, generator=gen)}
    got = {"large": want["large"].clone(), "small": want["small"] * 1.01}
    *_, path, ok = compare_trees(got, want, terms=64)
    assert not ok and path == "['small']"
    assert compare_trees({k: v.clone() for k, v in want.items()}, want, terms=64)[-1]


def test_tree_structures_must_match_either_way():
    want = {"a": torch.ones(2), "b": {"c": torch.ones(3)}}
    for got in ({"a": torch.ones(2)}, {**want, "d": torch.ones(1)}):
        max_abs, _, used, path, ok = compare_trees(got, want)
        assert not ok and max_abs == used == math.inf and "tree structures differ" in path
    assert compare_trees({"a": torch.ones(2), "b": {"c": torch.ones(3)}}, want)[-1]


# -- 1. one bucket of dp's bucketed all-reduce off by 1% --------------------------------------------------------


def test_one_bucket_of_the_local_paths_gradient_reduction_scaled_by_1_01_fails(monkeypatch):
    mesh, scaled = Mesh(dp=2), 3  # the 4th bucket backward fills (block 1's MLP weights)
    lp = _local_plan("dp", mesh, SMALL_BUCKETS)
    assert lp is not None and len(lp.reduces) > scaled + 1
    calls = []
    launch = flat_comm.launch_reduce

    def counting(comm, grads, target):
        calls.append(len(grads))
        return launch(comm, grads, target)

    monkeypatch.setattr(flat_comm, "launch_reduce", counting)
    assert _check("dp", mesh, bucket_mb=SMALL_BUCKETS).ok  # several buckets, no bug: passes
    assert calls == [len(b) for b in lp.reduces] * 2  # one collective per bucket per step, in the planned order

    def one_bucket_scaled(comm, grads, target):
        calls.append(len(grads))
        if len(calls) == scaled + 1:  # step 1's 4th bucket only
            grads = [g * 1.01 for g in grads]
        return launch(comm, grads, target)

    calls.clear()
    monkeypatch.setattr(flat_comm, "launch_reduce", one_bucket_scaled)
    with pytest.raises(EquivalenceError, match=r"layout 'dp'.*differ") as e:
        _check("dp", mesh, bucket_mb=SMALL_BUCKETS)
    bucket = {PATHS[i] for i in lp.reduces[scaled]}
    failing = _failing_rows(e.value)
    assert (1, "grads") in {(s, q) for s, q, _ in failing}
    assert next(p for s, q, p in failing if (s, q) == (1, "grads")) in bucket


# -- 2. HSDP without its replica all-reduce ------------------------------------------------------------------------


def test_hsdp_without_the_replica_all_reduce_over_dp_fails(monkeypatch):
    mesh = Mesh(dp=2, fsdp=2)
    dp_dim = mesh.device_axes.index("dp")
    assert _check("hsdp", mesh).ok  # no bug: passes
    launch, reduced_over = flat_comm.launch_reduce, []

    def no_replica_all_reduce(comm, grads, target):
        # reduce-scatter over fsdp still runs; the all-reduce over the replica axis dp is skipped
        reduced_over.append(comm.data_dims)
        return launch(comm._replace(data_dims=tuple(m for m in comm.data_dims if m != dp_dim)), grads, target)

    monkeypatch.setattr(flat_comm, "launch_reduce", no_replica_all_reduce)
    with pytest.raises(EquivalenceError, match=r"layout 'hsdp'.*grads differ"):
        _check("hsdp", mesh)
    assert reduced_over and all(dp_dim in dims for dims in reduced_over)  # the seam was the one hsdp uses


# -- 3. tp: one weight's gradient off by 10% ----------------------------------------------------------------------


WQ = "['blocks'][0]['wq']"


def _plant_wq_scale(monkeypatch, scale):
    """``buckets.reduce`` (the DTensor path's gradient reduction) returns ``wq``'s gradient times ``scale``."""
    reduce, i = buckets.reduce, PATHS.index(WQ)

    def scaled(grads, targets, bucket_mb=buckets.DEFAULT_BUCKET_MB):
        out = reduce(grads, targets, bucket_mb)
        assert len(out) == len(PATHS)
        return [*out[:i], out[i] * scale, *out[i + 1:]]

    monkeypatch.setattr(buckets, "reduce", scaled)


@pytest.mark.parametrize("optimizer", [SGD, ADAMW], ids=["sgd", "adamw"])
def test_tp_with_the_wq_gradient_scaled_by_1_1_fails(monkeypatch, optimizer):
    mesh = Mesh(tp=2)
    _plant_wq_scale(monkeypatch, 1.0)
    assert _check("tp", mesh, optimizer=optimizer).ok  # the same seam, no bug: passes
    _plant_wq_scale(monkeypatch, 1.1)
    with pytest.raises(EquivalenceError, match=r"layout 'tp'.*grads differ.*worst at \['blocks'\]\[0\]\['wq'\]") as e:
        _check("tp", mesh, optimizer=optimizer)
    failing = _failing_rows(e.value)
    assert (1, "grads", WQ) in failing and (2, "grads", WQ) in failing  # grads compared at every step


# -- 4. ZeRO-3: one rank's shard of a backward re-gather is one step old ----------------------------------------------


STALE_RANK = 1


def _stale_on_one_rank(current: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """``current`` with rank ``STALE_RANK``'s value taken from ``previous`` (simulated ranks)."""
    assert isinstance(current, LocalTensor), type(current)
    return LocalTensor({r: (previous if r == STALE_RANK else current)._local_tensors[r].clone()
                        for r in current._local_tensors})


class _Stale:
    """Per bucket: the shards its forward gathered this step and the step before (a closure-level record)."""

    def __init__(self, planted: bool):
        self.planted = planted  # False: the same seam hands backward the fresh shards
        self.current, self.previous, self.backward = {}, {}, []

    def forward(self, step_id, k, shards):
        if k in self.current and self.current[k][0] is not step_id:
            self.previous[k] = self.current[k][1]
        self.current[k] = (step_id, [s.detach().clone() for s in shards])

    def shards_for_backward(self, k, shards):
        self.backward.append(k)
        old = self.previous.get(k)
        return shards if old is None or not self.planted else [_stale_on_one_rank(s, o) for s, o in zip(shards, old)]


def _in_backward() -> bool:
    return torch._C._current_autograd_node() is not None


def _plant_stale_local(monkeypatch, stale):
    def launch(self, k):  # local_step._Gathered._launch: the forward gathers, and backward's re-gathers
        b = self.lp.gathers[k]
        shards = [self.shards[i].detach() for i in b]
        if _in_backward():
            shards = stale.shards_for_backward(k, shards)
        else:
            stale.forward(self, k, shards)
        with torch.no_grad():
            return flat_comm.launch_gather(self.comm, shards, self.lp.stored[b[0]])

    monkeypatch.setattr(local_step._Gathered, "_launch", launch)


def _plant_stale_dtensor(monkeypatch, stale):
    created = []  # this microbatch's buckets, in forward order (gather() builds them in that order)
    gather, init = gather_buckets.gather, gather_buckets._Bucket.__init__

    def gathering(*args, **kw):
        created.clear()
        return gather(*args, **kw)

    def bucket_init(self, *args, **kw):
        init(self, *args, **kw)
        created.append(self)

    def launch(self):  # gather_buckets._Bucket.launch: the forward gathers, and backward's re-gathers
        k, step_id = created.index(self), created[0]
        shards = [s.to_local() for s in self.shards]
        if _in_backward():
            shards = stale.shards_for_backward(k, shards)
        else:
            stale.forward(step_id, k, shards)
        return flat_comm.launch_gather(self.comm, shards, self.at[0])

    monkeypatch.setattr(gather_buckets, "gather", gathering)
    monkeypatch.setattr(gather_buckets._Bucket, "__init__", bucket_init)
    monkeypatch.setattr(gather_buckets._Bucket, "launch", launch)


@pytest.mark.parametrize(("layout", "mesh", "local"), [
    ("zero3", Mesh(dp=2), True),  # the local path (the default for zero3)
    ("zero3+tp", Mesh(dp=2, tp=2), False),  # the DTensor path's bucketed gathers
], ids=["zero3-dp2-local", "zero3+tp-dp2xtp2-dtensor"])
def test_zero3_backward_regather_with_one_rank_one_step_stale_fails(monkeypatch, layout, mesh, local):
    plant = _plant_stale_local if local else _plant_stale_dtensor
    fresh = _Stale(planted=False)
    plant(monkeypatch, fresh)
    assert _check(layout, mesh, local=local).ok  # the same seam, shards fresh: passes
    assert len(fresh.backward) >= CFG.layers * 2 and fresh.previous  # every step's backward re-gathered each block

    plant(monkeypatch, _Stale(planted=True))
    with pytest.raises(EquivalenceError, match=rf"layout '{re.escape(layout)}'.*differ") as e:
        _check(layout, mesh, local=local)
    failing = _failing_rows(e.value)
    # step 1 has no previous step: exact; from step 2 the stale weights make backward's gradients wrong
    assert failing and min(s for s, _, _ in failing) == 2 and (2, "grads") in {(s, q) for s, q, _ in failing}
