"""Request plans (server/plans.py): a request of a layout seen before must give the very
batch, key and refusals that the full parse, decode and checks give."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from duelq.client.client import encode_batch_wire
import threading

from duelq.server.batch import BFLOAT16, Batch
from duelq.server.errors import InvalidArgument
from duelq.server.learner import Learner
from duelq.server.reference import ReferenceBackend
from duelq.server.state import LearnerState
from duelq.server.service import LearnerService, Limits, decode_batch
from duelq.server.wire import known_layout, parse_train_request

from conftest import SMALL, random_batch

LIMITS = Limits(max_message_bytes=1 << 24, max_batch_size=256, max_streams=4)
KEEP_16BIT = (np.dtype(np.float16), BFLOAT16)


class DeviceChecked(ReferenceBackend):
    """The reference step behind cuda's contract: it says it checks values itself, so the
    learner skips the host checks of a planned batch, and it records what upload gets."""

    checks_values = True

    def __init__(self, config, state):
        super().__init__(config, state)
        self.uploaded: list[Batch] = []

    def upload(self, batch):
        self.uploaded.append(batch)
        return None


def service_for(config=SMALL, keep_16bit: bool = False) -> LearnerService:
    """A service over a reference learner; ``keep_16bit``: its backend takes 16-bit
    features as they are (as the cuda backend does; the reference step widens them to
    float64 like any other input)."""
    service = LearnerService(LIMITS)
    learner = Learner(config, backend="reference", max_batch_size=LIMITS.max_batch_size)
    if keep_16bit:
        learner.backend.feature_dtypes = KEEP_16BIT
    service.attach(learner)
    return service


class Pool:
    """Request bytes written in place at an odd offset, as the front's slots hold them."""

    def __init__(self, size: int = 1 << 20):
        self.buffer = np.zeros(size, np.uint8)

    def put(self, data: bytes, offset: int = 3) -> tuple[memoryview, int]:
        self.buffer[offset:offset + len(data)] = np.frombuffer(data, np.uint8)
        return self.buffer.data[offset:offset + len(data)], self.buffer.ctypes.data + offset


def relay(service: LearnerService, pool: Pool, data: bytes):
    """``service.relay_prepare`` of ``data`` written in ``pool`` (a TrainStream request)."""
    view, address = pool.put(data)
    return service.relay_prepare(view, False, address)


def same_batch(got: Batch, want: Batch) -> None:
    for a, b in zip(got.arrays(), want.arrays()):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    assert (got.weights is None) == (want.weights is None)
    assert got.span == want.span


def request(rng, rows: int, wire: str, weights: bool, seq: int, actor: str = "actor-1",
            config=SMALL) -> bytes:
    return encode_batch_wire(random_batch(rng, rows, config, weights=weights),
                             feature_dtype=wire, actor_id=actor, seq=seq)


@settings(max_examples=60, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.integers(1, 40), wire=st.sampled_from(["float32", "float16", "bfloat16"]),
       weights=st.booleans(), keep_16bit=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_a_planned_request_gives_what_the_full_path_gives(rows, wire, weights, keep_16bit,
                                                         seed):
    rng = np.random.default_rng(seed)
    service, pool = service_for(keep_16bit=keep_16bit), Pool()
    first = request(rng, rows, wire, weights, seq=10)
    with relay(service, pool, first):
        pass
    layout = known_layout(first)
    planned = service._plans.get(layout) is not None
    # A plan only where every array was a view of its bytes and passed unchanged.
    assert planned == (wire == "float32" or keep_16bit)
    for seq in (11, 99):   # same framing, other values and key
        data = request(rng, rows, wire, weights, seq=seq)
        assert known_layout(data) is layout
        view, address = pool.put(data)
        with service.relay_prepare(view, False, address) as job:
            want = service.learner.prepare(decode_batch(
                parse_train_request(data), keep_16bit=keep_16bit, address=address))
            same_batch(job.prepared.batch, want.batch)
            assert (job.key.actor_id, job.key.seq) == ("actor-1", seq)
            batch = job.prepared.batch
            if planned:   # views of the slot, where the span says
                assert all(a.ctypes.data == address + o
                           for a, o in zip(batch.arrays(), batch.span.offsets))


def test_a_planned_request_over_grpc_steps_as_a_protobuf_parsed_one(make_server):
    """The one-process server's path: the same layout three times, then its steps against a
    learner fed the same batches."""
    from duelq.client import LearnerClient
    server = make_server()
    twin = Learner(SMALL, backend="reference")
    rng = np.random.default_rng(4)
    with LearnerClient(server.target) as client:
        for seq in range(1, 4):
            batch = random_batch(rng, 12, weights=seq != 2)
            got = client.train_step(batch)
            want = twin.step(batch)
            assert got.td_errors.tobytes() == want.td_errors.tobytes()
            assert got.loss == want.loss
    assert server.learner.snapshot().checksum() == twin.snapshot().checksum()


def test_a_planned_layout_still_has_its_values_checked():
    """On a backend that does not check values itself, a planned request's values are
    checked on the host, with the full path's message."""
    rng = np.random.default_rng(1)
    service, pool = service_for(), Pool()
    first = request(rng, 8, "float32", True, seq=1)
    with relay(service, pool, first):
        pass
    assert service._plans.get(known_layout(first)) is not None
    bad = random_batch(rng, 8)
    bad.rewards[5] = np.nan
    data = encode_batch_wire(bad, actor_id="actor-1", seq=2)
    with pytest.raises(InvalidArgument, match="rewards.*NaN or Inf.*index 5"):
        relay(service, pool, data)


def test_a_refused_layout_gets_no_plan_and_plans_go_with_the_learner():
    """A layout whose request the learner refused is refused again alike; a new learner
    (attach) does not inherit the old one's plans, whose shapes it may refuse."""
    rng = np.random.default_rng(2)
    wide = replace(SMALL, hidden_dim=SMALL.hidden_dim + 1)
    service, pool = service_for(), Pool()
    data = request(rng, 6, "float32", False, seq=1, config=wide)   # H too wide for SMALL
    for _ in range(2):
        with pytest.raises(InvalidArgument, match="h_t"):
            relay(service, pool, data)
        assert service._plans.get(known_layout(data)) is None
    ok = request(rng, 6, "float32", False, seq=2)
    with relay(service, pool, ok):
        pass
    assert service._plans.get(known_layout(ok)) is not None
    other = Learner(replace(SMALL, hidden_dim=SMALL.hidden_dim - 1), backend="reference")
    service.attach(other)
    assert service._plans.get(known_layout(ok)) is None
    with pytest.raises(InvalidArgument, match="h_t"):
        relay(service, pool, request(rng, 6, "float32", False, seq=3))


def test_a_planned_layout_with_an_unreadable_key_is_refused_as_upb_refuses_it():
    rng = np.random.default_rng(3)
    service, pool = service_for(), Pool()
    good = request(rng, 5, "float32", True, seq=1, actor="ab")
    with relay(service, pool, good):
        pass
    bad = bytearray(request(rng, 5, "float32", True, seq=1, actor="ab"))
    at = bytes(bad).rindex(b"ab")
    bad[at:at + 2] = b"\xff\xfe"                 # actor_id no longer UTF-8, same length
    assert known_layout(bytes(bad)) is known_layout(good)
    with pytest.raises(InvalidArgument, match="cannot parse as the TrainStream request"):
        relay(service, pool, bytes(bad))


@pytest.mark.parametrize("odd", ["actions uint8", "dones bool", "dones uint8",
                                 "rewards float16"])
def test_a_layout_with_converted_arrays_gets_no_plan(odd):
    """Arrays the checks convert (narrow actions, bool or 16-bit vectors) are new arrays, not
    views of the request: no plan, so no such batch reaches a backend unchecked, and each
    request is still read and stepped as the full path reads it."""
    field, dtype = odd.split()
    rng = np.random.default_rng(5)
    config = SMALL
    learner = Learner(config, backend=DeviceChecked(config, LearnerState.initial(config)))
    service, pool = LearnerService(LIMITS), Pool()
    service.attach(learner)
    for seq in (1, 2):
        batch = random_batch(rng, 9)
        batch = replace(batch, **{field: getattr(batch, field).astype(dtype)})
        data = encode_batch_wire(batch, actor_id="a", seq=seq)
        with relay(service, pool, data) as job:
            assert service._plans.get(known_layout(data)) is None
            assert job.prepared.batch.actions.dtype == np.int32
            assert all(a.dtype in (np.float32, np.int32) for a in job.prepared.batch.arrays())


def test_a_planned_batch_reaches_a_value_checking_backend_as_the_checked_one():
    """The path cuda takes: the learner skips its host checks for a planned batch; what the
    backend's upload gets is the batch the full path would have checked and given it."""
    rng = np.random.default_rng(6)
    learner = Learner(SMALL, backend=DeviceChecked(SMALL, LearnerState.initial(SMALL)))
    service, pool = LearnerService(LIMITS), Pool()
    service.attach(learner)
    for seq in range(1, 4):
        data = request(rng, 11, "float32", seq % 2 == 1, seq=seq)
        view, address = pool.put(data)
        with service.relay_prepare(view, False, address):
            pass
        want = learner.prepare(decode_batch(parse_train_request(data), address=address)).batch
        same_batch(learner.backend.uploaded[-2], want)
    assert service._plans.get(known_layout(data)) is not None


def test_a_plan_learned_while_a_new_learner_is_attached_stays_with_the_old_one():
    """A request prepared under the old learner finishes after attach(new): its plan must
    not serve the new learner, which checks that layout's shapes itself (and refuses)."""
    rng = np.random.default_rng(7)
    old = Learner(SMALL, backend="reference", max_batch_size=LIMITS.max_batch_size)
    narrow = replace(SMALL, hidden_dim=SMALL.hidden_dim - 1)
    new = Learner(narrow, backend=DeviceChecked(narrow, LearnerState.initial(narrow)))
    service, pool = LearnerService(LIMITS), Pool()
    service.attach(old)
    inside, go = threading.Event(), threading.Event()
    prepare = old.prepare

    def slow_prepare(batch, **kwargs):
        prepared = prepare(batch, **kwargs)
        inside.set()
        go.wait(10)
        return prepared
    old.prepare = slow_prepare
    first = request(rng, 6, "float32", True, seq=1)
    buffer = Pool()
    thread = threading.Thread(target=lambda: relay(service, buffer, first).close())
    thread.start()
    assert inside.wait(10)
    service.attach(new)
    go.set()
    thread.join(10)
    with pytest.raises(InvalidArgument, match="h_t: shape must be"):
        relay(service, pool, request(rng, 6, "float32", True, seq=2))
