"""launch(): real gloo processes. Each launch costs seconds, so one launched function checks many things."""

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from shardings import LaunchError, Mesh, comms, launch, memory
from shardings.runtime.launch import init_from_env
from shardings.testing import assert_close

pytestmark = pytest.mark.multiprocess


def _rank_and_world():
    return dist.get_rank(), dist.get_world_size()


def _facts(scale: float) -> dict:
    rank = dist.get_rank()
    x = torch.tensor([float(rank + 1)]) * scale
    dist.all_reduce(x)
    mesh = Mesh(dp=2)
    dm = mesh.device_mesh
    with comms() as c:
        DTensor.from_local(torch.ones(4, 4), dm, [Partial()]).redistribute(dm, [Replicate()])
    shard = DTensor.from_local(torch.full((2, 3), float(rank)), dm, [Shard(0)])
    return {
        "rank": rank,
        "world": dist.get_world_size(),
        "init_from_env": init_from_env(),  # a running group: a no-op that returns the rank
        "all_reduce": x,
        "mesh": dm.shape,
        "comms": c.rows(),
        "memory": memory({"shard": shard, "plain": torch.ones(2)}),
        "shard": shard,  # comes back as this rank's local shard, a CPU tensor
        "nested": launch(_rank_and_world, 2),  # under a running world: runs here, results all-gathered
    }


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")
    dist.all_reduce(torch.ones(1))  # rank 0 waits for a peer that died


def _exit_without_exception():
    if dist.get_rank() == 1:
        os._exit(3)
    time.sleep(60)  # not in a collective: stopped by the launcher, not failing of rank 1's death first


def _sigkill_rank_one():
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))  # rank 0's collective breaks at once: "Connection reset by peer"


def _mismatched_collective():
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))
    else:
        time.sleep(120)  # never joins: rank 0's all_reduce must time out, not hang


def test_launch_returns_per_rank_results():
    results = launch(_facts, 2, 10.0)
    assert [r["rank"] for r in results] == [0, 1]
    for rank, r in enumerate(results):
        assert r["world"] == 2 and r["init_from_env"] == rank and r["mesh"] == (2,)
        assert_close(r["all_reduce"], torch.tensor([30.0]))
        assert r["comms"] == [{"kind": "all_reduce", "axis": "dp", "count": 1, "bytes": 64}]
        assert r["memory"] == 6 * 4 + 2 * 4
        assert type(r["shard"]) is torch.Tensor and r["shard"].device.type == "cpu"
        assert_close(r["shard"], torch.full((2, 3), float(rank)))
        assert r["nested"] == [(0, 2), (1, 2)]


def test_exception_names_rank_and_traceback():
    with pytest.raises(LaunchError) as info:
        launch(_fail_on_rank_one, 2, timeout=30)
    err = info.value
    assert err.rank == 1 and err.exc_type == "ValueError"
    text = str(err)
    assert "rank 1 of 2 raised ValueError: boom on rank one" in text
    assert "Traceback" in text and "_fail_on_rank_one" in text


def test_a_rank_dying_without_exception_is_named():
    with pytest.raises(LaunchError, match=r"rank 1 of 2 failed without a Python exception: exit code 3"):
        launch(_exit_without_exception, 2, timeout=30)


def test_a_sigkilled_rank_is_named_not_the_peer_whose_collective_broke():
    for _ in range(2):  # the peer's error and the death land in the same second: twice, to catch an order race
        with pytest.raises(LaunchError) as info:
            launch(_sigkill_rank_one, 2, timeout=30)
        assert info.value.rank == 1 and info.value.exc_type == "ChildFailedError"
        assert "rank 1 of 2 failed without a Python exception: exit code -9 (SIGKILL)" in str(info.value)
        assert "reset by peer" not in str(info.value).split("(then")[0]


def test_collective_mismatch_fails_within_timeout():
    start = time.monotonic()
    with pytest.raises(LaunchError, match=r"rank 0 of 2 raised") as info:
        launch(_mismatched_collective, 2, timeout=3)
    assert time.monotonic() - start < 100  # rank 1 sleeps 120 s: only the 3 s timeout ends this
    assert "_mismatched_collective" in info.value.worker_traceback


def test_unpicklable_fn_is_a_clear_error():
    with pytest.raises(TypeError, match=r"cannot be sent to worker processes.*Fix: define fn at module level"):
        launch(lambda: 1, 2)
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        launch(_rank_and_world, 0)


def test_init_from_env_outside_torchrun_is_a_clear_error(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(RuntimeError, match=r"missing .*Fix: start the script with torchrun"):
        init_from_env()


_UNGUARDED = '''
import models
import shardings
from shardings.testing import check_equivalence

cfg = models.mlp.Config(layers=1, dim=8, mlp=16, seq_len=4)
{launch}
'''
_CHECK = ("check_equivalence(models.mlp.init, models.mlp.loss, models.mlp.axes, cfg, models.mlp.example_batch(cfg, 4), "
          "layouts=['dp'], mesh=shardings.Mesh(dp=2), steps=1, runtime='multiprocess')")


@pytest.mark.parametrize("launch_line, fails", [
    (_CHECK, True),  # the API's multiprocess runtime from a script's top level: workers would re-run the script
    (f"for _ in range(1):\n    {_CHECK}", True),
    (f"if __name__ == '__main__':\n    try:\n        print('ok' if {_CHECK}.ok else 'bad')\n    finally:\n        pass",
     False),
])
def test_a_script_without_the_main_guard_is_told_before_any_process_starts(tmp_path, launch_line, fails):
    import subprocess
    import sys

    script = tmp_path / "script.py"
    script.write_text(_UNGUARDED.format(launch=launch_line))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    if fails:
        assert proc.returncode == 1 and "launch" not in proc.stdout
        assert f"launch() is reached from the top level of {script}" in proc.stderr
        assert 'Fix: put the script\'s top-level code that launches under `if __name__ == "__main__":`' in proc.stderr
        assert "failed without a Python exception" not in proc.stderr  # no worker was started
    else:
        assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
