"""What a pipeline rank may free and when: a send proven delivered by a later receive (delivery.py), checked
against happens-before built independently; the real wire holds no more messages than ``sends_held`` says; and a
zero-bubble step leaves nothing of its graphs behind."""

import gc

from hypothesis import given
from hypothesis import strategies as st

import core
import models
import shardings
from shardings import pipeline
from shardings.pipeline.delivery import delivered_by, sends_held
from shardings.pipeline.saved_activations import _Held
from shardings.pipeline.schedule import Action, build, one_f_one_b
from shardings.pipeline.wire import Wire
from tests.shardings.pipeline.cases import any_schedule

GPT = models.gpt.Config(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, seq_len=8, mlp=64)


def _happens_before(schedule):
    """(rank, index) -> every (rank, index) that ran before it: program order, and each send before its receive."""
    where = {(r, a): i for r, actions in enumerate(schedule.ranks) for i, a in enumerate(actions)}
    before: dict[tuple[int, int], set[tuple[int, int]]] = {}

    def of(r, i):
        if (r, i) not in before:
            preds = {(r, i - 1)} if i else set()
            a = schedule.ranks[r][i]
            if a.kind.startswith("RECV_"):
                kind = a.kind.removeprefix("RECV_")
                sender = Action(f"SEND_{kind}", a.stage + (-1 if kind == "F" else 1), a.mb)
                q = schedule.rank_of(sender.stage)
                preds.add((q, where[q, sender]))
            before[r, i] = set(preds).union(*(of(*p) for p in preds))
        return before[r, i]

    return where, of


@given(st.data())
def test_a_send_is_released_only_once_its_receive_happened_before(data):
    schedule = any_schedule(data)
    where, before = _happens_before(schedule)
    for rank in range(schedule.pp):
        released = []
        for recv, sends in delivered_by(schedule, rank).items():
            at = where[rank, recv]
            for send in sends:
                kind = send.kind.removeprefix("SEND_")
                receive = Action(f"RECV_{kind}", send.stage + (1 if kind == "F" else -1), send.mb)
                q = schedule.rank_of(receive.stage)
                assert q != rank and where[rank, send] < at
                assert (q, where[q, receive]) in before(rank, at), (schedule.name, rank, recv, send)
                released.append(send)
        assert len(released) == len(set(released))  # each at most once


def test_a_rank_holds_a_few_messages_not_the_steps():
    assert sends_held(one_f_one_b(2, 4)) == (2, 2)
    for name, v in (("1f1b", None), ("interleaved_1f1b", 2), ("zb_v", None)):
        s = build(name, 4, 32, virtual_stages=v)
        sent = [sum(a.kind.startswith("SEND_") for a in actions) for actions in s.ranks]
        assert all(held <= total / 4 for held, total in zip(sends_held(s), sent)), (name, sends_held(s), sent)


def _most_in_flight(name: str, m: int) -> int:
    """On a real process of a pp=2 pipeline: the most sends its wire held at once during a step."""
    most = [0]
    send = Wire.send

    def counting(self, *args):
        send(self, *args)
        most[0] = max(most[0], len(self.sends))

    Wire.send = counting
    try:
        mesh = shardings.Mesh({"pp": 2})
        params = shardings.init(models.gpt.init, core.random.key(0), GPT, axes=models.gpt.axes(GPT),
                                layout="pp", mesh=mesh, schedule=name)
        step = shardings.train_step(models.gpt.stages(GPT), core.optim.sgd(0.1), layout="pp", mesh=mesh,
                                    plan=shardings.pipeline.plan("pp", mesh, params, microbatches=m, schedule=name))
        step(params, step.init(params), models.gpt.example_batch(GPT, m))
    finally:
        Wire.send = send
    return most[0]


def test_the_wire_frees_a_send_once_a_message_proves_it_delivered():
    m = 8
    for name in ("1f1b", "zb_h1"):
        held = shardings.launch(_most_in_flight, 2, name, m)
        assert tuple(held) == sends_held(build(name, 2, m)) and max(held) < m, (name, held)


def test_a_zero_bubble_step_leaves_none_of_its_graphs_behind():
    """B keeps the graph W needs (retain_graph); a saved output held with its own node was a reference cycle
    through autograd's C++ graph that gc cannot collect, so each step's graph leaked."""
    params = models.gpt.init(core.random.key(0), GPT)
    batch = models.gpt.example_batch(GPT, 4)
    mbs = [{k: v.chunk(2)[i].clone() for k, v in batch.items()} for i in range(2)]
    result = pipeline.run(build("zb_h1", 2, 2), models.gpt.stages(GPT), pipeline.split(params, 2), params, mbs,
                          [0.5, 0.5])
    assert result.saved_peak[0] > 0
    del result
    gc.collect()
    assert not [o for o in gc.get_objects() if type(o) is _Held]
