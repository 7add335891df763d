"""Requests packed by the front (server/packing.py): a packed request must give the very
arrays, key, steps and refusals that the learner's own parse and checks of its bytes give,
and a request that does not pack must go as it came."""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
import types

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from duelq.client.client import encode_batch_wire
from duelq.wire.tensors import encode
from duelq.wire.types import FEATURE_DTYPES
from duelq.server.fronts import relay
from duelq.server.core.backend import StepOutputs
from duelq.server.core.batch import Batch, PackedBatch, packed_layout, validate_batch
from duelq.server.core.errors import InvalidArgument, ResourceExhausted
from duelq.server.core.learner import Learner
from duelq.server.fronts.packing import DESCRIPTOR, STREAM_MIN_BYTES, Packer, read_packed
from duelq.server.core.reference import ReferenceBackend
from duelq.server.fronts.relay import BufferPool, RelayFront, RelayLearner
from duelq.server.server import ServerOptions
from duelq.server.service import EncodedTrainResponse, LearnerService, decode_batch, refusal
from duelq.server.framing import parse_train_request
from duelq.v1 import learner_pb2 as pb

from conftest import SMALL, random_batch
from helpers import RelayWork, replies

LIMITS = ServerOptions(max_message_bytes=1 << 24, max_batch_size=64, max_streams=4).limits()
WIRES = ("float32", "float16", "bfloat16")


def test_packed_layout_of_hand_counted_batches():
    # B = 2, H = 3, float32, no weights: 24-byte feature blocks, then four [2] vectors.
    assert packed_layout(2, 3, 4, False) == ((0, 24, 48, 56, 64, 72), 20)
    # 16-bit features: 12-byte blocks; weights add a fifth vector.
    assert packed_layout(2, 3, 2, True) == ((0, 12, 24, 32, 40, 48, 56), 16)
    # B·H odd with 16-bit features: the two blocks still end on a word.
    assert packed_layout(1, 3, 2, False) == ((0, 6, 12, 16, 20, 24), 7)


def _buffer(size: int = 1 << 16) -> np.ndarray:
    return np.full(size, 0xEE, np.uint8)


def _packed(data: bytes, buffer: np.ndarray | None = None) -> tuple[PackedBatch, bytes]:
    buffer = _buffer() if buffer is None else buffer
    descriptor = Packer().pack(data, buffer)
    assert descriptor is not None
    return read_packed(descriptor, memoryview(buffer), buffer.ctypes.data)


def _same_arrays(packed: Batch, decoded: Batch) -> None:
    assert (packed.weights is None) == (decoded.weights is None)
    for a, b in zip(packed.arrays(), decoded.arrays()):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 48),
       wire=st.sampled_from(WIRES), weights=st.booleans(), keyed=st.booleans())
def test_a_packed_request_holds_the_arrays_and_key_the_learner_decodes(seed, rows, wire,
                                                                        weights, keyed):
    rng = np.random.default_rng(seed)
    batch = random_batch(rng, rows, weights=weights)
    data = encode_batch_wire(batch, feature_dtype=wire, actor_id="a" * keyed, seq=7 * keyed)
    packed, key = _packed(data)
    request = parse_train_request(data)
    decoded = decode_batch(request, keep_16bit=True)
    assert (packed.size, packed.hidden_dim, packed.has_weights) == (rows, SMALL.hidden_dim,
                                                                     weights)
    assert packed.dtype == decoded.h_t.dtype
    _same_arrays(packed.batch(), decoded)
    assert pb.RequestKey.FromString(key) == request.key


def test_requests_of_a_layout_seen_before_pack_their_own_values():
    rng = np.random.default_rng(1)
    packer, buffer = Packer(), _buffer()
    for seq in range(1, 4):   # one layout (the key's seq keeps its length)
        batch = random_batch(rng, 8)
        data = encode_batch_wire(batch, actor_id="actor", seq=seq)
        descriptor = packer.pack(data, buffer)
        packed, key = read_packed(descriptor, memoryview(buffer), buffer.ctypes.data)
        _same_arrays(packed.batch(), batch)
        assert pb.RequestKey.FromString(key) == pb.RequestKey(actor_id="actor", seq=seq)


def _request(batch: Batch, **overrides) -> bytes:
    """A TrainRequest of ``batch``'s arrays as they are (any dtype), fields replaced by
    ``overrides`` (None: left out)."""
    fields = {name: a for name, a in zip(("h_t", "h_tp1", "actions", "rewards", "dones",
                                          "discounts", "weights"), batch.arrays())}
    fields.update(overrides)
    return pb.TrainRequest(**{name: encode(a, name) for name, a in fields.items()
                              if a is not None}).SerializeToString()


@pytest.mark.parametrize("why, overrides", [
    ("uint8 actions", {"actions": np.arange(4, dtype=np.uint8)}),
    ("float16 rewards", {"rewards": np.zeros(4, np.float16)}),
    ("bool dones", {"dones": np.zeros(4, bool)}),
    ("uint8 features", {"h_t": np.zeros((4, 16), np.uint8),
                        "h_tp1": np.zeros((4, 16), np.uint8)}),
    ("mixed feature dtypes", {"h_tp1": np.zeros((4, 16), np.float16)}),
    ("1-D features", {"h_t": np.zeros(64, np.float32)}),
    ("a vector of another length", {"discounts": np.ones(5, np.float32)}),
    ("features of other rows", {"h_tp1": np.zeros((5, 16), np.float32)}),
    ("no discounts", {"discounts": None, "weights": None}),
    ("no rows", {name: a[:0] for name, a in zip(
        ("h_t", "h_tp1", "actions", "rewards", "dones", "discounts"),
        random_batch(np.random.default_rng(0), 4).arrays())}),
])
def test_a_request_the_learner_would_convert_or_refuse_is_not_packed(why, overrides):
    batch = random_batch(np.random.default_rng(2), 4)
    buffer = _buffer()
    assert Packer().pack(_request(batch, **overrides), buffer) is None, why
    assert (buffer == 0xEE).all()   # left as it was


def test_non_canonical_bytes_a_bad_key_and_a_small_buffer_are_not_packed():
    batch = random_batch(np.random.default_rng(3), 4)
    data = encode_batch_wire(batch, actor_id="a", seq=1)
    packer = Packer()
    assert packer.pack(data[:-3] + b"\x42\x01\xff", _buffer()) is None   # key: a cut varint
    assert packer.pack(b"\x08\x01" + data, _buffer()) is None            # a varint field first
    _, words = packed_layout(4, 16, 4, True)
    assert packer.pack(data, _buffer(4 * words - 1)) is None
    assert packer.pack(data, _buffer(4 * words)) is not None


def test_read_packed_refuses_descriptors_no_front_writes():
    data = memoryview(bytearray(1024))
    with pytest.raises(ValueError, match="has 3 bytes"):
        read_packed(b"abc", data, 0)
    with pytest.raises(ValueError, match="malformed"):
        read_packed(DESCRIPTOR.pack(4, 16, len(FEATURE_DTYPES), 0), data, 0)
    with pytest.raises(ValueError, match="malformed"):
        read_packed(DESCRIPTOR.pack(0, 16, 0, 0), data, 0)
    with pytest.raises(ValueError, match="of 576 bytes in 100"):   # 4·(2·4·16 + 4·4)
        read_packed(DESCRIPTOR.pack(4, 16, 0, 0), data[:100], 0)


class PackedReference(ReferenceBackend):
    """The reference step behind cuda's contract for packed batches: it takes them as they
    are (recording them) and checks their values itself, as the step kernel does."""

    takes_packed = True
    checks_values = True
    feature_dtypes = FEATURE_DTYPES[1:]   # 16-bit features as they are, as cuda takes them

    def __init__(self, config, state):
        super().__init__(config, state)
        self.uploaded: list = []

    def upload(self, batch):
        if isinstance(batch, PackedBatch):   # as cuda, it trusts the learner's checks
            assert batch.hidden_dim == self.config.hidden_dim, "H unchecked"
            assert batch.size <= LIMITS.max_batch_size, "B unchecked"
        self.uploaded.append(batch)
        return None

    def propose(self, batch, upload=None):
        arrays = batch.batch() if isinstance(batch, PackedBatch) else batch
        try:
            validate_batch(arrays, self.config, 1 << 30)
        except (InvalidArgument, ResourceExhausted):   # as the kernel reports it
            empty = np.zeros(0, np.float32)
            return StepOutputs(0.0, empty, empty, 0.0, 0.0, True, None, inputs_valid=False)
        return super().propose(arrays, upload)


def _service(backend: str | type = "reference") -> LearnerService:
    service = LearnerService(LIMITS)
    learner = Learner(SMALL, backend="reference", max_batch_size=LIMITS.max_batch_size)
    if backend is PackedReference:
        learner = Learner(SMALL, backend=PackedReference(SMALL, learner.snapshot()),
                          max_batch_size=LIMITS.max_batch_size)
    service.attach(learner)
    return service


def _both(service: LearnerService, data: bytes) -> tuple:
    """(the step's response or refusal through relay_prepare_packed, through relay_prepare)
    on two services over learners in the same state."""
    buffer = _buffer()
    descriptor = Packer().pack(data, buffer)
    assert descriptor is not None
    twin = _service(type(service.learner.backend) if isinstance(service.learner.backend,
                                                                  PackedReference)
                    else "reference")
    twin.learner.load(service.learner.snapshot())

    def answer(service: LearnerService, prepare):
        try:
            with prepare() as job:   # answered in bytes
                response = service.apply_train(job, None)
        except Exception as exc:  # noqa: BLE001 — compared as the client would see it
            return refusal(exc, "TrainStream", "test")
        assert isinstance(response, EncodedTrainResponse)
        parsed = pb.TrainResponse.FromString(response.SerializeToString())
        assert parsed.SerializeToString() == response.SerializeToString()   # canonical
        return parsed
    packed = answer(service, lambda: service.relay_prepare_packed(*read_packed(
        descriptor, memoryview(buffer), buffer.ctypes.data), "TrainStream"))
    unpacked = answer(twin, lambda: twin.relay_prepare(memoryview(data), "TrainStream"))
    return packed, unpacked


@pytest.mark.parametrize("backend", ["reference", PackedReference])
@pytest.mark.parametrize("wire", WIRES)
def test_a_packed_request_steps_and_is_answered_as_its_bytes_are(backend, wire):
    service = _service(backend)
    rng = np.random.default_rng(4)
    for seq in (1, 2):
        data = encode_batch_wire(random_batch(rng, 16), feature_dtype=wire, actor_id="a",
                                 seq=seq)
        packed, unpacked = _both(service, data)
        assert isinstance(packed, pb.TrainResponse) and packed == unpacked
    if backend is PackedReference:
        assert all(isinstance(b, PackedBatch) for b in service.learner.backend.uploaded)


def _bad_values(batch: Batch) -> Batch:
    batch.rewards[3] = np.nan
    return batch


@pytest.mark.parametrize("backend", ["reference", PackedReference])
@pytest.mark.parametrize("why, config_rows, make", [
    ("H other than the learner's", 4, lambda rng: Batch(
        *(np.zeros((4, 8), np.float32),) * 2, *random_batch(rng, 4).arrays()[2:])),
    ("B over the limit", 65, lambda rng: random_batch(rng, 65)),
    ("a reward that is NaN", 4, lambda rng: _bad_values(random_batch(rng, 4))),
    ("an action out of range", 4, lambda rng: Batch(
        *random_batch(rng, 4).arrays()[:2], np.array([0, 1, 9, 2], np.int32),
        *random_batch(rng, 4).arrays()[3:])),
])
def test_a_packed_request_is_refused_in_the_words_its_bytes_get(backend, why, config_rows,
                                                                make):
    service = _service(backend)
    batch = make(np.random.default_rng(5))
    data = encode_batch_wire(batch, actor_id="a", seq=1)
    packed, unpacked = _both(service, data)
    assert isinstance(packed, tuple) and packed == unpacked, why
    assert service.learner.step_count == 0
    if backend is PackedReference and why.startswith(("H", "B")):   # refused before upload
        assert not any(isinstance(b, PackedBatch) for b in service.learner.backend.uploaded)


def test_a_packed_request_with_a_bad_key_is_refused_as_its_bytes_are():
    batch = random_batch(np.random.default_rng(6), 4)
    packed, unpacked = _both(_service(), encode_batch_wire(batch, actor_id="a", seq=0))
    assert packed == unpacked and packed[1].startswith("key.seq")


def _relayed(work: RelayWork, buffers: BufferPool, pack, method: str,
             requests: list[bytes]) -> list:
    """The replies to ``requests`` sent on one stream of ``method`` through a front that
    packs with ``pack`` to a relay learner doing ``work``."""
    learner_end, front_end = socket.socketpair()
    learner = RelayLearner(learner_end, buffers, work)
    learner.start()
    front = RelayFront(front_end, buffers, pack)
    try:
        stream = front.open(method=method, deadline=None)
        for data in requests:
            assert stream.submit(data) is None
        answers = replies(stream, len(requests))
        stream.close()
    finally:
        front.close()
        learner.close()
    return answers


def test_the_relay_carries_packed_requests_and_the_rest_as_they_came():
    """Through a RelayFront that packs: a request that packs reaches prepare_packed with its
    arrays in its buffer; one that does not (uint8 actions), and one larger than a buffer (sent
    inline), reach prepare as their bytes.  A relay that takes no packed requests refuses
    them (INTERNAL), answering each."""
    rng = np.random.default_rng(7)
    small, big = random_batch(rng, 4), random_batch(rng, 40)
    requests = [encode_batch_wire(small, actor_id="a", seq=1),
                _request(small, actions=small.actions.astype(np.uint8)),
                encode_batch_wire(big, actor_id="a", seq=2)]
    seen: list = []

    def prepare(data, unary):
        seen.append(("bytes", bytes(data)))
        return types.SimpleNamespace(close=lambda: None)

    def prepare_packed(packed, key, method):
        seen.append(("packed", packed.batch(), pb.RequestKey.FromString(key)))
        return types.SimpleNamespace(close=lambda: None)

    for takes_packed in (True, False):
        seen.clear()
        work = RelayWork(prepare, lambda job, call: b"ok",
                         prepare_packed=prepare_packed if takes_packed else None)
        # B = 40 (≈ 5.8 kB) goes inline
        answers = _relayed(work, BufferPool(4, 2048), Packer().pack, "TrainStream", requests)
        if takes_packed:
            assert answers == [(grpc.StatusCode.OK, b"ok")] * 3
            assert [s[0] for s in seen] == ["packed", "bytes", "bytes"]
            _same_arrays(seen[0][1], small)
            assert seen[0][2] == pb.RequestKey(actor_id="a", seq=1)
            assert seen[1][1] == requests[1] and seen[2][1] == requests[2]
        else:   # refused at the first: the stream's later requests are not applied
            assert answers == [(grpc.StatusCode.INTERNAL,
                                b"a packed request reached a relay that takes none")] * 3


def test_an_insert_streams_requests_pack_as_train_requests_do():
    """An InsertStream's request (TrainRequest's framing, priorities in field 7) packs in the
    front as a train request does and reaches prepare_packed with its method, priorities in
    the weights' place."""
    from duelq.client.client import _transition_arrays, _wire_request
    from duelq.wire.tensors import INSERT_FIELDS
    from duelq.wire.types import Transitions
    rng = np.random.default_rng(9)
    batch = random_batch(rng, 4)
    priorities = rng.uniform(0.5, 2.0, 4).astype(np.float32)
    t = Transitions(batch.h_t, batch.h_tp1, batch.actions, batch.rewards, batch.dones,
                    batch.discounts, priorities)
    data = _wire_request(_transition_arrays(t, "float32"), "a", 1, INSERT_FIELDS)
    seen: list = []

    def prepare_packed(packed, key, method):
        seen.append((method, packed.batch(), pb.RequestKey.FromString(key)))
        return types.SimpleNamespace(close=lambda: None)
    work = RelayWork(lambda *a: pytest.fail("an insert that packs went as its bytes"),
                     lambda job, call: b"ok", prepare_packed=prepare_packed)
    assert _relayed(work, BufferPool(2, 2048), Packer().pack, "InsertStream",
                    [data]) == [(grpc.StatusCode.OK, b"ok")]
    [(method, got, key)] = seen
    assert method == "InsertStream" and key == pb.RequestKey(actor_id="a", seq=1)
    _same_arrays(got, dataclasses.replace(batch, weights=priorities))


@pytest.mark.parametrize("op, buffer, size", [("PACKED", 7, 10), ("PACKED", -2, 10),
                                              ("REQ", 4, 0), ("REQ", relay.INLINE - 9, 10),
                                              ("REQ", 1, 2049)])
def test_a_request_frame_naming_no_buffer_of_its_front_shuts_that_front(op, buffer, size,
                                                                        caplog):
    """A frame whose buffer is not one of its front's, or whose bytes overrun it (a front
    bug): nothing is prepared, no buffer is answered on, and that front's connection is
    shut (here the first front's, which ends the relay)."""
    prepared: list = []
    learner_end, front_end = socket.socketpair()
    learner = RelayLearner(learner_end, BufferPool(4, 2048), RelayWork(
        lambda *a: prepared.append(a), lambda job, call: b"ok",
        prepare_packed=lambda *a: prepared.append(a)))
    learner.start()
    try:
        inline = op == "PACKED" or buffer < 0   # its bytes follow the frame
        front_end.settimeout(10)
        front_end.sendall(relay._FRAME.pack(relay.OPEN, 1, 0, 0, 0.0)
                          + relay._FRAME.pack(getattr(relay, op), 1, buffer, size, 0.0)
                          + (b"x" * size if inline else b""))
        assert learner.closed.wait(10)
        assert front_end.recv(16) == b""   # shut: no reply came
        assert prepared == [] and "sent a request of" in caplog.text
    finally:
        front_end.close()
        learner.close()


def test_a_request_whose_packing_fails_goes_as_it_came_and_one_that_packs_smaller_fits(caplog):
    """A packing fault sends the request unpacked (logged); a request larger than a buffer
    whose packed arrays fit goes packed, not inline."""
    rng = np.random.default_rng(8)
    data = encode_batch_wire(random_batch(rng, 8), actor_id="a", seq=1)
    _, words = packed_layout(8, 16, 4, True)
    seen: list = []

    def failing(data, buffer, address):
        raise RuntimeError("a packing fault (simulated)")
    for pack, size, want in ((failing, 4096, "bytes"), (Packer().pack, 4 * words, "packed")):
        assert 4 * words < len(data) and (size >= len(data)) == (want == "bytes")
        seen.clear()
        work = RelayWork(
            lambda *a: seen.append("bytes") or types.SimpleNamespace(close=lambda: None),
            lambda job, call: b"ok",
            prepare_packed=lambda *a: seen.append("packed") or types.SimpleNamespace(
                close=lambda: None))
        assert _relayed(work, BufferPool(2, size), pack, "TrainStep",
                        [data]) == [(grpc.StatusCode.OK, b"ok")]
        assert seen == [want]
    assert "packing a request of stream 1 failed" in caplog.text


def test_the_relay_sleeps_once_a_second_front_has_come_and_gone():
    """A front that attaches (the wake) and then closes (no longer watched) leaves the
    relay thread waiting, not spinning."""
    first_end, first_front = socket.socketpair()
    learner = RelayLearner(first_end, BufferPool(2, 1024),
                           RelayWork(lambda *a: None, lambda job, call: b"ok"))
    learner.start()
    second_end, second_front = socket.socketpair()
    try:
        learner.attach(second_end, BufferPool(2, 1024))
        time.sleep(0.2)
        second_front.close()
        time.sleep(0.2)
        clock = time.pthread_getcpuclockid(learner.thread.ident)
        spent = time.clock_gettime(clock)
        time.sleep(0.5)
        assert time.clock_gettime(clock) - spent < 0.05   # asleep in its poll
    finally:
        first_front.close()
        learner.close()


def test_a_relay_whose_first_front_closed_reads_no_other_front_while_it_drains():
    """Once the first front has closed, the relay only drains what it has: a stream that
    another front opens meanwhile is never read.  The first front's three requests: the
    first steps (held), the second is prepared, the third received; the front closes; the
    second is answered (cancelled, its close held while the other front sends) and the
    relay still looks once before it answers the third."""
    first_end, first_front = socket.socketpair()
    second_end, second_front = socket.socketpair()
    prepared: list = []
    held, go = threading.Event(), threading.Event()

    def hold() -> None:
        held.set()
        assert go.wait(10)
        go.clear()

    def prepare(data, unary):
        prepared.append(bytes(data))
        return types.SimpleNamespace(close=hold if bytes(data) == b"two" else lambda: None)

    def apply(job, call):
        hold()
        return b"ok"
    first = BufferPool(3, 64)
    learner = RelayLearner(first_end, first, RelayWork(prepare, apply))
    learner.start()
    second = BufferPool(1, 64)
    try:
        learner.attach(second_end, second)
        frames = relay._FRAME.pack(relay.OPEN, 1, 0, 0, 0.0)
        for i, data in enumerate((b"one", b"two", b"six")):
            first.write(i, data)
            frames += relay._FRAME.pack(relay.REQ, 1, i, 3, 0.0)
        first_front.sendall(frames)
        assert held.wait(10)   # "one" steps
        held.clear()
        first_front.close()
        go.set()
        assert held.wait(10)   # "two" is answered, cancelled: its close holds
        second.write(0, b"new")
        second_front.sendall(relay._FRAME.pack(relay.OPEN, 1, 0, 0, 0.0)
                             + relay._FRAME.pack(relay.REQ, 1, 0, 3, 0.0))
        time.sleep(0.2)
        go.set()
        learner.thread.join(10)   # drained and ended
        assert not learner.thread.is_alive() and prepared == [b"one", b"two", b"six"]
    finally:
        go.set()
        second_front.close()
        learner.close()


def test_a_packer_with_the_stream_copy_writes_the_same_buffer():
    """The large arrays go through the stream copy, the small ones are copied as before,
    and the buffer's bytes are those of a plain Packer's."""
    from duelq.server.core import native
    try:
        stream = native.load(cuda=False).stream_copy
    except native.NativeUnavailable as exc:
        pytest.skip(str(exc))
    calls = []

    def counted(address: int, data: bytes, offset: int, n: int) -> None:
        calls.append(n)
        stream(address, data, offset, n)
    rows = STREAM_MIN_BYTES // (4 * SMALL.hidden_dim) + 3   # features just over the bar
    rng = np.random.default_rng(12)
    for wire, large in (("float32", 2), ("float16", 0)):
        calls.clear()
        data = encode_batch_wire(random_batch(rng, rows), feature_dtype=wire, actor_id="a",
                                 seq=1)
        plain, streamed = _buffer(1 << 20), _buffer(1 << 20)
        want = Packer().pack(data, plain)
        got = Packer(counted).pack(data, streamed[1:], streamed.ctypes.data + 1)  # unaligned
        assert got == want and streamed[1:].tobytes() == plain[:-1].tobytes()
        assert calls == [4 // (1 + (wire == "float16")) * rows * SMALL.hidden_dim] * large


@pytest.mark.parametrize("first", [0, 5, 24, 30, 24 + 1000])
def test_a_front_sends_a_frame_and_its_payload_whole_however_far_one_call_gets(first):
    """RelayFront._send: one sendmsg for frame and payload; whatever it leaves unsent (a
    signal, a full socket) follows, so the learner reads the same bytes."""
    class Socket:
        def __init__(self):
            self.out = bytearray()

        def sendmsg(self, buffers):
            data = b"".join(buffers)
            self.out += data[:first]
            return min(first, len(data))

        def sendall(self, data):
            self.out += data
    frame, payload = bytes(range(24)), bytes(range(256)) * 4
    front = types.SimpleNamespace(_sock=Socket(), _send_lock=threading.Lock())
    RelayFront._send(front, frame, payload)
    assert bytes(front._sock.out) == frame + payload
    front._sock.out.clear()
    RelayFront._send(front, frame)   # no payload: the frame alone
    assert bytes(front._sock.out) == frame


@pytest.mark.parametrize("key", [
    b"\x10\x01\x0a\x01a",           # seq before actor_id
    b"\x0a\x01a\x10\x81\x80\x00",   # seq 1 in a padded varint
    b"\x0a\x01b\x0a\x01a\x10\x01",  # actor_id twice: the last one counts
])
def test_a_non_canonical_key_is_answered_in_canonical_bytes(key):
    """The front sends the key's canonical bytes, so the learner's encoded answer is the
    one the unpacked request gets, byte for byte."""
    batch = random_batch(np.random.default_rng(8), 4)
    data = encode_batch_wire(batch) + b"\x42" + bytes([len(key)]) + key   # key: field 8
    assert pb.TrainRequest.FromString(data).key == pb.RequestKey(actor_id="a", seq=1)
    descriptor = Packer().pack(data, _buffer())
    assert descriptor[DESCRIPTOR.size:] == pb.RequestKey(actor_id="a", seq=1).SerializeToString()
    packed, unpacked = _both(_service(), data)
    assert packed.SerializeToString() == unpacked.SerializeToString()
