"""Pipeline schedules: the papers' orders by hand, the checker against each kind of broken schedule, and the
bubble / in-flight invariants over every small (pp, microbatches) for every schedule ``build`` knows."""

import dataclasses
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardings.pipeline import schedule as registry
from shardings.pipeline.check import check
from shardings.pipeline.schedule import (
    DEFAULT_SCHEDULE,
    SCHEDULES,
    VIRTUAL_STAGES,
    Action,
    Schedule,
    ScheduleError,
    build,
    gpipe,
    one_f_one_b,
    register_schedule,
    stages_per_rank,
    timeline,
)
from tests.shardings.pipeline.cases import any_schedule, with_rank


def programs(schedule: Schedule, compute_only: bool = False) -> list[str]:
    """Each rank's program as a space-separated string of ``str(Action)``."""
    return [" ".join(str(a) for a in actions if not compute_only or a.kind in ("F", "B")) for actions in schedule.ranks]


def assert_dependencies_hold(schedule: Schedule) -> None:
    """In ``timeline``, one compute per slot per rank, and each F/B/W starts after the computes it consumes."""
    start = {a: t for row in timeline(schedule) for t, a in row}
    for row in timeline(schedule):
        assert [t for t, _ in row] == sorted({t for t, _ in row}), "one compute per slot per rank"
    for action, t in start.items():
        s, mb = action.stage, action.mb
        inputs = {"F": [Action("F", s - 1, mb)], "B": [Action("F", s, mb), Action("B", s + 1, mb)],
                  "W": [Action("B", s, mb)]}[action.kind]
        for dep in inputs:
            assert dep not in start or t >= start[dep] + 1, (action, dep)
    computes = 3 if schedule.split_backward else 2
    assert len(start) == computes * schedule.stages * schedule.microbatches


def test_action_str_is_compact_and_omits_the_stage():
    labels = [str(Action(kind, stage=3, mb=1)) for kind in ("F", "B", "SEND_F", "RECV_F", "SEND_B", "RECV_B")]
    assert labels == ["F1", "B1", "sF1", "rF1", "sB1", "rB1"]


def test_gpipe_runs_all_forwards_then_backwards_in_order_like_torch():
    assert programs(gpipe(2, 2)) == ["F0 sF0 F1 sF1 rB0 B0 rB1 B1", "rF0 F0 rF1 F1 B0 sB0 B1 sB1"]
    assert programs(gpipe(2, 3)) == [
        "F0 sF0 F1 sF1 F2 sF2 rB0 B0 rB1 B1 rB2 B2",
        "rF0 F0 rF1 F1 rF2 F2 B0 sB0 B1 sB1 B2 sB2",
    ]
    assert programs(gpipe(1, 2)) == ["F0 F1 B0 B1"]


def test_one_f_one_b_warms_up_then_alternates():
    assert programs(one_f_one_b(2, 3)) == [
        "F0 sF0 F1 sF1 rB0 B0 F2 sF2 rB1 B1 rB2 B2",
        "rF0 F0 B0 sB0 rF1 F1 B1 sB1 rF2 F2 B2 sB2",
    ]
    # PipeDream-Flush (Narayanan et al. 2021, fig. 4): rank r does pp - r - 1 warm-up forwards.
    assert programs(one_f_one_b(4, 4), compute_only=True) == [
        "F0 F1 F2 F3 B0 B1 B2 B3",
        "F0 F1 F2 B0 F3 B1 B2 B3",
        "F0 F1 B0 F2 B1 F3 B2 B3",
        "F0 B0 F1 B1 F2 B2 F3 B3",
    ]
    assert (
        programs(one_f_one_b(4, 4))[1] == "rF0 F0 sF0 rF1 F1 sF1 rF2 F2 sF2 rB0 B0 sB0 rF3 F3 sF3 rB1 B1 sB1 "
        "rB2 B2 sB2 rB3 B3 sB3"
    )
    # fewer microbatches than stages: warm-up is cut at m, so rank 0 is GPipe
    assert programs(one_f_one_b(4, 2), compute_only=True)[0] == "F0 F1 B0 B1"


def test_table_places_each_compute_at_its_unit_time_slot():
    expected = "gpipe: pp=2, microbatches=2, bubble 33.3%\nrank 0 | F0 F1 .  .  B0 B1\nrank 1 | .  F0 F1 B0 B1 ."
    assert gpipe(2, 2).table() == expected
    assert str(gpipe(2, 2)) == expected
    assert one_f_one_b(2, 3).table().splitlines()[1:] == [
        "rank 0 | F0 F1 .  B0 F2 B1 .  B2",
        "rank 1 | .  F0 B0 F1 B1 F2 B2 .",
    ]


@pytest.mark.parametrize(
    ("rank", "program", "message"),
    [
        (1, "rF0 F0 rF1 F1 B0 sB0", r"rank 1, action B1 \(B of stage 1, mb 1\): missing"),
        (1, "rF0 F0 rF1 B1 sB1 F1 B0 sB0", r"rank 1, action B1 .*: runs before its forward F1"),
        (0, "F0 sF0 F1 sF1 sF1 rB0 B0 rB1 B1", r"rank 0, action sF1 .*: duplicated \(positions 3 and 4\)"),
        (1, "rF0 F0 F1 B0 sB0 B1 sB1", r"rank 0, action sF1 .*: no matching rF1 \(RECV_F of stage 1\) on rank 1"),
        (0, "F0 sF0 F1 rB0 B0 rB1 B1", r"rank 1, action rF1 .*: no matching sF1 \(SEND_F of stage 0\) on rank 0"),
        (0, "F0 sF0 F1 sF1 rB0 B0 rB1 B1 sB1", r"rank 0, action sB1 .*: stage 0 has no neighbour stage -1"),
        (0, "F0 sF0 sF1 F1 rB0 B0 rB1 B1", r"rank 0, action sF1 .*: comes before F1. Fix: move it after F1"),
        (1, "rF0 F0 F1 rF1 B0 sB0 B1 sB1", r"rank 1, action rF1 .*: comes after F1. Fix: move it before F1"),
        (0, "F0 sF0 F1 sF1 rB0 B0 rB1 B1 F2", r"rank 0, action F2 .*: no microbatch 2 among 2"),
    ],
)
def test_check_names_the_rank_the_action_and_the_problem(rank, program, message):
    check(gpipe(2, 2))  # the unedited schedule passes
    with pytest.raises(ScheduleError, match=message):
        check(with_rank(gpipe(2, 2), rank, program))


def test_check_requires_both_ends_of_a_communication():
    # neither sF1 nor rF1: nothing is unpaired, but stage 0's F1 goes nowhere and stage 1's F1 has no input
    broken = with_rank(with_rank(gpipe(2, 2), 0, "F0 sF0 F1 rB0 B0 rB1 B1"), 1, "rF0 F0 F1 B0 sB0 B1 sB1")
    with pytest.raises(ScheduleError, match=r"rank 0, action F1 .*: has no SEND_F \(sF1\). Fix: add sF1 after F1"):
        check(broken)
    broken = with_rank(broken, 0, "F0 sF0 F1 sF1 rB0 B0 rB1 B1")  # now rF1 is missing only: an unpaired send
    with_receive = with_rank(broken, 1, "rF0 F0 rF1 F1 B0 sB0 B1 sB1")
    check(with_receive)
    without_backward_receive = with_rank(with_receive, 0, "F0 sF0 F1 sF1 rB0 B0 B1")
    with pytest.raises(ScheduleError, match=r"rank 1, action sB1 .*: no matching rB1"):
        check(without_backward_receive)


def test_check_finds_a_deadlock_and_names_every_stuck_rank():
    # both ranks receive before they send: rank 0 waits for a gradient of a forward rank 1 never got
    broken = with_rank(gpipe(2, 1), 0, "rB0 F0 sF0 B0")
    with pytest.raises(
        ScheduleError,
        match=re.escape(
            "deadlock, no rank can progress: rank 0 waits at rB0 (needs sB0 from stage 1 on rank 1); "
            "rank 1 waits at rF0 (needs sF0 from stage 0 on rank 0). Fix:"
        ),
    ):
        check(broken)
    with pytest.raises(ScheduleError, match="deadlock"):
        broken.table()


def test_check_rejects_a_stage_on_the_wrong_rank():
    broken = with_rank(gpipe(2, 1), 1, "rF0 F0 B0 sB0", stage=0)
    with pytest.raises(
        ScheduleError,
        match=r"rank 1, action rF0 \(RECV_F of stage 0, mb 0\): wrong rank: stage 0 "
        r"runs on rank 0. Fix: move it to rank 0",
    ):
        check(broken)


def test_check_rejects_a_malformed_schedule():
    with pytest.raises(ScheduleError, match=r"1 rank programs for pp=2"):
        check(dataclasses.replace(gpipe(2, 1), ranks=gpipe(2, 1).ranks[:1]))
    with pytest.raises(ScheduleError, match=r"action X0 .*: unknown kind"):
        check(dataclasses.replace(gpipe(1, 1), ranks=((Action("X", 0, 0),),)))


def test_build_names_the_known_schedules_and_rejects_bad_sizes():
    assert programs(build("1f1b", 3, 5)) == programs(one_f_one_b(3, 5))
    with pytest.raises(
        ScheduleError,
        match=re.escape("unknown pipeline schedule 'zb'. Fix: use one of ['1f1b', 'gpipe', 'interleaved_1f1b', "
                        "'zb_h1', 'zb_v']"),
    ):
        build("zb", 2, 2)
    for name in SCHEDULES:
        with pytest.raises(ValueError, match=r"pp=0. Fix: pass an integer pp >= 1"):
            build(name, 0, 4)
        with pytest.raises(ValueError, match=r"microbatches=0. Fix: pass an integer microbatches >= 1"):
            build(name, 2, 0)


@pytest.fixture
def own_registry(monkeypatch):
    """Register into copies of the schedule registry, restored after the test (SCHEDULES views the live one)."""
    monkeypatch.setattr(registry, "_BUILDERS", dict(registry._BUILDERS))
    monkeypatch.setattr(registry, "_STAGES_PER_RANK", dict(registry._STAGES_PER_RANK))


def test_a_schedule_declares_itself_where_it_is_defined(own_registry):
    """Adding a schedule is its builder and one register_schedule: build, the checks of virtual_stages and the
    error listing the names all follow from the registry."""
    @register_schedule("gpipe_v2", stages_per_rank=2)
    def gpipe_v2(pp: int, microbatches: int) -> Schedule:
        # gpipe over two chunks per rank, placed round robin (stage s on rank s % pp)
        stages = 2 * pp
        computes = [[Action("F", s, mb) for s in (r, r + pp) for mb in range(microbatches)]
                    + [Action("B", s, mb) for s in (r + pp, r) for mb in range(microbatches)] for r in range(pp)]
        return Schedule("gpipe_v2", pp, microbatches, tuple(registry.program(c, stages) for c in computes), 2)

    schedule = build("gpipe_v2", 2, 2)
    check(schedule)
    assert schedule.stages == 4 and stages_per_rank("gpipe_v2") == 2
    with pytest.raises(ScheduleError, match=r"'gpipe_v2' runs 2 stage\(s\) per rank.*use interleaved_1f1b"):
        build("gpipe_v2", 2, 2, virtual_stages=3)
    with pytest.raises(ScheduleError, match=r"use one of \[.*'gpipe_v2'"):
        build("gpipe_v3", 2, 2)


def test_the_registry_holds_each_builtin_schedule_once_with_its_stages_per_rank():
    builtin = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": None, "zb_h1": 1, "zb_v": 2}
    assert {name: VIRTUAL_STAGES[name] for name in builtin} == builtin  # (docs/pipeline.md registers one more)
    assert SCHEDULES[DEFAULT_SCHEDULE] is one_f_one_b and DEFAULT_SCHEDULE == "1f1b"
    assert stages_per_rank("interleaved_1f1b") == registry.DEFAULT_VIRTUAL_STAGES == 2
    with pytest.raises(TypeError):
        SCHEDULES["mine"] = gpipe  # a read-only view: register_schedule is the one way in


sizes = st.tuples(st.integers(1, 6), st.integers(1, 12))


@given(sizes)
def test_both_schedules_check_and_have_the_textbook_bubble(size):
    pp, m = size
    for name in ("gpipe", "1f1b"):
        schedule = build(name, pp, m)
        check(schedule)
        # both sides are the correctly rounded float of the same rational, so == is exact
        assert schedule.bubble() == (pp - 1) / (m + pp - 1), name
    assert one_f_one_b(pp, m).peak_in_flight() == tuple(min(pp - r, m) for r in range(pp))
    assert gpipe(pp, m).peak_in_flight()[0] == m


@given(st.data())
def test_timeline_respects_every_dependency(data):
    schedule = any_schedule(data)
    check(schedule)
    assert_dependencies_hold(schedule)


@given(st.data())
def test_dropping_any_action_is_caught(data):
    schedule = any_schedule(data)
    rank = data.draw(st.integers(0, schedule.pp - 1))
    drop = data.draw(st.integers(0, len(schedule.ranks[rank]) - 1))
    ranks = list(schedule.ranks)
    ranks[rank] = ranks[rank][:drop] + ranks[rank][drop + 1 :]
    with pytest.raises(ScheduleError, match=r"rank \d"):
        check(dataclasses.replace(schedule, ranks=tuple(ranks)))


@given(st.data())
def test_swapping_neighbours_either_passes_or_is_rejected_cleanly(data):
    schedule = any_schedule(data)
    rank = data.draw(st.integers(0, schedule.pp - 1))
    actions = list(schedule.ranks[rank])
    if len(actions) < 2:
        return
    i = data.draw(st.integers(0, len(actions) - 2))
    actions[i], actions[i + 1] = actions[i + 1], actions[i]
    swapped = dataclasses.replace(schedule, ranks=(*schedule.ranks[:rank], tuple(actions), *schedule.ranks[rank + 1 :]))
    try:
        check(swapped)
    except ScheduleError:
        return
    assert_dependencies_hold(swapped)  # a swap the checker lets through still runs in dependency order
