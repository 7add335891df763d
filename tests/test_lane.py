"""The relay's fast lane (server/lane.py, server/lane.c): a relay with the lane must answer
every request exactly as the Python relay does (bytes, refusals, replays, state, replay
records), whatever mix of frames comes, while taking the common requests itself.  On CPU
the lane steps through its Python engine over the reference backend; the CUDA engine is
tested against the Python relay on the GPU (tests/test_cuda.py)."""

from __future__ import annotations

import ctypes
import random
import socket
import threading
import time
from unittest import mock

import grpc
import numpy as np
import pytest

from duelq.client.client import encode_batch_wire
from duelq.server import native
from duelq.server.batch import Batch
from duelq.server.idempotency import ReplayGuard
from duelq.server import lane as lane_module
from duelq.server.lane import Lane, LaneOutcome
from duelq.server.learner import Learner, StepResult
from duelq.server.native import LaneEngine
from duelq.server.packing import Packer
from duelq.server.relay import _FRAME, END, PACKED, REQ, RelayFront, RelayLearner, SlotPool
from duelq.server.service import (REPLAY_KINDS, LearnerService, Limits, encoded_train_response,
                                  refusal)
from duelq.v1 import learner_pb2 as pb

from conftest import SMALL, random_batch

LIMITS = Limits(max_message_bytes=1 << 24, max_batch_size=64, max_streams=16)


def _service(state=None) -> LearnerService:
    service = LearnerService(LIMITS, replay=ReplayGuard(capacity=64, window=64))
    service.attach(Learner(SMALL, backend="reference", state=state,
                           max_batch_size=LIMITS.max_batch_size))
    return service


class Relay:
    """A started RelayLearner over ``service`` (with a lane of engine ``lane``, or none) and
    the RelayFronts of ``fronts`` front processes, over socket pairs and slot pools (8 of
    ``slot_bytes`` each, page-locked where the backend does so)."""

    def __init__(self, service: LearnerService, *, lane: str | None, fronts: int = 2,
                 slot_bytes: int = 1 << 14):
        self.lane = Lane(service, engine=lane) if lane else None
        self.relayed: list[int] = []
        pools = [SlotPool(8, slot_bytes) for _ in range(fronts)]
        self._backend, self._pools = service.learner.backend, pools
        for pool in pools:
            self._backend.register_host(pool.bytes)
        ends = [socket.socketpair() for _ in range(fronts)]

        def apply(job, call):
            return service.apply_train(job, call, encoded=True).SerializeToString()

        self.learner = RelayLearner(
            ends[0][0], pools[0], service.relay_prepare, apply,
            lambda exc, unary: refusal(exc, "TrainStream", "test"),
            open_stream=service.open_stream, close_stream=service.close_stream,
            prepare_packed=service.relay_prepare_packed, relayed=self.relayed.append,
            lane=self.lane)
        self.learner.start()
        for (mine, _), pool in zip(ends[1:], pools[1:]):
            self.learner.attach(mine, pool)
        self.fronts = [RelayFront(theirs, pool, Packer().pack)
                       for (_, theirs), pool in zip(ends, pools)]

    def attach(self) -> None:
        """One more front, attached while the relay runs."""
        mine, theirs = socket.socketpair()
        pool = SlotPool(8, self._pools[0].size)
        self._backend.register_host(pool.bytes)
        self._pools.append(pool)
        self.learner.attach(mine, pool)
        self.fronts.append(RelayFront(theirs, pool, Packer().pack))

    def run(self, front: int, requests: list[bytes], *, unary: bool = False,
            deadline: float | None = None) -> list[tuple[grpc.StatusCode, bytes]]:
        """One stream of ``requests`` on ``front``, all sent before the answers are read."""
        stream = self.fronts[front].open(unary=unary, deadline=deadline)
        for data in requests:
            assert stream.submit(data)
        stream.done_sending()
        answers: list = []
        reader = threading.Thread(target=lambda: answers.extend(stream.replies()), daemon=True)
        reader.start()
        reader.join(30)   # without its answers, the test fails instead of hanging
        stream.close()
        return answers

    def close(self) -> None:
        for front in self.fronts:
            front.close()
        self.learner.close()
        assert not self.learner.thread.is_alive(), "the relay did not end"
        if self.lane is not None:
            self.lane.close()
        if hasattr(self._backend, "unregister_host"):   # cuda's page-locked pools
            for pool in self._pools:
                self._backend.unregister_host(pool.bytes)


def _request(rng, rows: int = 8, actor: str = "", seq: int = 0, wire: str = "float32",
             batch: Batch | None = None) -> bytes:
    return encode_batch_wire(batch if batch is not None else random_batch(rng, rows),
                             feature_dtype=wire, actor_id=actor, seq=seq)


def _nan(rng) -> Batch:
    batch = random_batch(rng, 8)
    batch.rewards[2] = np.nan
    return batch


def _script(rng) -> list[tuple[int, list[bytes], dict]]:
    """(front, requests, open's arguments) of each stream, run one after the other: the
    common requests, and among them every kind the lane hands back."""
    keyed = [_request(rng, actor="a", seq=s) for s in range(1, 6)]
    return [
        (0, keyed[:3], {}),                                    # a new actor, then known
        (1, [_request(rng), _request(rng, rows=12), _request(rng)], {}),   # no key; a shape
        (0, [keyed[3], keyed[1], keyed[4]], {}),               # a repeat among new keys
        (1, [_request(rng, actor="b", seq=1)], {"unary": True}),
        (0, [_request(rng, actor="c", seq=s, wire="bfloat16") for s in (1, 2)], {}),
        (1, [_request(rng, actor="d", seq=1), _request(rng, batch=_nan(rng), actor="d", seq=2),
             _request(rng, actor="d", seq=3)], {}),           # refused, then not applied
        (0, [_request(rng, actor="a", seq=9),
             _request(rng, rows=LIMITS.max_batch_size + 1), _request(rng, actor="a", seq=10)],
         {}),                                                  # B over the limit
        (1, [_request(rng, actor="e", seq=1)], {"deadline": time.monotonic() - 1}),
        (0, [_request(rng, actor="a", seq=s) for s in range(11, 31)], {}),
    ]


def test_a_relay_with_the_lane_answers_as_the_python_relay_does():
    answers, states, guards, relays = [], [], [], []
    initial = _service().learner.snapshot()
    for lane in (False, True):
        service = _service(initial)
        relay = Relay(service, lane="python" if lane else None)
        rng = np.random.default_rng(11)
        try:
            answers.append([relay.run(front, requests, **opened)
                            for front, requests, opened in _script(rng)])
        finally:
            relay.close()
        states.append(service.learner.snapshot())
        guards.append(service.snapshot()[1]["replay"])
        relays.append(relay)
    plain, laned = answers
    for got, want in zip(laned, plain):
        assert [code for code, _ in got] == [code for code, _ in want]
        for (code, payload), (_, expected) in zip(got, want):
            if code == grpc.StatusCode.OK:   # the same bytes, replays included
                assert payload == expected
            else:   # refusals name a reference only for INTERNAL, which none is
                assert payload == expected, payload
    codes = [code for stream in plain for code, _ in stream]
    assert codes.count(grpc.StatusCode.OK) == 34   # 33 steps and a replay
    assert {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
            grpc.StatusCode.DEADLINE_EXCEEDED} <= set(codes)
    assert pb.TrainResponse.FromString(plain[2][1][1]).replayed
    np.testing.assert_array_equal(states[0].params.w_v, states[1].params.w_v)
    np.testing.assert_array_equal(states[0].isv, states[1].isv)
    assert states[0].step == states[1].step == 33
    assert guards[0] == guards[1]
    lane = relays[1].lane
    assert lane.answers >= 1 and lane.handovers >= 8, (lane.answers, lane.handovers)
    assert len(relays[1].relayed) == len(relays[0].relayed) == sum(map(len, plain))


def _eventually(check, timeout: float = 5.0) -> None:
    """Wait for ``check()`` (the lane counts its answers when its pump returns)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "never came true"
        time.sleep(0.002)


def test_the_lane_takes_the_steady_state_and_hands_back_the_rest():
    """After a stream's OPEN and its actor's first key (handed back), the lane answers
    every request of a known actor; a key it cannot judge (a repeat) and a frame of another
    kind (a small rpc) go back to the relay, and the lane takes over again after them."""
    service = _service()
    relay = Relay(service, lane="python", fronts=1)
    rng = np.random.default_rng(13)
    lane = relay.lane
    try:
        stream = relay.fronts[0].open(unary=False, deadline=None)
        replies = stream.replies()

        def one(seq: int) -> tuple[grpc.StatusCode, bytes]:
            assert stream.submit(_request(rng, actor="s", seq=seq))
            return next(replies)
        assert one(1)[0] == grpc.StatusCode.OK
        before = lane.answers, lane.handovers
        assert all(one(seq)[0] == grpc.StatusCode.OK for seq in range(2, 12))
        _eventually(lambda: (lane.answers, lane.handovers) == (before[0] + 10, before[1]))
        code, payload = one(5)   # a repeat: replayed by the relay
        assert code == grpc.StatusCode.OK and pb.TrainResponse.FromString(payload).replayed
        _eventually(lambda: lane.handovers == before[1] + 1)
        assert relay.fronts[0].call(0, b"", None)[0] != grpc.StatusCode.OK   # no small rpcs
        _eventually(lambda: lane.handovers == before[1] + 2)
        assert all(one(seq)[0] == grpc.StatusCode.OK for seq in range(12, 17))
        _eventually(lambda: lane.answers == before[0] + 15)
        assert service.learner.step_count == 16
        stream.done_sending()
        assert list(replies) == []
        stream.close()
    finally:
        relay.close()


def test_a_stream_closed_with_requests_queued_gives_every_slot_back():
    """A stream closed by its front while its requests wait: each is answered once (its
    slot comes back) whether stepped or not, the stream is finished, and those applied are
    recorded under their keys."""
    service = _service()
    relay = Relay(service, lane="python", fronts=1)
    rng = np.random.default_rng(12)
    front = relay.fronts[0]
    try:
        relay.run(0, [_request(rng, actor="z", seq=1)])   # the lane knows z now
        stream = front.open(unary=False, deadline=None)
        for seq in range(2, 8):
            stream.submit(_request(rng, actor="z", seq=seq))
        stream.close()   # END while they wait: the rest only give their slots back
        _eventually(lambda: front._free.qsize() == 8 and not relay.learner._streams)
        steps = service.learner.step_count
        assert 1 <= steps <= 7 and service.learner.backend.step == steps
        guard = ReplayGuard.from_bytes(service.snapshot()[1]["replay"], REPLAY_KINDS)
        assert guard.high("z") == steps
        assert relay.run(0, [_request(rng, actor="z", seq=20)])[0][0] == grpc.StatusCode.OK
        assert service.learner.step_count == steps + 1
    finally:
        relay.close()


def test_an_end_read_after_a_requests_copy_stops_its_step(monkeypatch):
    """An END that the lane reads between a request's copy and its step: the request is
    answered CANCELLED and not applied, as the relay's own loop does."""
    end: dict = {}

    class EndingEngine(lane_module._PythonEngine):   # the copy sends the stream's END
        def __init__(self, learner):
            super().__init__(learner)
            self._ending_copy = lane_module._COPY(self._copy)
            self.struct.copy = self._ending_copy

        def _copy(self, ctx, upload, src, nbytes) -> int:
            send = end.pop("send", None)
            if send is not None:
                send()
            return 0
    monkeypatch.setattr(lane_module, "_PythonEngine", EndingEngine)
    service = _service()
    relay = Relay(service, lane="python", fronts=1)
    rng = np.random.default_rng(14)
    front = relay.fronts[0]
    try:
        for stepped in range(1, 5):   # more times than there are upload slots
            stream = front.open(unary=False, deadline=None)
            replies = stream.replies()
            assert stream.submit(_request(rng)) and next(replies)[0] == grpc.StatusCode.OK
            end["send"] = lambda: front._send(_FRAME.pack(END, stream.sid, 0, 0, 0.0))
            assert stream.submit(_request(rng))
            assert next(replies) == (grpc.StatusCode.CANCELLED, b"the call ended before this "
                                     b"request started; it was not applied")
            assert not end and service.learner.step_count == stepped   # copied, not stepped
            stream.close()
        answers = relay.lane.answers   # each upload slot came back: the lane answers on
        assert relay.run(0, [_request(rng) for _ in range(6)]) == [(grpc.StatusCode.OK,
                                                                    mock.ANY)] * 6
        _eventually(lambda: relay.lane.answers >= answers + 5)
    finally:
        relay.close()


def test_the_lane_applies_nothing_once_the_service_drains():
    """A lane's turn that starts as drain() runs: whichever takes the apply lock first,
    the turn finds the service draining and applies nothing (drain() then returns with
    nothing left to apply)."""
    service = _service()
    turns: list = []
    service._apply_lock.acquire()   # the turn and drain() both wait for it
    try:
        def take_turn() -> None:
            with service.lane_turn() as got:
                turns.append(got)
        turn = threading.Thread(target=take_turn)
        turn.start()
        time.sleep(0.05)   # past its check for a learner, waiting for the lock
        drain = threading.Thread(target=service.drain)
        drain.start()
        _eventually(lambda: service._draining)
    finally:
        service._apply_lock.release()
    turn.join(5)
    drain.join(5)
    assert turns == [None] and not drain.is_alive()
    with service.lane_turn() as later:
        assert later is None


def test_a_snapshot_waits_for_at_most_one_more_lane_turn():
    """Lane turns back to back (each holding the apply lock 5 ms, as a pump): a snapshot
    that asks for the lock has it within the next turn or two, not after many (the turn
    lets threads already waiting for the lock go first)."""
    service = _service()
    turns, stop = [0], threading.Event()

    def lane() -> None:
        while not stop.is_set():
            with service.lane_turn():
                turns[0] += 1
                start = time.perf_counter()
                while time.perf_counter() - start < 0.005:   # busy, as a pump
                    pass
    thread = threading.Thread(target=lane)
    thread.start()
    try:
        waited = []
        for _ in range(10):
            before = turns[0]
            service.snapshot()
            waited.append(turns[0] - before)
            time.sleep(0.003)
    finally:
        stop.set()
        thread.join(5)
    assert max(waited) <= 2, waited


def test_an_end_behind_a_request_left_for_the_lane_still_stops_the_ones_before():
    """Frames read together after a hand-back: an unpacked request (the relay's), a packed
    one (left for the lane) and the stream's END.  The relay acts on the END though a
    request stands before it, so neither request is applied, as without the lane."""
    got = []
    for lane in (None, "python"):
        service = _service()
        relay = Relay(service, lane=lane, fronts=1)
        rng = np.random.default_rng(15)
        front = relay.fronts[0]
        try:
            stream = front.open(unary=False, deadline=None)
            replies = stream.replies()
            assert stream.submit(_request(rng)) and next(replies)[0] == grpc.StatusCode.OK
            unpacked, packed = _request(rng, actor="q", seq=1), _request(rng)
            front.slots.write(1, unpacked)
            descriptor = Packer().pack(packed, front.slots.array(2), front.slots.address(2))
            for slot in (1, 2):   # taken from the front's free slots, as submit does
                front._free.get_nowait()
            front._send(_FRAME.pack(REQ, stream.sid, 1, len(unpacked), 0.0)
                        + _FRAME.pack(PACKED, stream.sid, 2, len(descriptor), 0.0)
                        + descriptor + _FRAME.pack(END, stream.sid, 0, 0, 0.0))
            got.append([next(replies)[0], next(replies)[0], service.learner.step_count])
        finally:
            relay.close()
    assert got[0] == got[1] == [grpc.StatusCode.CANCELLED] * 2 + [1]


@pytest.mark.parametrize("seed", [1, 2])
def test_concurrent_streams_through_the_lane_are_answered_once_in_order(seed):
    """Randomised: 3 fronts × 4 keyed streams at once (the third front attaches while the
    others stream), some ending midway.  A stream that finishes gets every answer, in order
    (its keys echoed in turn); one that ends midway has a prefix applied; nothing is
    applied twice (the steps are the keys applied) and every slot comes back."""
    service = _service()
    relay = Relay(service, lane="python", fronts=2)
    plan = random.Random(seed)
    rng = np.random.default_rng(seed)
    bodies = [random_batch(rng, 8) for _ in range(4)]
    streams = [(f, s, plan.choice([None, plan.randrange(1, 30)]))   # None: all 30 sent
               for f in range(3) for s in range(4)]
    answers: dict = {}

    def run(f: int, s: int, end_after: int | None) -> None:
        stream = relay.fronts[f].open(unary=False, deadline=None)
        for i in range(30 if end_after is None else end_after):
            assert stream.submit(_request(rng, batch=bodies[i % 4], actor=f"f{f}s{s}",
                                          seq=i + 1))
        if end_after is None:
            stream.done_sending()
            answers[f, s] = list(stream.replies())
        stream.close()
    threads = [threading.Thread(target=run, args=args) for args in streams]
    try:
        for thread in threads[:8]:
            thread.start()
        relay.attach()
        for thread in threads[8:]:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert not any(thread.is_alive() for thread in threads)
        _eventually(lambda: all(front._free.qsize() == 8 for front in relay.fronts)
                    and not relay.learner._streams)
        guard = ReplayGuard.from_bytes(service.snapshot()[1]["replay"], REPLAY_KINDS)
        for f, s, end_after in streams:
            applied = guard.high(f"f{f}s{s}")
            if end_after is None:
                assert applied == 30
                assert [code for code, _ in answers[f, s]] == [grpc.StatusCode.OK] * 30
                assert [pb.TrainResponse.FromString(p).key.seq
                        for _, p in answers[f, s]] == list(range(1, 31))
            else:
                assert applied <= end_after
        assert service.learner.step_count == sum(guard.high(f"f{f}s{s}")
                                                 for f, s, _ in streams)
        assert relay.lane.answers > service.learner.step_count // 2, relay.lane.answers
    finally:
        relay.close()


@pytest.mark.parametrize("rows", [1, 7, 128, 1024])
def test_the_lanes_answer_bytes_are_the_services(rows):
    """lane.c's encoder gives encoded_train_response's bytes: zeros left out, -0.0, large
    steps, entropy present at 0 or absent, keys of every size."""
    lib = native.load(cuda=False).lane
    rng = np.random.default_rng(rows)
    cases = [(0.0, -0.0, 0.0, 0, None, b""), (1.5, 2.0, 3.0, 1, 0.0, b"\x0a\x01a\x10\x01"),
             (-1e300, float("inf"), 7.0, 2**63 + 5, 1.25, b"\x0a\x80\x01" + b"x" * 128),
             (float(rng.normal()), float(rng.normal()), 1e-9, 300, -0.0, b"\x10\x07")]
    for loss, q, norm, step, entropy, key in cases:
        td, priorities = (rng.normal(size=rows).astype(np.float32) for _ in range(2))
        outcome = LaneOutcome(loss=loss, q_mean=q, grad_norm=norm,
                              entropy=0.0 if entropy is None else entropy,
                              has_entropy=entropy is not None, finite=1, valid=1,
                              td=td.ctypes.data, priorities=priorities.ctypes.data)
        out = ctypes.create_string_buffer(lib.encoded_max(rows, len(key)))
        n = lib.encode(out, ctypes.byref(outcome), rows, step, key, len(key))
        result = StepResult(loss=loss, td_errors=td, priorities=priorities, q_taken_mean=q,
                            grad_norm=norm, step=step, version=step, entropy=entropy)
        assert out.raw[:n] == encoded_train_response(result, key).data


def test_the_mirrored_structs_match_lane_c():
    """The ctypes mirrors and struct formats agree with lane.c's structs."""
    from duelq.server.lane import HANDED, RECORD, LaneBatch, _Engine
    from duelq.server.native import StepArgs
    got = (ctypes.c_size_t * 12)()
    native.load(cuda=False).lane.layouts(got)
    assert list(got) == [
        ctypes.sizeof(StepArgs), StepArgs.epoch.offset, StepArgs.kappa.offset,
        ctypes.sizeof(LaneEngine), LaneEngine.shape_rows.offset, LaneEngine.lr.offset,
        LaneEngine.synced_s.offset, RECORD.size, HANDED.size, ctypes.sizeof(LaneBatch),
        ctypes.sizeof(LaneOutcome), ctypes.sizeof(_Engine)]
