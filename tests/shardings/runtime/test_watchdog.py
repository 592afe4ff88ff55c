"""``shardings/runtime/watchdog.py``: a peer whose heartbeat went stale is named, with the call this rank waited in;
a wait with no deadline of its own is ended by the heartbeat thread once the peer was silent for the timeout; a rank
that finished is never taken for a silent one. (A real SIGSTOPped rank: the drills, tests/experiments/test_drill.py.)"""

import os
import time

from shardings.runtime import watchdog


def _stale(folder, rank, seconds):
    file = os.path.join(folder, f"rank{rank}")
    open(file, "w").close()
    os.utime(file, (time.time() - seconds, time.time() - seconds))


def test_silent_names_only_the_stale_peers(tmp_path):
    _stale(tmp_path, 1, 30)
    _stale(tmp_path, 2, 0)
    _stale(tmp_path, 0, 30)  # this rank itself: never its own peer
    assert list(watchdog.silent(str(tmp_path), 4, me=0)) == [1]  # rank 3: no file (finished or not started)


def test_explain_names_the_peer_and_the_distributed_call_on_the_traceback(tmp_path):
    _stale(tmp_path, 3, 25)
    try:
        exec(compile("def all_gather():\n    raise RuntimeError('Timed out')\nall_gather()",
                     os.path.join("x", "torch", "distributed", "c10d.py"), "exec"), {})
    except RuntimeError as e:
        said = watchdog.explain(e, str(tmp_path), 4, me=1)
    assert said.startswith("rank 1 waited in all_gather while rank 3 (silent for 25") and "Fix:" in said
    assert watchdog.explain(RuntimeError(), str(tmp_path / "none"), 4, me=1) == ""


def test_a_wait_without_deadline_is_ended_once_a_peer_was_silent_for_the_timeout(tmp_path):
    hung, started = [], time.monotonic()
    with watchdog.beating(str(tmp_path), 0, 2, timeout_s=1.0, on_hang=lambda msg, stack, silent: hung.append(msg)):
        _stale(tmp_path, 1, 0)  # rank 1 beat once, then stopped
        while not hung and time.monotonic() - started < 10:
            time.sleep(0.05)
    assert hung and hung[0].startswith("rank 0 waited") and "rank 1 (silent for" in hung[0]
    assert time.monotonic() - started < 5


def test_a_finished_rank_is_not_silent(tmp_path):
    with watchdog.beating(str(tmp_path), 1, 2, timeout_s=60, on_hang=lambda msg, stack, silent: None):
        assert os.path.exists(tmp_path / "rank1")
    assert not os.path.exists(tmp_path / "rank1") and watchdog.silent(str(tmp_path), 2, me=0) == {}


def test_a_pipeline_receive_names_its_message_when_its_peer_goes_silent(tmp_path):
    hung, started = [], time.monotonic()
    record = lambda msg, stack, silent: hung.append(msg)
    message = "for the activations of microbatch 2 from rank 1 (stage 0)"
    with watchdog.beating(str(tmp_path), 0, 2, timeout_s=1.0, on_hang=record), watchdog.waiting_for(message):
        _stale(tmp_path, 1, 0)
        while not hung and time.monotonic() - started < 10:
            time.sleep(0.05)
    assert hung[0].startswith("rank 0 waited for the activations of microbatch 2 from rank 1 (stage 0) while rank 1")
