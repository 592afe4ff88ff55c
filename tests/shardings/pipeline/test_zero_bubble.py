"""Zero-bubble schedules: ZB-H1's bubble is about a third of 1F1B's at its peak memory, ZB-V's V placement and
smaller bubble; the checker on split backwards (W before B, a missing W, W on the wrong rank, bad placements)."""

import dataclasses
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardings.pipeline.check import check
from shardings.pipeline.schedule import Action, ScheduleError, gpipe, one_f_one_b
from shardings.pipeline.zero_bubble import zb_h1, zb_v
from tests.shardings.pipeline.cases import split_after_b, with_rank


@given(pp=st.integers(1, 6), m=st.integers(1, 16))
def test_zb_h1_has_a_third_of_1f1bs_bubble_at_its_peak_memory(pp, m):
    schedule = zb_h1(pp, m)
    check(schedule)
    assert schedule.split_backward and schedule.placement == tuple(range(pp))
    assert max(schedule.peak_in_flight()) == max(one_f_one_b(pp, m).peak_in_flight())  # 1F1B's rank 0
    assert schedule.bubble() <= one_f_one_b(pp, m).bubble()
    if m >= pp:  # (p - 1)(F + B - W) idle per rank against 1F1B's (p - 1)(F + B + W): a third
        assert schedule.bubble() == (pp - 1) / (3 * m + pp - 1)
    # F and B keep 1F1B's order
    assert [[a for a in r if a.kind in "FB"] for r in schedule.ranks] == [
        [a for a in r if a.kind in "FB"] for r in one_f_one_b(pp, m).ranks]


def test_zb_h1_by_hand():
    assert zb_h1(4, 8).table().splitlines()[1:] == [
        "rank 0 | F0 F1 F2 F3 .  .  .  B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7",
        "rank 1 | .  F0 F1 F2 .  .  B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 F6 B4 W3 F7 B5 W4 B6 W5 B7 W6 W7",
        "rank 2 | .  .  F0 F1 .  B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 F6 B5 W3 F7 B6 W4 B7 W5 W6 W7",
        "rank 3 | .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7",
    ]


@given(pp=st.integers(1, 6), m=st.integers(1, 16))
def test_zb_v_places_a_v_and_beats_zb_h1(pp, m):
    schedule = zb_v(pp, m)
    check(schedule)
    assert schedule.placement == (*range(pp), *range(pp - 1, -1, -1))  # rank r: stages r and 2 pp - 1 - r
    assert max(schedule.peak_in_flight()) <= 2 * pp  # half-size chunks: 1F1B's pp microbatches
    if m >= 2 * pp:
        assert schedule.bubble() < zb_h1(pp, m).bubble() or pp == 1


def test_zb_v_sends_nothing_across_the_turn_of_the_v():
    from shardings.pipeline.execute import _Mailbox
    box = _Mailbox(zb_v(2, 1))
    box.send("F", 1, 0, None)  # stage 1 -> 2, both on rank 1
    box.send("F", 0, 0, None)  # stage 0 -> 1: rank 0 -> rank 1
    assert [(m.kind, m.stage) for m in box.p2p] == [("F", 0)] and box.ready("F", 2, 0)


@pytest.mark.parametrize(
    ("rank", "program", "message"),
    [
        (1, "rF0 F0 W0 B0 sB0 W1 rF1 F1 B1 sB1",
         r"rank 1, action W0 \(W of stage 1, mb 0\): runs before its input-gradient backward B0. Fix: place W0 "
         r"after B0"),
        (1, "rF0 F0 B0 sB0 rF1 F1 B1 sB1 W1",
         r"rank 1, action W0 \(W of stage 1, mb 0\): missing. Fix: this schedule splits the backward \(it has W "
         r"actions\), so every B needs its W: add W0 of stage 1 after B0, or drop every W"),
    ],
)
def test_check_rejects_a_bad_split_backward(rank, program, message):
    split = split_after_b(gpipe(2, 2))
    check(split)
    with pytest.raises(ScheduleError, match=message):
        check(with_rank(split, rank, program))


def test_check_rejects_a_w_on_the_wrong_rank_and_bad_placements():
    split = split_after_b(gpipe(2, 1))
    ranks = (split.ranks[0] + (Action("W", 1, 0),), tuple(a for a in split.ranks[1] if a.kind != "W"))
    with pytest.raises(ScheduleError, match=re.escape("rank 0, action W0 (W of stage 1, mb 0): wrong rank: stage 1 "
                                                      "runs on rank 1. Fix: move it to rank 1 (rank = stage % pp)")):
        check(dataclasses.replace(split, ranks=ranks))
    v = zb_v(2, 2)
    with pytest.raises(ScheduleError, match=r"placement \(0, 1, 1, 1\) .* each rank 2 times"):
        check(dataclasses.replace(v, placement=(0, 1, 1, 1)))
    wrong = dataclasses.replace(v, placement=(0, 1, 0, 1))
    with pytest.raises(ScheduleError, match=r"rank 0, action rF0 .*: wrong rank: stage 3 runs on rank 1. Fix: move "
                                            r"it to rank 1 \(the schedule's placement \(0, 1, 0, 1\)\)"):
        check(wrong)


@pytest.mark.parametrize(("pp", "m"), [(1, 3), (2, 4), (3, 2), (4, 8), (4, 16), (5, 7)])
def test_zb_v_runs_torchs_order(pp, m):
    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble
    torch_zbv = object.__new__(ScheduleZBVZeroBubble)  # its order needs no stages: pp, m and the stage count
    torch_zbv.pp_group_size, torch_zbv._n_microbatches, torch_zbv.num_stages = pp, m, 2 * pp
    kinds = {"FORWARD": "F", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W"}
    for r, actions in enumerate(zb_v(pp, m).ranks):
        theirs = [Action(kinds[a.computation_type.name], a.stage_index, a.microbatch_index)
                  for a in torch_zbv._calculate_single_rank_operations(r) if a is not None]
        assert [a for a in actions if a.kind in ("F", "B", "W")] == theirs
