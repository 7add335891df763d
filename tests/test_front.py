"""``--front-processes``: the same answers, refusals and limits as the one-process server.

Each test starts a FrontServer (gRPC here, the learner in a spawned process, train requests
relayed through shared memory) and, where it compares, a LearnerServer with the same config,
and drives both through the public API only.  tests/test_faults.py also runs its SIGTERM
mid-stream drain-and-resume test against a front-process `duelq serve`.
"""

from __future__ import annotations

import logging
import os
import queue
import random
import socket
import tempfile
import threading
import time
import types
import urllib.request
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from duelq.client import LearnerClient, encode_batch
from duelq.wire.tensors import encode
from duelq.client import errors as client_errors
from duelq.server.core.checkpoint import CheckpointError
from duelq.server.core.config import LearnerConfig
from duelq.server.fronts.front import FrontServer, LearnerProcessError, usable_cpus
from duelq.server.core.learner import cuda_usable
from duelq.server.fronts.relay import (AHEAD, LOOK_AFTER_S, MAX_STREAM_ID, BufferPool, RelayFront,
                                       RelayLearner)
from duelq.server.fronts import start_server
from duelq.server.server import SERVICE_NAME, ServerOptions
from duelq.v1 import learner_pb2 as pb
from duelq.v1 import learner_pb2_grpc as pb_grpc

from conftest import SMALL, random_batch
from helpers import RelayWork, replies, wait_for


@pytest.fixture
def pair(make_server):
    """(one-process server, front-process server), same config, fresh state; the fronts
    pack requests (server/fronts/packing.py)."""
    plain = make_server()
    front = start_server(SMALL, ServerOptions(port=0, front_processes=1), backend="reference")
    pack, front.packed = front._relay._pack, []   # the Packer's answers

    def counted(data, buffer, address):
        front.packed.append(pack(data, buffer, address))
        return front.packed[-1]
    front._relay._pack = counted
    yield plain, front
    front.stop(0)


def _stub(target: str) -> pb_grpc.LearnerStub:
    return pb_grpc.LearnerStub(grpc.insecure_channel(target))


def _results(target: str, rng_seed: int) -> list:
    """Unary steps, a stream per wire dtype, entropy, act, ISV and weights, as plain values."""
    rng = np.random.default_rng(rng_seed)
    out = []
    for wire in ("float32", "float16", "bfloat16"):
        with LearnerClient(target, actor_id=f"a-{wire}", feature_dtype=wire) as client:
            client.wait_ready(10)
            r = client.train_step(random_batch(rng, 7))
            out.append((r.loss, r.td_errors.tobytes(), r.step, r.seq))
            for r in client.train_stream((random_batch(rng, 5 + i) for i in range(12)),
                                         window=4):
                out.append((r.loss, r.td_errors.tobytes(), r.priorities.tobytes(), r.step,
                            r.entropy, r.replayed))
            e = client.compute_entropy(rng.integers(0, SMALL.n_actions, 50).astype(np.int32),
                                       "action_entropy_ema", alpha=0.1)
            out.append((e.entropy, e.ema))
            out.append(client.act(rng.standard_normal((3, SMALL.hidden_dim),
                                                      dtype=np.float32)).q_values.tobytes())
    with LearnerClient(target) as client:
        weights = client.get_weights()
        out.append([a.tobytes() for a in weights.params.arrays()])
        out.append(client.info().step)
    return out


def test_trains_exactly_like_the_one_process_server(pair):
    plain, front = pair
    want, got = _results(plain.target, 5), _results(front.target, 5)
    assert got == want
    assert got[-1] == 3 * 13   # every step applied once
    if front.packed is not None:   # every request of every wire went packed
        assert len(front.packed) == 3 * 13 and all(front.packed)


def _refusal(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value.code(), caught.value.details()


def test_refuses_like_the_one_process_server(pair):
    """Bad values, bytes that do not parse, a failing request mid-stream (nothing after it
    applied), a replayed key, bad small rpcs (relayed whole: bad fields, bytes that do not
    parse) and a refused one forwarded over gRPC: same code, same details."""
    rng = np.random.default_rng(2)
    bad = encode_batch(random_batch(rng, 6))
    bad.dones.CopyFrom(encode_batch(random_batch(rng, 6)).rewards)  # not 0/1
    good = [encode_batch(random_batch(rng, 6)) for _ in range(3)]
    for i, request in enumerate(good):
        request.key.CopyFrom(pb.RequestKey(actor_id="k", seq=i + 1))
    seen = []
    for server in pair:
        stub = _stub(server.target)
        raw = grpc.insecure_channel(server.target).unary_unary(f"/{SERVICE_NAME}/TrainStep")
        stream = list(_refusal(lambda: list(stub.TrainStream(iter([good[0], bad, good[1]])))))
        step_after_stream = stub.GetInfo(pb.GetInfoRequest()).step
        again = stub.TrainStep(good[0])
        raw_act = grpc.insecure_channel(server.target).unary_unary(f"/{SERVICE_NAME}/Act")
        seen.append([_refusal(lambda: stub.TrainStep(bad)),
                     _refusal(lambda: raw(b"\x0a\x05\xff\xff")),
                     stream, step_after_stream, (again.replayed, again.step),
                     _refusal(lambda: stub.ComputeEntropy(pb.ComputeEntropyRequest(alpha=0.5))),
                     _refusal(lambda: stub.Act(pb.ActRequest(h=encode(
                         np.zeros((2, SMALL.hidden_dim + 1), np.float32), "h")))),
                     _refusal(lambda: raw_act(b"\x0a\x05\xff\xff")),
                     _refusal(lambda: stub.ReadISV(pb.ReadISVRequest(
                         slots=[pb.SlotRef(name="no such slot")]))),
                     _refusal(lambda: stub.SaveCheckpoint(pb.SaveCheckpointRequest()))])
    want, got = seen
    assert got == want
    assert [code for code, _ in want[5:]] == [grpc.StatusCode.INVALID_ARGUMENT] * 4 + [
        grpc.StatusCode.FAILED_PRECONDITION]
    assert want[0][0] == grpc.StatusCode.INVALID_ARGUMENT and "dones" in want[0][1]
    assert want[1][0] == grpc.StatusCode.INVALID_ARGUMENT and "cannot parse" in want[1][1]
    assert want[3] == 1 and want[4] == (True, 1)


def test_limits_streams_and_relays_requests_larger_than_a_buffer(make_server, caplog):
    """max_streams holds; requests beyond the buffer size go through the socket and more
    requests than buffers are in flight at once: all answered, same results."""
    options = dict(max_streams=1, max_rpcs=4, max_queue=1, max_message_bytes=1 << 20)
    front = start_server(SMALL, ServerOptions(port=0, front_processes=1, **options),
                         backend="reference")
    plain = make_server(**options)
    try:
        rng = np.random.default_rng(9)
        batches = [random_batch(rng, 1500 if i % 3 == 0 else 9) for i in range(10)]
        assert 2 * 1500 * SMALL.hidden_dim * 4 > (1 << 20) / 8   # larger than a buffer
        answers = []
        for server in (plain, front):
            with LearnerClient(server.target, actor_id="big") as client:
                answers.append([(r.loss, r.td_errors.tobytes()) for r in
                                client.train_stream(batches, window=8)])
        assert answers[0] == answers[1]

        stub = _stub(front.target)
        feed: queue.SimpleQueue = queue.SimpleQueue()   # a stream kept open …
        feed.put(encode_batch(batches[1]))
        first = stub.TrainStream(iter(feed.get, None))
        assert next(first).step == len(batches) + 1
        code, details = _refusal(lambda: next(stub.TrainStream(iter([encode_batch(batches[1])]))))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "TrainStreams" in details
        with caplog.at_level(logging.INFO, logger="duelq.server.service"):
            code, _ = _refusal(lambda: list(stub.TrainStream(iter(()))))  # at open, as one
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED                 # process refuses
        assert "TrainStream from" in caplog.text and "RESOURCE_EXHAUSTED" in caplog.text
        feed.put(None)
        assert list(first) == []
    finally:
        front.stop(0)


def test_token_health_metrics_and_info(tmp_path):
    front = start_server(SMALL, ServerOptions(port=0, front_processes=1, token="s3cret",
                                              metrics_port=_free_port()), backend="reference")
    try:
        channel = grpc.insecure_channel(front.target)
        check = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5)
        assert check.status == health_pb2.HealthCheckResponse.SERVING   # no token needed
        for call in (lambda: pb_grpc.LearnerStub(channel).GetInfo(pb.GetInfoRequest()),
                     lambda: pb_grpc.LearnerStub(channel).TrainStep(
                         encode_batch(random_batch(np.random.default_rng(0), 4)))):
            assert _refusal(call)[0] == grpc.StatusCode.UNAUTHENTICATED
        with LearnerClient(front.target, token="s3cret") as client:
            list(client.train_stream((random_batch(np.random.default_rng(i), 4)
                                      for i in range(5)), window=2))
            assert client.info().step == 5
            with pytest.raises(client_errors.InvalidArgument):   # relayed, refused there
                client.act(np.zeros((1, SMALL.hidden_dim + 1), np.float32))
        text = urllib.request.urlopen(
            f"http://127.0.0.1:{front.options.metrics_port}/metrics", timeout=5).read().decode()
        assert "duelq_steps_total 5.0" in text and "duelq_transitions_total 20.0" in text
        assert "duelq_queue_depth 0.0" in text                  # every request counted out
        assert 'duelq_step_latency_seconds_count 5.0' in text
        for method in ("GetInfo", "TrainStep"):                 # refused in the front
            assert (f'duelq_refused_requests_total{{code="UNAUTHENTICATED",method="{method}"}}'
                    f' 1.0') in text
        assert 'duelq_refused_requests_total{code="INVALID_ARGUMENT",method="Act"} 1.0' in text
        feed: queue.SimpleQueue = queue.SimpleQueue()   # max_streams open, then one more
        good = (("authorization", "Bearer s3cret"),)
        stub = pb_grpc.LearnerStub(channel)
        held = [stub.TrainStream(iter(feed.get, None), metadata=good)
                for _ in range(front.options.max_streams)]
        text = ""
        deadline = time.monotonic() + 10
        while f"duelq_active_streams {front.options.max_streams}.0" not in text:
            assert time.monotonic() < deadline, "the held streams did not open"
            time.sleep(0.05)
            text = urllib.request.urlopen(f"http://127.0.0.1:{front.options.metrics_port}"
                                          f"/metrics", timeout=5).read().decode()
        code, _ = _refusal(lambda: list(stub.TrainStream(iter(()), metadata=good)))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        for _ in held:
            feed.put(None)
        for call in held:
            assert list(call) == []
        # The learner process counts it when the front's report arrives: soon, not at once.
        want = 'duelq_refused_requests_total{code="RESOURCE_EXHAUSTED",method="TrainStream"} 1.0'
        deadline = time.monotonic() + 10
        while want not in text and time.monotonic() < deadline:
            time.sleep(0.05)
            text = urllib.request.urlopen(f"http://127.0.0.1:{front.options.metrics_port}"
                                          f"/metrics", timeout=5).read().decode()
        assert want in text
    finally:
        front.stop(0)


class _Job:
    """A relayed job for the relay's own tests: holds one of ``free``'s places if any (as a
    cuda upload does)."""

    def __init__(self, data: memoryview, free: queue.SimpleQueue):
        self.bad, self._free = bytes(data) == b"bad", free
        try:
            self.place = free.get_nowait()
        except queue.Empty:
            self.place = None

    def close(self) -> None:
        place, self.place = self.place, None
        if place is not None:
            self._free.put(place)
        if self.bad:
            raise RuntimeError("a device fault while giving the upload back (simulated)")


def _started_relay(service: RelayWork, buffers: BufferPool | None = None):
    """A started RelayLearner for ``service`` and its RelayFront over a socket pair and one
    buffer pool (default 4 of 64 bytes)."""
    learner_end, front_end = socket.socketpair()
    buffers = buffers or BufferPool(4, 64)
    learner = RelayLearner(learner_end, buffers, service)
    learner.start()
    return learner, RelayFront(front_end, buffers)


def _relay_pair(apply, free: queue.SimpleQueue, *, code=grpc.StatusCode.INTERNAL):
    """:func:`_started_relay` whose jobs hold one of ``free``'s places (:class:`_Job`);
    refusals answered ``code``."""
    return _started_relay(RelayWork(lambda data, method: _Job(data, free), apply,
                                   lambda exc, method: (code, str(exc))), BufferPool(32, 4096))


def test_relay_answers_on_after_a_job_fails_to_close():
    """A job whose close raises (a device fault) is logged; the relay's thread lives
    on and later requests are answered."""
    def apply(job, call):
        if job.bad:
            raise ValueError("the step failed")
        return b"ok"
    learner, front = _relay_pair(apply, queue.SimpleQueue())
    try:
        for payload, want in ((b"good", grpc.StatusCode.OK), (b"bad", grpc.StatusCode.INTERNAL),
                              (b"good", grpc.StatusCode.OK)):
            stream = front.open(method="TrainStep", deadline=time.monotonic() + 10)
            assert stream.submit(payload) is None
            answers = replies(stream, 1)   # without an answer, the test fails, not hangs
            stream.close()
            assert [code for code, _ in answers] == [want]
    finally:
        front.close()
        learner.close()


def test_relay_answers_a_refusal_it_cannot_word(caplog):
    """Should wording a refusal fail too, the request is still answered (INTERNAL, naming
    the first error), so its front's slot comes back, and the relay serves on."""
    def apply(job, call):
        if job.bad:
            raise ValueError("the step failed")
        return b"ok"

    def refuse(exc, method):
        raise RuntimeError("the refusal's wording failed (simulated)")
    learner, front = _started_relay(RelayWork(
        lambda data, method: types.SimpleNamespace(bad=bytes(data) == b"bad",
                                                  close=lambda: None), apply, refuse))
    try:
        for payload, want in ((b"bad", (grpc.StatusCode.INTERNAL,
                                        b"ValueError: the step failed")),
                              (b"good", (grpc.StatusCode.OK, b"ok"))):
            stream = front.open(method="TrainStep", deadline=None)
            assert stream.submit(payload) is None
            assert replies(stream, 1) == [want]
            stream.close()
        assert "wording the refusal" in caplog.text and not learner.closed.is_set()
    finally:
        front.close()
        learner.close()


def test_buffer_pool_refuses_a_write_that_does_not_fit_its_buffer():
    """A write past its buffer's end, or into a buffer the pool lacks, fails and changes
    nothing (it would otherwise spill into the next buffer's bytes)."""
    buffers = BufferPool(2, 8)
    buffers.write(1, b"12345678")
    for index, data in ((0, b"123456789"), (2, b"x"), (-1, b"x")):
        with pytest.raises(ValueError, match="the pool has 2 buffers of 8 bytes"):
            buffers.write(index, data)
    assert bytes(buffers.buffer(1, 8)) == b"12345678"
    assert bytes(buffers.buffer(0, 8)) == bytes(8)
    buffers.close()


def test_relay_reply_sends_the_rest_after_a_partial_send():
    """A reply goes out with one sendmsg of the frame and the payload; should that send
    only part (a signal, say), the rest follows, so the front reads a whole reply."""
    from duelq.server.fronts.relay import _REPLY, _Front, _LearnerStream

    class Sock:
        def __init__(self):
            self.sent = b""

        def sendmsg(self, buffers):
            whole = b"".join(buffers)
            self.sent += whole[:5]
            return 5

        def sendall(self, data):
            self.sent += bytes(data)
    sock, buffers = Sock(), BufferPool(1, 64)
    try:
        stream = _LearnerStream(_Front(1, sock, buffers), 7, False)
        RelayLearner._reply(stream, 0, grpc.StatusCode.OK, b"the payload")
        assert sock.sent == _REPLY.pack(7, 0, grpc.StatusCode.OK.value[0], 11) + b"the payload"
    finally:
        buffers.close()


def test_relay_reads_frames_however_the_socket_splits_them():
    """The learner end reads a front's bytes as they come: OPEN, a request in the buffer
    pool and one inline, sent one byte at a time, and then all in one write, get their
    answers in order."""
    from duelq.server.fronts.relay import _FRAME, _REPLY, END, INLINE, OPEN, REQ

    learner_end, front_end = socket.socketpair()
    buffers = BufferPool(2, 64)
    buffers.write(0, b"in the pool")
    learner = RelayLearner(learner_end, buffers, RelayWork(
        lambda data, method: types.SimpleNamespace(data=bytes(data), close=lambda: None),
        lambda job, call: job.data.upper()))
    learner.start()
    rfile = front_end.makefile("rb")

    def replies(n: int) -> list[tuple[int, bytes]]:
        got = []
        for _ in range(n):
            sid, buffer, code, size = _REPLY.unpack(rfile.read(_REPLY.size))
            got.append((buffer, rfile.read(size)))
        return got
    try:
        for sid, split in ((1, True), (2, False)):
            frames = (_FRAME.pack(OPEN, sid, 0, 0, 0.0)
                      + _FRAME.pack(REQ, sid, 0, len(b"in the pool"), 0.0)
                      + _FRAME.pack(REQ, sid, INLINE - 1, len(b"sent inline"), 0.0)
                      + b"sent inline")
            if split:
                for i in range(len(frames)):
                    front_end.sendall(frames[i:i + 1])
                    time.sleep(0.001)
            else:
                front_end.sendall(frames)
            assert replies(2) == [(0, b"IN THE POOL"), (INLINE - 1, b"SENT INLINE")]
            front_end.sendall(_FRAME.pack(END, sid, 0, 0, 0.0))
    finally:
        learner.close()
        front_end.close()


def _named_jobs_relay(prepare_hook, applied: list, *, buffers: int = 4) -> tuple:
    """A started RelayLearner and its RelayFront whose jobs are the requests' bytes:
    ``prepare_hook(name)`` runs in each prepare, ``applied`` collects the steps; and the
    relay's service (:class:`RelayWork`)."""
    def prepare(data, method):
        name = bytes(data).decode()
        prepare_hook(name)
        return types.SimpleNamespace(name=name, close=lambda: None)

    def apply(job, call):
        applied.append(job.name)
        return job.name.encode()
    service = RelayWork(prepare, apply)
    return (*_started_relay(service, BufferPool(buffers, 64)), service)


def test_relay_an_end_sent_while_a_request_is_prepared_stops_that_request():
    """A request whose stream ends while the relay prepares it is not applied: its END is
    read before the request is stepped."""
    preparing, ended, applied = threading.Event(), threading.Event(), []

    def hook(name):
        if name == "slow":
            preparing.set()
            assert ended.wait(10)
    learner, front, service = _named_jobs_relay(hook, applied)
    try:
        stream = front.open(method="TrainStream", deadline=None)
        assert stream.submit(b"first") is None
        assert replies(stream, 1) == [(grpc.StatusCode.OK, b"first")]
        assert stream.submit(b"slow") is None
        assert preparing.wait(10)
        stream.close()   # END, while "slow" is being prepared
        ended.set()
        wait_for(lambda: service.depth == 0)   # requests received and not yet answered
        assert applied == ["first"]
    finally:
        front.close()
        learner.close()


def test_relay_an_end_stops_a_prepared_request_with_others_queued_behind_it():
    """As above, with requests of another stream received behind it, so the relay has more
    to prepare and need not look for frames every pass: it still reads before stepping a
    request prepared since its last read, so the END stops that request."""
    preparing, sent, ended = (threading.Event() for _ in range(3))
    applied: list = []

    def hook(name):
        if name == "a0":   # held until everything is sent, so the rest are received
            assert sent.wait(10)
        elif name == "slow":
            preparing.set()
            assert ended.wait(10)
    learner, front, _ = _named_jobs_relay(hook, applied, buffers=32)
    try:
        busy, ending = (front.open(method="TrainStream", deadline=None) for _ in range(2))
        for name in [f"a{i}" for i in range(5)] + ["slow"] + [f"b{i}" for i in range(10)]:
            assert (ending if name == "slow" else busy).submit(name.encode()) is None
        sent.set()
        assert preparing.wait(10)
        assert learner._received   # received, not yet prepared: b0 …
        ending.close()   # END, while "slow" is being prepared
        ended.set()
        assert [payload for _, payload in replies(busy, 15)] == \
            [f"a{i}".encode() for i in range(5)] + [f"b{i}".encode() for i in range(10)]
        assert "slow" not in applied
    finally:
        front.close()
        learner.close()


def test_relay_a_call_that_ends_while_its_step_waits_is_not_applied():
    """A step that waits (for the apply lock, say) and then asks whether its call is still
    active learns of an END sent meanwhile: the relay reads the frames that came, so the
    request is refused, not applied; the relay serves on."""
    waiting, ended, applied = threading.Event(), threading.Event(), []

    def apply(job, call):
        if job.name == "waits":
            waiting.set()
            assert ended.wait(10)   # the END comes meanwhile
            time.sleep(2 * LOOK_AFTER_S)   # a wait that long makes is_active read frames
        if not call.is_active():
            raise RuntimeError("the call ended while the request waited; not applied")
        applied.append(job.name)
        return job.name.encode()
    learner, front = _started_relay(RelayWork(
        lambda data, method: types.SimpleNamespace(name=bytes(data).decode(),
                                                  close=lambda: None),
        apply, lambda exc, method: (grpc.StatusCode.CANCELLED, str(exc))))
    try:
        stream = front.open(method="TrainStream", deadline=None)
        assert stream.submit(b"waits") is None
        assert waiting.wait(10)
        stream.close()   # END, while the step waits
        ended.set()
        after = front.open(method="TrainStep", deadline=None)
        assert after.submit(b"after") is None
        assert replies(after, 1) == [(grpc.StatusCode.OK, b"after")]
        assert applied == ["after"]
    finally:
        front.close()
        learner.close()


def test_relay_call_is_active_never_raises(caplog):
    """The service asks is_active holding the apply lock, so a failure to read the frames
    (the relay closed under it, say) is logged, not raised."""
    from duelq.server.fronts.relay import RelayCall, _Front, _LearnerStream

    def look():
        raise OSError("the relay's sockets are closed (simulated)")
    buffers = BufferPool(1, 64)
    try:
        call = RelayCall(0.0, _LearnerStream(_Front(0, None, buffers), 1, False), look=look)
        time.sleep(0.002)   # past LOOK_AFTER_S: it looks
        assert call.is_active() and "reading the relay's frames" in caplog.text
    finally:
        buffers.close()


def test_relay_a_front_closed_before_it_is_read_leaves_the_others_serving():
    applied: list = []
    learner, front, _ = _named_jobs_relay(lambda name: None, applied)
    try:
        gone_end, gone = socket.socketpair()
        gone.close()
        gone_end.close()
        learner.attach(gone_end, BufferPool(1, 64))   # cannot even be watched
        stream = front.open(method="TrainStep", deadline=None)
        assert stream.submit(b"still served") is None
        assert [payload for _, payload in replies(stream, 1)] == [b"still served"]
        stream.close()
        assert not learner.closed.is_set()
    finally:
        front.close()
        learner.close()


def test_relay_closing_every_front_at_once_is_a_clean_end(caplog):
    """close() shuts every front's socket at once, so one select can report them all,
    the first front first: the relay ends without an error and finishes every stream."""
    for _ in range(5):
        ends = [socket.socketpair() for _ in range(4)]
        pools = [BufferPool(2, 64) for _ in ends]
        service = RelayWork(lambda *a: None, lambda *a: b"")
        learner = RelayLearner(ends[0][0], pools[0], service)
        learner.start()
        fronts = [RelayFront(ends[0][1], pools[0])]
        for (mine, theirs), pool in list(zip(ends, pools))[1:]:
            learner.attach(mine, pool)
            fronts.append(RelayFront(theirs, pool))
        for front in fronts:
            front.open(method="TrainStream", deadline=None)
        wait_for(lambda: service.opened == len(fronts))   # every OPEN read
        learner.close()
        assert learner.closed.is_set() and service.opened == service.closed == len(fronts)
        for front in fronts:
            front.close()
    assert "the relay failed" not in caplog.text


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_relay_answers_each_request_once_in_order_from_concurrent_streams(seed):
    """Randomised: 3 fronts × 4 streams submit at once through 32 buffers per front (the
    third front attaches while the others stream), prepare and apply pause now and then,
    and some streams end midway.  A stream that finishes
    gets every answer, in order; one that ends midway has a prefix of its requests
    applied, in order; nothing is applied twice and every request is answered (the depth
    gauge comes back to 0)."""
    pauses = random.Random(seed), random.Random(-seed)   # prepare's, apply's
    applied: list[bytes] = []

    def prepare(data, method):
        if pauses[0].random() < 0.2:
            time.sleep(pauses[0].random() * 3e-4)
        return types.SimpleNamespace(data=bytes(data), close=lambda: None)

    def apply(job, call):
        if pauses[1].random() < 0.2:
            time.sleep(pauses[1].random() * 3e-4)
        applied.append(job.data)
        return job.data.upper()
    ends = [socket.socketpair() for _ in range(3)]
    pools = [BufferPool(32, 64) for _ in ends]
    service = RelayWork(prepare, apply)
    learner = RelayLearner(ends[0][0], pools[0], service)
    learner.start()
    fronts = [RelayFront(ends[0][1], pools[0])]

    def attach(f: int) -> None:
        learner.attach(ends[f][0], pools[f])
        fronts.append(RelayFront(ends[f][1], pools[f]))
    attach(1)
    plan = random.Random(seed)
    streams = [(f, s, plan.choice([None, plan.randrange(1, 40)]))   # None: all 40 sent
               for f in range(len(ends)) for s in range(4)]
    answers: dict[tuple[int, int], list] = {}

    def run(f: int, s: int, end_after: int | None) -> None:
        stream = fronts[f].open(method="TrainStream", deadline=None)
        for i in range(40 if end_after is None else end_after):
            assert stream.submit(f"f{f}s{s}r{i}".encode()) is None
        if end_after is None:
            answers[f, s] = replies(stream, 40)
        stream.close()
    threads = [threading.Thread(target=run, args=args) for args in streams]
    try:
        for thread in threads[:8]:   # the first two fronts' streams
            thread.start()
        attach(2)
        for thread in threads[8:]:
            thread.start()
        for thread in threads:
            thread.join(60)
        wait_for(lambda: service.depth == 0)
        assert not any(t.is_alive() for t in threads)
        assert len(applied) == len(set(applied))
        for f, s, end_after in streams:
            sent = [f"f{f}s{s}r{i}".encode() for i in range(40 if end_after is None
                                                             else end_after)]
            mine = [a for a in applied if a.startswith(f"f{f}s{s}r".encode())]
            assert mine == sent[:len(mine)]
            if end_after is None:
                assert answers[f, s] == [(grpc.StatusCode.OK, b.upper()) for b in sent]
    finally:
        for front in fronts:
            front.close()
        learner.close()


def test_relay_that_fails_ends_and_answers_what_it_received(caplog):
    """Should the relay's thread fail, every stream is refused UNAVAILABLE (its client may
    retry its keys), each request it holds is answered, and ``closed`` is set."""
    applied: list = []
    learner, front, _ = _named_jobs_relay(lambda name: None, applied)
    reads = learner._read

    def failing_read(one):   # after the first step, fails once it has read a frame
        more = reads(one)
        if applied:
            raise RuntimeError("the relay failed (simulated)")
        return more
    learner._read = failing_read
    try:
        stream = front.open(method="TrainStream", deadline=None)
        assert stream.submit(b"first") is None
        assert replies(stream, 1) == [(grpc.StatusCode.OK, b"first")]
        assert stream.submit(b"second") is None   # received by the failing relay, not prepared
        [(code, _)] = replies(stream, 1)
        assert code == grpc.StatusCode.UNAVAILABLE and learner.closed.wait(5)
        assert "the relay failed" in caplog.text and applied == ["first"]
    finally:
        front.close()
        learner.close()


def test_relay_prepares_no_more_jobs_than_the_backend_has_uploads_in_flight():
    """With a slow step, at most AHEAD + 1 jobs are alive (prepared, and one stepping), so
    each finds one of CudaBackend's AHEAD + 1 uploads in flight and none is packed at its
    step (test_cuda checks that the two counts agree)."""
    free: queue.SimpleQueue = queue.SimpleQueue()
    for place in range(AHEAD + 1):
        free.put(place)
    jobs, alive = [], []

    def apply(job, call):
        jobs.append(job.place)
        alive.append(AHEAD + 1 - free.qsize())
        time.sleep(0.002)   # the step; it gives its upload back before it answers
        job.close()
        return b"ok"
    learner, front = _relay_pair(apply, free)
    try:
        streams = [front.open(method="TrainStream", deadline=None) for _ in range(4)]
        for stream in streams:
            for _ in range(25):
                assert stream.submit(b"x") is None
        for stream in streams:
            assert [code for code, _ in replies(stream, 25)] == [grpc.StatusCode.OK] * 25
            stream.close()
        assert len(jobs) == 100 and None not in jobs
        assert max(alive) == AHEAD + 1   # the next request's copy overlaps each step
    finally:
        front.close()
        learner.close()


def test_stream_ids_wrap_past_the_frames_32_bits_and_skip_open_ones():
    learner_end, front_end = socket.socketpair()
    front = RelayFront(front_end, BufferPool(1, 4096))
    try:
        front._last_id = MAX_STREAM_ID - 2
        held = front.open(method="TrainStream", deadline=None)      # MAX − 1, still open
        ids = [held.sid] + [front.open(method="TrainStep", deadline=None).sid for _ in range(2)]
        for sid in ids[1:]:
            front._streams.pop(sid)                         # those two have ended
        front._last_id = MAX_STREAM_ID - 2
        again = [front.open(method="TrainStep", deadline=None).sid for _ in range(3)]
        assert ids == [MAX_STREAM_ID - 1, MAX_STREAM_ID, 1]
        assert again == [MAX_STREAM_ID, 1, 2]               # MAX − 1 is skipped: still open
    finally:
        front.close()
        learner_end.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_stop_writes_the_final_checkpoint_and_a_restart_keeps_keys(tmp_path):
    options = ServerOptions(port=0, checkpoint_dir=str(tmp_path))
    rng = np.random.default_rng(4)
    batches = [random_batch(rng, 6) for _ in range(3)]
    front = start_server(SMALL, options, backend="reference")
    with LearnerClient(front.target, actor_id="keeper") as client:
        first = [r.loss for r in client.train_stream(batches)]
    path, step = front.stop()
    assert step == 3 and path.exists()

    again = start_server(SMALL, options, backend="reference")
    try:
        request = encode_batch(batches[2])
        request.key.CopyFrom(pb.RequestKey(actor_id="keeper", seq=3))
        answer = _stub(again.target).TrainStep(request, timeout=10)
        assert (answer.replayed, answer.step, answer.loss) == (True, 3, first[2])
    finally:
        again.stop(0)


def test_refuses_to_start_over_another_configs_checkpoint(tmp_path):
    start_server(SMALL, ServerOptions(port=0, front_processes=1, checkpoint_dir=str(tmp_path)),
                 backend="reference").stop()
    other = LearnerConfig(hidden_dim=SMALL.hidden_dim + 1, n_actions=SMALL.n_actions)
    with pytest.raises(CheckpointError, match="config mismatch"):
        start_server(other, ServerOptions(port=0, front_processes=1,
                                          checkpoint_dir=str(tmp_path)), backend="reference")


@pytest.mark.skipif(cuda_usable()[0], reason="a GPU is usable here")
def test_a_backend_that_cannot_start_is_reported():
    with pytest.raises(LearnerProcessError):
        start_server(SMALL, ServerOptions(port=0, front_processes=1), backend="cuda")


def test_a_dead_learner_process_turns_the_front_unavailable():
    front = start_server(SMALL, ServerOptions(port=0, front_processes=1), backend="reference")
    try:
        assert isinstance(front, FrontServer)
        front._process.kill()
        assert front.broken.wait(10)
        channel = grpc.insecure_channel(front.target)
        status = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        code, _ = _refusal(lambda: pb_grpc.LearnerStub(channel).TrainStep(
            encode_batch(random_batch(np.random.default_rng(0), 4)), timeout=5))
        assert code == grpc.StatusCode.UNAVAILABLE
        code, _ = _refusal(lambda: pb_grpc.LearnerStub(channel).Act(
            pb.ActRequest(h=encode(np.zeros((1, SMALL.hidden_dim), np.float32), "h")), timeout=5))
        assert code == grpc.StatusCode.UNAVAILABLE   # a small rpc, relayed
        with LearnerClient(front.target, retries=0) as client:
            with pytest.raises(client_errors.Unavailable):
                client.train_step(random_batch(np.random.default_rng(1), 4))
    finally:
        t0 = time.monotonic()
        front.stop(0)
        assert time.monotonic() - t0 < 10


def test_failing_cancelled_and_expired_streams_leave_it_serving():
    """A stream that fails mid-way, or whose deadline passes or whose client cancels while
    later requests are still arriving, ends alone: the learner process keeps serving, and
    nothing is applied after the failure or after the call ended, and no handler thread
    is left waiting (with max_rpcs 3, a leaked one per stream would soon refuse calls)."""
    front = start_server(SMALL, ServerOptions(port=0, front_processes=1, max_streams=2,
                                              max_rpcs=3), backend="reference")
    try:
        stub = _stub(front.target)
        rng = np.random.default_rng(6)
        good = encode_batch(random_batch(rng, 4))
        bad = encode_batch(random_batch(rng, 4))
        bad.dones.CopyFrom(encode_batch(random_batch(rng, 4)).rewards)   # not 0/1

        def requests(first=()):
            yield from first
            for _ in range(20000):
                yield good
        for _ in range(3):
            before = stub.GetInfo(pb.GetInfoRequest()).step
            code, _ = _refusal(lambda: list(stub.TrainStream(requests((good, bad)),
                                                             timeout=10)))
            assert code == grpc.StatusCode.INVALID_ARGUMENT
            assert stub.GetInfo(pb.GetInfoRequest()).step == before + 1  # none after bad
        for _ in range(5):
            code, _ = _refusal(lambda: list(stub.TrainStream(requests(), timeout=0.3)))
            assert code == grpc.StatusCode.DEADLINE_EXCEEDED
            call = stub.TrainStream(requests())
            next(call)
            call.cancel()
        # The calls' requests in flight may still land; then the step count holds still
        # (a stream left running would keep it moving until the deadline).
        deadline, settled = time.monotonic() + 60, stub.GetInfo(pb.GetInfoRequest()).step
        while True:
            time.sleep(0.3)
            step = stub.GetInfo(pb.GetInfoRequest()).step
            if step == settled:
                break
            assert time.monotonic() < deadline, "steps kept coming after every call ended"
            settled = step
        assert not front.broken.is_set()
        assert stub.TrainStep(good, timeout=10).step == settled + 1
    finally:
        front.stop(0)


def _metric(text: str, line_start: str) -> float:
    """The value of the first sample in ``text`` (Prometheus exposition) starting so."""
    return next((float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                 if line.startswith(line_start)), 0.0)


def test_front_processes_share_the_port_and_stop_together(make_server, tmp_path, capfd):
    """--front-processes 2: the same answers as one process; connections reach both fronts
    (the learner process counts each front's requests); stop drains, writes the final
    checkpoint, and every process exits and the socket folder goes, with no front taking
    the learner process's going for a death."""
    front = start_server(SMALL, ServerOptions(port=0, front_processes=2,
                                              metrics_port=_free_port(),
                                              checkpoint_dir=str(tmp_path)),
                         backend="reference")
    try:
        assert [p.is_alive() for p, _ in front._fronts] == [True]
        assert _results(front.target, 5) == _results(make_server().target, 5)
        rng = np.random.default_rng(8)
        for i in range(24):   # 24 connections: all on one front 1 time in 8 million
            with LearnerClient(front.target, actor_id=f"c{i}") as client:
                client.train_step(random_batch(rng, 3))
        text = urllib.request.urlopen(
            f"http://127.0.0.1:{front.options.metrics_port}/metrics", timeout=5).read().decode()
        counts = [_metric(text, f'duelq_relayed_requests_total{{front="{i}"}}') for i in (1, 2)]
        assert min(counts) > 0 and sum(counts) == 3 * 13 + 24, counts
    finally:
        path, step = front.stop()
    assert step == 3 * 13 + 24 and path.exists()
    assert not any(p.is_alive() for p, _ in front._fronts) and not front._dir.exists()
    assert "[front-2]: the learner process went away" not in capfd.readouterr().err


def test_a_killed_second_front_leaves_the_first_serving(tmp_path, caplog):
    front = start_server(SMALL, ServerOptions(port=0, front_processes=2,
                                              checkpoint_dir=str(tmp_path)),
                         backend="reference")
    try:
        process = front._fronts[0][0]
        with caplog.at_level(logging.ERROR, logger="duelq.server.front"):
            process.kill()
            process.join(10)
            deadline = time.monotonic() + 10
            while "front process 2" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.05)
        assert "front process 2" in caplog.text and "the other fronts serve on" in caplog.text
        rng = np.random.default_rng(3)
        with LearnerClient(front.target, actor_id="after") as client:   # new connections
            assert len(list(client.train_stream(random_batch(rng, 4) for _ in range(10)))) == 10
        assert not front.broken.is_set()
    finally:
        path, step = front.stop()
    assert step == 10


def test_a_second_front_gone_ends_its_streams_only():
    """The learner end serves several fronts: when one front's connection closes, its open
    streams end (each counted out once), and the other fronts' go on."""
    service = RelayWork(lambda data, method: types.SimpleNamespace(close=lambda: None),
                       lambda job, call: b"ok")
    learner, first = _started_relay(service, BufferPool(32, 4096))
    second_learner_end, second_front_end = socket.socketpair()
    second_buffers = BufferPool(4, 4096)
    assert learner.attach(second_learner_end, second_buffers) == 1
    second = RelayFront(second_front_end, second_buffers)
    try:
        open_there = [second.open(method="TrainStream", deadline=None) for _ in range(2)]
        assert open_there[0].submit(b"x") is None
        assert replies(open_there[0], 1)[0][0] == grpc.StatusCode.OK
        here = first.open(method="TrainStream", deadline=None)   # the same stream id on the first
        assert here.sid == open_there[0].sid
        second.close()
        deadline = time.monotonic() + 10
        while service.closed < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert service.closed == 2                       # both of the gone front's streams
        assert here.submit(b"y") is None
        assert [code for code, _ in replies(here, 1)] == [grpc.StatusCode.OK]
        here.close()
        assert not learner.closed.is_set()
    finally:
        first.close()
        learner.close()


def test_when_the_first_front_closes_another_fronts_requests_are_answered_unavailable():
    """The first front's connection closing is the learner process stopping: a request of
    another front that has not started is answered UNAVAILABLE (its client retries the
    key), never CANCELLED (which would tell that client its own call had ended)."""
    held, go = threading.Event(), threading.Event()

    def apply(job, call):
        if job.name == "first":
            held.set()
            while not go.wait(0.005):
                call.is_active()   # reads the frames that come meanwhile
        return job.name.encode()
    service = RelayWork(lambda data, method: types.SimpleNamespace(name=bytes(data).decode(),
                                                                  close=lambda: None), apply)
    learner, first = _started_relay(service)
    second_end, second_front_end = socket.socketpair()
    pool = BufferPool(4, 64)
    learner.attach(second_end, pool)
    second = RelayFront(second_front_end, pool)
    try:
        assert first.open(method="TrainStep", deadline=None).submit(b"first") is None
        assert held.wait(10)
        other = second.open(method="TrainStream", deadline=None)
        assert other.submit(b"other") is None
        deadline = time.monotonic() + 10
        while service.depth < 2:   # received while "first" steps
            assert time.monotonic() < deadline
            time.sleep(0.005)
        first.close()
        go.set()
        assert replies(other, 1) == [(grpc.StatusCode.UNAVAILABLE,
                                      b"the learner process is stopping; retry with the "
                                      b"same key")]
    finally:
        go.set()
        second.close()
        learner.close()


@pytest.mark.parametrize("cpu_max, cap", [("max 100000\n", None), ("200000 100000\n", 2),
                                          ("150000 100000\n", 2), ("50000 100000\n", 1),
                                          ("garbage\n", None), (None, None)])
def test_usable_cpus_reads_the_cgroup_quota(tmp_path, cpu_max, cap):
    """The affinity's CPU count, capped by a cgroup v2 quota rounded up; no quota, no file or
    a file not in that form: the affinity's count."""
    path = tmp_path / "cpu.max"
    if cpu_max is not None:
        path.write_text(cpu_max)
    affinity = len(os.sched_getaffinity(0))
    assert usable_cpus(path) == (affinity if cap is None else min(affinity, cap))


def test_more_fronts_than_cpus_are_warned_about(caplog):
    """As many front processes as usable CPUs (the image's 8 on a small host): a warning
    naming a count to try."""
    cpus = usable_cpus()
    server = FrontServer(ServerOptions(port=0, front_processes=max(2, cpus)))
    with caplog.at_level(logging.WARNING, logger="duelq.server.front"):
        server.start()
    server.stop(0)
    assert f"front processes and the learner process on {cpus} CPUs share cores" in caplog.text
    assert f"consider --front-processes {max(1, cpus // 2)}" in caplog.text


def test_front_processes_refuse_a_port_another_server_listens_on():
    """The fronts share their port (SO_REUSEPORT): a second server with several fronts on it
    would take part of the connections silently, so the first front refuses such a port."""
    options = ServerOptions(port=0, front_processes=2)
    first = start_server(SMALL, options, backend="reference")
    try:
        taken = FrontServer(replace(options, port=first.port))
        with pytest.raises(OSError, match="another server"):
            taken.start()
        taken.stop(0)
        # start_server stops what it made when the start fails: no folder left behind
        before = set(Path(tempfile.gettempdir()).glob("duelq-*"))
        with pytest.raises(OSError, match="another server"):
            start_server(SMALL, replace(options, port=first.port), backend="reference")
        assert set(Path(tempfile.gettempdir()).glob("duelq-*")) <= before
    finally:
        first.stop(0)


def test_another_front_told_of_a_stop_takes_the_learner_process_going_calmly(caplog):
    """The first front tells the others before it stops the learner process, so that they
    do not take its going for a death (ERROR, NOT_SERVING) as they do otherwise."""
    options = ServerOptions(port=0, front_processes=2)
    first = FrontServer(options)   # not started: it makes the folder the others join
    try:
        for told in (False, True):
            caplog.clear()
            front = FrontServer(options, index=1, directory=first._dir)
            try:
                if told:
                    front.expect_stop()
                front._learner_gone()
                assert front.broken.is_set() != told
                assert ("the learner process went away" in caplog.text) != told
            finally:
                front._server.stop(0)
    finally:
        first.stop(0)


def test_relay_calls_are_answered_between_steps_and_give_no_buffer_back():
    """A small rpc relayed whole (CALL) is run between two steps, not behind the train
    requests queued before it, and its reply frees no buffer; one that raises is answered
    INTERNAL; a relay that takes none answers UNIMPLEMENTED; once the learner end is gone
    the front answers UNAVAILABLE itself."""
    order: list = []
    held, go = threading.Event(), threading.Event()

    def apply(job, call):
        order.append("step")
        if len(order) == 1:
            held.set()
            assert go.wait(10)
        return b"ok"

    def call(method, request, context):
        order.append(f"call {method}")
        if request == b"boom":
            raise RuntimeError("the call failed (simulated)")
        assert context.is_active() and context.time_remaining() is None
        return grpc.StatusCode.OK, request[::-1]
    learner, front = _started_relay(RelayWork(
        lambda data, method: types.SimpleNamespace(close=lambda: None), apply, call=call))
    try:
        stream = front.open(method="TrainStream", deadline=None)
        for _ in range(4):
            assert stream.submit(b"x") is None
        assert held.wait(10)   # the first step holds; three requests queue behind it
        answers: list = []
        sent = threading.Event()
        caller = threading.Thread(target=lambda: answers.append(
            front.call(1, b"abc", None, lambda cancel: sent.set())))
        caller.start()
        assert sent.wait(10)   # the call's frame is on its way, behind the queued three
        go.set()
        caller.join(10)
        assert [code for code, _ in replies(stream, 4)] == [grpc.StatusCode.OK] * 4
        stream.close()
        assert answers == [(grpc.StatusCode.OK, b"cba")]
        assert order.index("call 1") == 1   # right after the step it came during
        code, details = front.call(0, b"boom", None)
        assert code == grpc.StatusCode.INTERNAL and b"the call failed" in details
        assert front._free.qsize() == 4   # every buffer back, none twice
    finally:
        front.close()
        learner.close()
    assert front.call(0, b"late", None)[0] == grpc.StatusCode.UNAVAILABLE
    learner, front = _started_relay(RelayWork(lambda *a: None, lambda job, call: b""))
    try:
        assert front.call(0, b"", None)[0] == grpc.StatusCode.UNIMPLEMENTED
    finally:
        front.close()
        learner.close()


def test_a_relayed_call_past_its_deadline_or_cancelled_is_not_run():
    """Behind a step that holds the learner: a call whose deadline passes is answered
    DEADLINE_EXCEEDED by the front at its deadline, one cancelled (grpc's callback) is
    answered by the learner CANCELLED; neither runs once the step is done."""
    held, go = threading.Event(), threading.Event()
    ran: list = []

    def apply(job, call):
        held.set()
        assert go.wait(10)
        return b"ok"

    def call(method, request, context):
        ran.append(request)
        return grpc.StatusCode.OK, b""
    learner, front = _started_relay(RelayWork(
        lambda data, method: types.SimpleNamespace(close=lambda: None), apply, call=call))
    try:
        stream = front.open(method="TrainStep", deadline=None)
        assert stream.submit(b"x") is None
        assert held.wait(10)
        code, _ = front.call(0, b"late", time.monotonic() + 0.1)   # the step still held
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED
        cancels, answers = [], []
        caller = threading.Thread(target=lambda: answers.append(
            front.call(0, b"cancelled", None, cancels.append)))
        caller.start()
        wait_for(lambda: cancels)
        cancels[0]()
        go.set()
        caller.join(10)
        assert answers == [(grpc.StatusCode.CANCELLED, b"the call ended before it ran")]
        assert front.call(0, b"on time", None) == (grpc.StatusCode.OK, b"")
        assert [code for code, _ in replies(stream, 1)] == [grpc.StatusCode.OK]
        stream.close()
        assert ran == [b"on time"]
    finally:
        go.set()
        front.close()
        learner.close()


def test_a_stream_is_not_idle_while_a_request_sent_during_the_wait_is_at_the_learner():
    """The reader sends a request while the handler waits out its idle deadline: the
    handler then waits for the answer instead of ending the stream as idle."""
    from duelq.server.fronts.relay import REPLY
    from duelq.server.gate import StreamReader, Watchdog
    waiting, sent, answering = threading.Event(), threading.Event(), threading.Event()

    class Inbox(queue.SimpleQueue):
        def get(self, block=True, timeout=None):
            if timeout is not None:   # the idle wait: a request is sent meanwhile
                waiting.set()
                assert sent.wait(30)
            else:
                answering.set()
            return super().get(block, timeout)

    inbox = Inbox()

    def submit(data):
        sent.set()
        return None

    def requests():
        assert waiting.wait(30)
        yield b"request"
        threading.Event().wait(30)   # the client neither sends nor half-closes

    stream = types.SimpleNamespace(inbox=inbox)
    refused = []
    watchdog = Watchdog(30.0)
    front = types.SimpleNamespace(options=types.SimpleNamespace(receive_timeout_s=0.05),
                                  _refuse=lambda context, method, exc: refused.append(exc),
                                  gate=types.SimpleNamespace(watchdog=watchdog))
    reader = StreamReader(requests(), inbox, ahead=4, handle=submit)
    answers = FrontServer._relay_stream(front, "TrainStream", stream, reader, None)
    threading.Thread(target=lambda: answering.wait(30) and inbox.put(
        (REPLY, (grpc.StatusCode.OK, b"answer"))), daemon=True).start()
    try:
        assert next(answers) == b"answer" and refused == []
    finally:
        reader.close()
        watchdog.close()
