"""The step-time model: compute, links, overlap, the bubble and shared cores, on hand-made predictions."""

import dataclasses
from fractions import Fraction

import pytest

from shardings.planner import Candidate, Cluster, Link, Prediction, step_time
from shardings.planner.cluster import link_of
from shardings.planner.prediction import Work


def _cluster(**kw) -> Cluster:
    values = dict(name="c", nodes=2, per_node=4, memory=1e9, flops={"float32": 1e12}, efficiency=0.5,
                  mem_bandwidth=1e11, op_overhead=1e-5, dtensor_overhead=1e-4, async_dispatch=False,
                  intra=Link(1e-5, 1e11), inter=Link(1e-4, 1e10), host_bandwidth=1e10)
    return Cluster(**(values | kw))


def _prediction(mesh=(("dp", 8),), comm=None, overlapped=(), bubble=0.0, ops=None, flops=1e12, nbytes=0.0):
    cand = Candidate("dp", tuple(mesh))
    rows = {k: (c, Fraction(b)) for k, (c, b) in (comm or {}).items()}
    return Prediction(cand, True, rows, rows, {"params": 1.0}, 0.0, {"float32": flops}, {"float32": 10.0}, nbytes, 1.0,
                      ops or {"local": 0, "dtensor": 0}, bubble, frozenset(overlapped), 1)


def test_compute_is_flops_at_the_achieved_rate_plus_bytes_at_the_bandwidth():
    t = step_time(_prediction(flops=1e12, nbytes=1e11), _cluster())
    assert t.compute == pytest.approx(1e12 / 5e11 + 1e11 / 1e11)
    assert t.total == pytest.approx(t.compute)


def test_dispatch_adds_on_a_cpu_and_hides_behind_kernels_on_a_gpu():
    pred = _prediction(flops=1e12, ops={"local": 1000, "dtensor": 100})  # compute 2 s, dispatch 0.02 s
    assert step_time(pred, _cluster()).busy == pytest.approx(2 + 0.02)
    assert step_time(pred, _cluster(async_dispatch=True)).busy == pytest.approx(2)


def test_an_axis_within_a_node_uses_the_intra_link_and_across_nodes_the_inter_link():
    c = _cluster()
    assert link_of("tp", {"dp": 2, "tp": 4}, c) is c.intra
    assert link_of("dp", {"dp": 2, "tp": 4}, c) is c.inter
    assert link_of("dp", {"dp": 4, "tp": 2}, c) is c.inter  # 4 groups of stride 2: 8 ranks, two nodes
    comm = {("all_reduce", "tp"): (2, 1e9), ("all_reduce", "dp"): (1, 1e9)}
    pred = _prediction(mesh=(("dp", 2), ("tp", 4)), comm=comm)
    t = step_time(pred, c)
    assert t.comm[("all_reduce", "tp")] == pytest.approx(2 * 1e-5 + 1e9 / 1e11)
    assert t.comm[("all_reduce", "dp")] == pytest.approx(1e-4 + 1e9 / 1e10)


def test_overlap_hides_overlappable_comm_up_to_the_compute():
    comm = {("all_reduce", "dp"): (1, 2e10), ("all_gather", "dp"): (1, 1e10)}  # 2 s and 1 s on the inter link
    exposed = step_time(_prediction(comm=comm, flops=1e12), _cluster())  # 2 s of compute
    hidden = step_time(_prediction(comm=comm, flops=1e12, overlapped={("all_reduce", "dp")}), _cluster())
    assert exposed.hidden == 0 and exposed.total == pytest.approx(2 + 3, rel=1e-3)
    assert hidden.hidden == pytest.approx(2, rel=1e-3) and hidden.total == pytest.approx(2 + 1, rel=1e-3)
    half = step_time(_prediction(comm=comm, flops=1e12, overlapped={("all_reduce", "dp")}), _cluster(overlap=0.25))
    assert half.hidden == pytest.approx(0.5)


def test_the_bubble_stretches_the_busy_time():
    t = step_time(_prediction(flops=1e12, bubble=0.2), _cluster())
    assert t.bubble == pytest.approx(2 * 0.2 / 0.8) and t.total == pytest.approx(2 / 0.8)


def test_shared_cores_serialize_the_ranks_and_absorb_the_bubble():
    cores = _cluster(nodes=1, per_node=8, cores=4.0)
    flat = step_time(_prediction(flops=1e12), cores)  # 8 ranks' work over 4 cores: twice the rank's
    assert flat.total == pytest.approx(4.0)
    piped = step_time(_prediction(flops=1e12, bubble=0.25), cores)  # idle ranks lend their cores
    assert piped.total == pytest.approx(4.0) and piped.bubble == 0
    starved = step_time(_prediction(flops=1e12, bubble=0.75), cores)  # 2 s / 0.25 = 8 s > 4 s shared
    assert starved.total == pytest.approx(8.0)


def test_data_axis_dtensor_ops_cost_their_own_overhead_and_default_to_the_model_parallel_one():
    pred = _prediction(flops=0.0, ops={"local": 0, "dtensor": 10, "dtensor_data": 100})
    assert step_time(pred, _cluster()).dispatch == pytest.approx(110 * 1e-4)  # None: dtensor_overhead
    assert step_time(pred, _cluster(data_dtensor_overhead=1e-5)).dispatch == pytest.approx(10 * 1e-4 + 100 * 1e-5)


def test_a_pipeline_on_shared_cores_shares_its_replicas_work_not_world_times_the_busiest_ranks():
    # pp2_dp2 on 2 cores: the busiest rank computes 2 s, a replica's two stages 3 s together (the head on one)
    cores = _cluster(nodes=1, per_node=4, cores=2.0)
    busiest = _prediction(mesh=(("pp", 2), ("dp", 2)), flops=1e12, bubble=0.2)
    replica = Work({"float32": 1.5e12}, {"float32": 10.0}, 0.0, 1.0, {"local": 0, "dtensor": 0})
    piped = dataclasses.replace(busiest, replica=replica)
    assert step_time(busiest, cores).total == pytest.approx(4 * 2 / 2)  # without it: every rank the busiest's
    assert step_time(piped, cores).total == pytest.approx(2 * 3 / 2)  # 2 replicas' work over 2 cores
    starved = dataclasses.replace(piped, bubble=0.6)  # the critical path: 2 s / 0.4 = 5 s > 3 s shared
    assert step_time(starved, cores).total == pytest.approx(5.0)


def test_small_matmuls_run_at_their_measured_rate():
    c = _cluster(matmul_curve={"float32": [(1e6, 1e9), (1e9, 1e11)]})
    assert c.matmul_rate("float32", 1e6) == pytest.approx(1e9)
    assert c.matmul_rate("float32", 10**7.5) == pytest.approx(1e10)  # log-log halfway
    assert c.matmul_rate("float32", 1e12) == pytest.approx(1e11)
    assert c.matmul_rate("float32") == pytest.approx(5e11)  # no size: the peak times the efficiency


def test_a_cluster_round_trips_its_plain_values_and_names_a_bad_field():
    c = _cluster(matmul_curve={"float32": [(1e6, 1e9)]})
    assert Cluster.from_dict(c.to_dict()) == c
    with pytest.raises(ValueError, match=r"unknown fields \['gpus'\].*Fix"):
        Cluster.from_dict(c.to_dict() | {"gpus": 8})
