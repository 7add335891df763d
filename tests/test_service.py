"""The server through the wire: raw stubs against a real in-process server.

Covers stream order, the global order of concurrent streams, idempotency,
every bad input of docs/design.md §7 (state untouched, server still serving),
limits, health transitions, auth, TLS and internal errors.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from duelq.client import LearnerClient, encode_batch
from duelq.client.client import encode_batch_wire
from duelq.server.core.errors import InvalidArgument, ResourceExhausted
from duelq.wire.tensors import decode, encode
from duelq.server.core.config import LearnerConfig
from duelq.server.idempotency import AlreadyApplied, KeyGuard
from duelq.server.core.learner import Learner, StepResult
from duelq.server.server import LearnerServer, ServerOptions
from duelq.server import framing as wire
from duelq.server.service import (RECORDED_KINDS, EncodedTrainResponse, LearnerService,
                                  train_response)
from duelq.v1 import learner_pb2 as pb
from duelq.v1 import learner_pb2_grpc as pb_grpc

from conftest import SMALL, random_batch

H, N = SMALL.hidden_dim, SMALL.n_actions
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture
def rng():
    return np.random.default_rng(7)


def stub(target: str, **kw) -> pb_grpc.LearnerStub:
    return pb_grpc.LearnerStub(grpc.insecure_channel(target, **kw))


def train_request(rng, rows=8, actor="", seq=0, **kw) -> pb.TrainRequest:
    request = encode_batch(random_batch(rng, rows, **kw))
    request.key.CopyFrom(pb.RequestKey(actor_id=actor, seq=seq))
    return request


def code_of(call, *args, **kw) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kw)
    return info.value.code(), info.value.details()


# -- order ------------------------------------------------------------------------------

def test_stream_answers_each_request_in_order(server, rng):
    requests = [train_request(rng, actor="a", seq=i + 1) for i in range(30)]
    responses = list(stub(server.target).TrainStream(iter(requests)))
    assert [r.key.seq for r in responses] == list(range(1, 31))
    assert [r.step for r in responses] == list(range(1, 31))
    assert all(r.version == r.step and not r.replayed for r in responses)
    assert server.learner.step_count == 30


def test_concurrent_streams_equal_sequential_replay_in_server_order(server):
    streams, steps, rows = 8, 40, 16
    batches = {s: [random_batch(np.random.default_rng(100 + s), rows) for _ in range(steps)]
               for s in range(streams)}
    applied: dict[int, object] = {}
    failures: list[BaseException] = []

    def actor(s: int) -> None:
        try:
            with LearnerClient(server.target, actor_id=f"actor-{s}") as client:
                for batch, result in zip(batches[s], client.train_stream(batches[s], window=4)):
                    applied[result.step] = batch
        except BaseException as exc:  # noqa: BLE001 — reported below
            failures.append(exc)

    threads = [threading.Thread(target=actor, args=(s,)) for s in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not failures
    assert sorted(applied) == list(range(1, streams * steps + 1))  # none lost or doubled
    assert server.learner.step_count == streams * steps

    sequential = Learner(SMALL, backend="reference")
    for step in sorted(applied):
        sequential.step(applied[step])
    assert server.learner.snapshot().checksum() == sequential.snapshot().checksum()


# -- idempotency ------------------------------------------------------------------------

def test_retried_key_returns_recorded_result_without_applying(server, rng):
    s = stub(server.target)
    request = train_request(rng, actor="a", seq=1)
    first = s.TrainStep(request)
    after_first = server.learner.snapshot().checksum()
    again = s.TrainStep(request)
    streamed = next(s.TrainStream(iter([request])))
    assert (first.replayed, again.replayed, streamed.replayed) == (False, True, True)
    for replay in (again, streamed):
        assert replay.step == first.step == 1 and replay.loss == first.loss
        assert np.array_equal(decode(replay.td_errors, "x"), decode(first.td_errors, "x"))
    assert server.learner.step_count == 1
    assert server.learner.snapshot().checksum() == after_first


def test_keys_may_arrive_out_of_order_and_entropy_is_keyed_too(server, rng):
    s = stub(server.target)
    assert s.TrainStep(train_request(rng, actor="a", seq=5)).step == 1
    assert s.TrainStep(train_request(rng, actor="a", seq=3)).step == 2
    assert s.TrainStep(train_request(rng, actor="b", seq=5)).step == 3
    entropy = pb.ComputeEntropyRequest(actions=encode(np.array([0, 1, 1], np.int32), "a"),
                                       slot=pb.SlotRef(name="policy_entropy_ema"), alpha=0.5,
                                       key=pb.RequestKey(actor_id="a", seq=6))
    first, again = s.ComputeEntropy(entropy), s.ComputeEntropy(entropy)
    assert not first.replayed and again.replayed and again.ema == first.ema
    code, details = code_of(s.TrainStep, train_request(rng, actor="a", seq=6))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("key.seq")
    assert server.learner.step_count == 3


def test_key_whose_result_was_evicted_is_refused_not_reapplied(make_server, rng):
    server = make_server(recorded_responses=0)
    s = stub(server.target)
    old, latest = train_request(rng, actor="a", seq=1), train_request(rng, actor="a", seq=2)
    s.TrainStep(old)
    s.TrainStep(latest)
    assert s.TrainStep(latest).replayed  # an actor's latest result is always kept
    code, details = code_of(s.TrainStep, old)
    assert code == grpc.StatusCode.ALREADY_EXISTS and "a/1" in details
    assert server.learner.step_count == 2


def test_key_guard_window_and_actor_bound():
    now = [0.0]
    guard = KeyGuard(capacity=2, window=4, max_actors=2, idle_s=60, clock=lambda: now[0])
    for seq in (1, 2, 3, 4, 5):
        assert guard.lookup("a", seq, str) is None
        guard.record("a", seq, f"r{seq}")
    assert guard.lookup("a", 5, str) == "r5" and guard.lookup("a", 4, str) == "r4"
    with pytest.raises(AlreadyApplied):   # applied, response evicted (capacity 2)
        guard.lookup("a", 2, str)
    with pytest.raises(AlreadyApplied):   # older than the window
        guard.lookup("a", 1, str)
    guard.record("a", 10**12, "far")      # a huge jump resets the bitmap, no huge ints
    assert guard.lookup("a", 10**12 - 1, str) is None
    guard.record("b", 1, "b1")
    now[0] = 59
    with pytest.raises(ResourceExhausted, match="max_actors 2"):   # "a" and "b" are recent:
        guard.lookup("c", 1, str)                                  # refused, none forgotten
    assert guard.lookup("a", 10**12, str) == "far" and guard.lookup("b", 1, str) == "b1"
    now[0] = 59 + 60                      # "a" seen last at 59, "b" too: both idle 60 s
    assert guard.lookup("c", 1, str) is None
    guard.record("c", 1, "c1")            # takes the place of the least recently seen, "a"
    assert guard.lookup("b", 1, str) == "b1" and list(guard._actors) == ["c", "b"]
    with pytest.raises(ResourceExhausted):   # "a" is new again, and "b" and "c" recent
        guard.lookup("a", 10**12, str)


def _guard_with_records() -> KeyGuard:
    guard = KeyGuard(capacity=3, window=8)
    for actor, seqs in (("a", (1, 2, 3, 7)), ("b", (1,)), ("c", (2, 4))):
        for seq in seqs:
            guard.record(actor, seq, pb.TrainResponse(step=seq, loss=0.5 * seq, key=pb.RequestKey(
                actor_id=actor, seq=seq)) if actor != "b" else pb.ComputeEntropyResponse(ema=1.5))
    return guard


def _same_records(a: KeyGuard, b: KeyGuard) -> None:
    assert a.window == b.window and list(a._actors) == list(b._actors)
    assert list(a._responses) == list(b._responses)  # LRU order kept
    for actor, seq in [("a", 7), ("a", 3), ("a", 2), ("b", 1), ("c", 4), ("c", 2)]:
        kind = pb.ComputeEntropyResponse if actor == "b" else pb.TrainResponse
        assert a.lookup(actor, seq, kind) == b.lookup(actor, seq, kind)
    with pytest.raises(AlreadyApplied):
        b.lookup("a", 1, pb.TrainResponse)  # applied; its response fell out of the cache


def test_idempotency_records_round_trip_in_format_2():
    guard = _guard_with_records()
    data = guard.to_bytes()
    assert data.startswith(b"DQR2")
    _same_records(guard, KeyGuard.from_bytes(data, RECORDED_KINDS, capacity=3))


def test_idempotency_records_without_last_seen_times_count_as_seen_now():
    guard = _guard_with_records()
    data = _edit_index(guard.to_bytes(), lambda i: [actor.pop() for actor in i["actors"]])
    restored = KeyGuard.from_bytes(data, RECORDED_KINDS, capacity=3, clock=lambda: 1234.5)
    _same_records(guard, restored)
    assert [actor.last for actor in restored._actors.values()] == [1234.5] * 3


def _edit_index(data: bytes, edit) -> bytes:
    """Format-2 records with their JSON index changed by ``edit(index)``."""
    import json
    length = int.from_bytes(data[4:12], "little")
    index = json.loads(data[12:12 + length])
    edit(index)
    text = json.dumps(index).encode()
    return data[:4] + len(text).to_bytes(8, "little") + text + data[12 + length:]


@pytest.mark.parametrize("damage", ["truncated", "trailing", "kind", "reference", "format",
                                    "magic"])
def test_malformed_idempotency_records_are_refused(damage):
    data = _guard_with_records().to_bytes()
    if damage == "truncated":
        data = data[:-5]
    elif damage == "trailing":
        data = data + b"x"
    elif damage == "kind":
        data = _edit_index(data, lambda i: i["blobs"][0].__setitem__(0, "NoSuchResponse"))
    elif damage == "reference":
        data = _edit_index(data, lambda i: i["responses"][0].__setitem__(2, 9999))
    elif damage == "format":
        data = _edit_index(data, lambda i: i.__setitem__("format", 3))
    else:
        data = b"DQR1" + data[4:]
    with pytest.raises(ValueError, match="malformed idempotency records"):
        KeyGuard.from_bytes(data, RECORDED_KINDS)


# -- bad input (docs/design.md §7) --------------------------------------------------------------

def _set(field, array):
    def mutate(request):
        getattr(request, field).CopyFrom(encode(array, field))
    return mutate


def _edit(field, fn):
    """Replace ``field`` by fn(decoded copy)."""
    def mutate(request):
        a = np.array(decode(getattr(request, field), field))
        getattr(request, field).CopyFrom(encode(fn(a), field))
    return mutate


def _truncate(request):
    request.h_t.data = request.h_t.data[:-4]


def _empty(request):
    for name in ("h_t", "h_tp1"):
        getattr(request, name).CopyFrom(encode(np.zeros((0, H), np.float32), name))
    for name in ("actions",):
        getattr(request, name).CopyFrom(encode(np.zeros(0, np.int32), name))
    for name in ("rewards", "dones", "discounts", "weights"):
        getattr(request, name).CopyFrom(encode(np.zeros(0, np.float32), name))


def _put(index, value):
    def fn(a):
        a.reshape(-1)[index] = value
        return a
    return fn


BAD_TRAIN = {
    "h_t wrong dtype": (_edit("h_t", lambda a: a.astype(np.int32)), "h_t"),
    "actions wrong dtype": (_edit("actions", lambda a: a.astype(np.float32)), "actions"),
    "h_t wrong width": (_set("h_t", np.zeros((8, H + 1), np.float32)), "h_t"),
    "h_tp1 wrong rows": (_set("h_tp1", np.zeros((7, H), np.float32)), "h_tp1"),
    "rewards wrong length": (_set("rewards", np.zeros(9, np.float32)), "rewards"),
    "h_t bytes short of shape": (_truncate, "h_t"),
    "dtype unspecified": (lambda r: setattr(r.dones, "dtype", pb.DTYPE_UNSPECIFIED), "dones"),
    "negative dimension": (lambda r: r.rewards.shape.__setitem__(0, -8), "rewards"),
    "missing field": (lambda r: r.ClearField("discounts"), "discounts"),
    "B = 0": (_empty, "actions"),
    "NaN in h_t": (_edit("h_t", _put(3, np.nan)), "h_t"),
    "Inf in h_tp1": (_edit("h_tp1", _put(5, np.inf)), "h_tp1"),
    "NaN in rewards": (_edit("rewards", _put(0, np.nan)), "rewards"),
    "action -1": (_edit("actions", _put(2, -1)), "actions"),
    "action N": (_edit("actions", _put(2, N)), "actions"),
    "discount > 1": (_edit("discounts", _put(1, 1.5)), "discounts"),
    "discount < 0": (_edit("discounts", _put(1, -0.1)), "discounts"),
    "done 0.5": (_edit("dones", _put(4, 0.5)), "dones"),
    "negative weight": (_edit("weights", _put(6, -1.0)), "weights"),
    "seq 0 with actor": (lambda r: setattr(r.key, "actor_id", "x"), "key.seq"),
}


@pytest.mark.parametrize("case", BAD_TRAIN, ids=list(BAD_TRAIN))
def test_bad_train_input_is_invalid_argument_naming_the_field(server, rng, case):
    mutate, field = BAD_TRAIN[case]
    s = stub(server.target)
    s.TrainStep(train_request(rng))
    before = server.learner.snapshot().checksum()
    request = train_request(rng)
    mutate(request)
    for call in (s.TrainStep, lambda r: next(s.TrainStream(iter([r])))):
        code, details = code_of(call, request)
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert details.startswith(f"{field}:"), details
    assert server.learner.snapshot().checksum() == before
    assert s.TrainStep(train_request(rng)).step == 2  # still serving


def _entropy(slot=pb.SlotRef(name="action_entropy_ema"), alpha=0.1, actions=(0, 1, 2)):
    return pb.ComputeEntropyRequest(actions=encode(np.array(actions, np.int32), "actions"),
                                    slot=slot, alpha=alpha)


BAD_OTHER = {
    "unknown slot name": ("ComputeEntropy", _entropy(slot=pb.SlotRef(name="nope")), "slot"),
    "slot index past isv_size": ("ComputeEntropy",
                                 _entropy(slot=pb.SlotRef(index=SMALL.isv_size)), "slot"),
    "no slot": ("ComputeEntropy", _entropy(slot=pb.SlotRef()), "slot"),
    "alpha 0": ("ComputeEntropy", _entropy(alpha=0.0), "alpha"),
    "alpha > 1": ("ComputeEntropy", _entropy(alpha=1.5), "alpha"),
    "alpha NaN": ("ComputeEntropy", _entropy(alpha=math.nan), "alpha"),
    "entropy action N": ("ComputeEntropy", _entropy(actions=(0, N)), "actions"),
    "read unknown slot": ("ReadISV", pb.ReadISVRequest(slots=[pb.SlotRef(index=1), pb.SlotRef(
        name="nope")]), "slots[1]"),
    "act wrong width": ("Act", pb.ActRequest(h=encode(np.zeros((2, H - 1), np.float32), "h")),
                        "h"),
    "act NaN": ("Act", pb.ActRequest(h=encode(np.full((2, H), np.nan, np.float32), "h")), "h"),
}


@pytest.mark.parametrize("case", BAD_OTHER, ids=list(BAD_OTHER))
def test_bad_entropy_isv_and_act_input_is_invalid_argument(server, case):
    method, request, field = BAD_OTHER[case]
    s = stub(server.target)
    before = server.learner.snapshot().checksum()
    code, details = code_of(getattr(s, method), request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(f"{field}:"), details
    assert server.learner.snapshot().checksum() == before
    assert s.ComputeEntropy(_entropy()).slot == SMALL.isv_slots["action_entropy_ema"]


def test_batch_over_the_limit_and_oversized_message_are_resource_exhausted(make_server, rng):
    server = make_server(max_batch_size=32, max_message_bytes=1 << 16)
    s = stub(server.target, options=[("grpc.max_send_message_length", 1 << 24)])
    code, details = code_of(s.TrainStep, train_request(rng, rows=33))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "33" in details
    big = pb.ActRequest(h=encode(np.zeros((1200, H), np.float32), "h"))  # 76.8 kB > 64 KiB
    code, details = code_of(s.Act, big)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details
    assert server.learner.step_count == 0
    assert s.TrainStep(train_request(rng, rows=32)).step == 1


def test_non_finite_step_is_failed_precondition_and_refused(server, rng):
    s = stub(server.target)
    request = train_request(rng)
    request.h_t.CopyFrom(encode(np.full((8, H), 3e38, np.float32), "h_t"))
    before = server.learner.snapshot().checksum()
    code, details = code_of(s.TrainStep, request)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "non-finite" in details
    assert server.learner.snapshot().checksum() == before


def test_internal_error_leaks_no_traceback(server, monkeypatch):
    def broken(*args):
        raise RuntimeError("secret detail of the backend")
    monkeypatch.setattr(server.learner.backend, "q_values", broken)
    s = stub(server.target)
    code, details = code_of(s.Act, pb.ActRequest(h=encode(np.zeros((1, H), np.float32), "h")))
    assert code == grpc.StatusCode.INTERNAL
    assert "secret" not in details and "Traceback" not in details and "ref" in details
    assert s.GetInfo(pb.GetInfoRequest()).backend == "reference"


# -- limits, health, auth, TLS ----------------------------------------------------------

def test_stream_and_rpc_concurrency_limits(make_server, rng):
    server = make_server(max_streams=1, max_rpcs=2)
    channel = grpc.insecure_channel(server.target)
    s = pb_grpc.LearnerStub(channel)
    release = threading.Event()
    requests = [train_request(rng, actor="a", seq=i + 1) for i in range(2)]

    def held(items):
        yield items[0]
        release.wait(30)
        yield from items[1:]
    first = s.TrainStream(held(requests))
    assert next(first).step == 1                 # the one stream allowed is open
    code, details = code_of(lambda: next(s.TrainStream(iter([train_request(rng)]))))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "TrainStreams" in details
    # gRPC counts the refused stream until its termination has run on the server, a moment
    # after the client saw it: until then a second rpc may still be refused.
    deadline = time.monotonic() + 10
    while True:
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            held([reflection_pb2.ServerReflectionRequest(list_services="")]))
        try:
            answer = next(reflect)
            break
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    assert "duelq.v1.Learner" in str(answer)   # a second running rpc...
    code, details = code_of(s.GetInfo, pb.GetInfoRequest())  # ...so a third is refused
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
    release.set()
    assert next(first).step == 2
    first.cancel()
    reflect.cancel()


def test_health_not_serving_until_attached_then_serving_then_not_serving_on_stop():
    server = LearnerServer(ServerOptions(port=0))
    server.start()
    channel = grpc.insecure_channel(server.target)
    health = health_pb2_grpc.HealthStub(channel)
    watch = health.Watch(health_pb2.HealthCheckRequest(service="duelq.v1.Learner"))
    try:
        assert next(watch).status == NOT_SERVING
        assert health.Check(health_pb2.HealthCheckRequest()).status == NOT_SERVING
        code, details = code_of(pb_grpc.LearnerStub(channel).GetInfo, pb.GetInfoRequest())
        assert code == grpc.StatusCode.UNAVAILABLE and "starting" in details
        server.attach(Learner(SMALL, backend="reference"))
        assert next(watch).status == SERVING
        assert pb_grpc.LearnerStub(channel).GetInfo(pb.GetInfoRequest()).step == 0
    finally:
        server.stop(0.5)
    assert next(watch).status == NOT_SERVING


def test_bearer_token_required_except_for_health(make_server, rng):
    server = make_server(token="s3cret")
    s = stub(server.target)
    for metadata in ((), (("authorization", "Bearer wrong"),)):
        code, _ = code_of(s.GetInfo, pb.GetInfoRequest(), metadata=metadata)
        assert code == grpc.StatusCode.UNAUTHENTICATED
        code, _ = code_of(lambda: next(s.TrainStream(iter([train_request(rng)]),
                                                     metadata=metadata)))
        assert code == grpc.StatusCode.UNAUTHENTICATED
    # Refused unread: undecodable bytes are UNAUTHENTICATED too, and nothing is parsed.
    raw = grpc.insecure_channel(server.target).unary_unary(
        "/duelq.v1.Learner/TrainStep", request_serializer=None)
    layouts = dict(wire._LAYOUTS)
    for data in (b"\xff\xff", train_request(rng, rows=3, actor="never-admitted-actor-x",
                                             seq=1).SerializeToString()):
        code, _ = code_of(raw, data)
        assert code == grpc.StatusCode.UNAUTHENTICATED
    assert wire._LAYOUTS == layouts
    good = (("authorization", "Bearer s3cret"),)
    assert s.TrainStep(train_request(rng), metadata=good).step == 1
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(server.target))
    assert health.Check(health_pb2.HealthCheckRequest()).status == SERVING
    with LearnerClient(server.target, token="s3cret") as client:
        assert client.info().step == 1


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls(make_server, tmp_path, rng):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", key, "-out", cert, "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True,
                   capture_output=True)
    # One address: "localhost" would bind two, and a port taken on one leaves it half bound.
    server = make_server(host="127.0.0.1", tls_cert=str(cert), tls_key=str(key))
    with LearnerClient(server.target, tls=cert) as client:
        assert client.train_step(random_batch(rng, 4)).step == 1
    plain = stub(server.target)
    code, _ = code_of(plain.GetInfo, pb.GetInfoRequest(), timeout=5)
    assert code == grpc.StatusCode.UNAVAILABLE


def test_options_are_checked():
    with pytest.raises(ValueError, match="max_rpcs"):
        ServerOptions(max_streams=8, max_rpcs=8)
    with pytest.raises(ValueError, match="tls_key"):
        ServerOptions(tls_cert="cert.pem")


def test_info_reports_backend_config_and_limits(make_server):
    config = LearnerConfig(hidden_dim=4, n_actions=3, double_dqn=True)
    server = make_server(config, max_batch_size=99, max_streams=3, max_rpcs=7)
    info = stub(server.target).GetInfo(pb.GetInfoRequest())
    assert (info.backend, info.device) == ("reference", server.learner.backend.device)
    assert LearnerConfig.from_dict(json.loads(info.config_json)) == config
    assert (info.max_batch_size, info.max_streams, info.step) == (99, 3, 0)
    assert info.max_queue == ServerOptions().max_queue


def test_server_version_falls_back_when_duelq_is_not_installed(monkeypatch):
    from importlib import metadata

    from duelq.server import service

    def missing(name):
        raise metadata.PackageNotFoundError(name)
    assert service._version() == metadata.version("duelq")
    monkeypatch.setattr(metadata, "version", missing)
    assert service._version() == "0+source"   # GetInfo still answers from a source tree


def _result(rng, rows: int, **fields) -> StepResult:
    values = dict(loss=float(rng.random()), q_taken_mean=float(rng.normal()),
                  grad_norm=float(rng.random() * 10), step=int(rng.integers(1, 2**40)),
                  entropy=None)
    values.update(fields)
    return StepResult(td_errors=rng.normal(size=rows).astype(np.float32),
                      priorities=rng.random(rows).astype(np.float32), **values)


def _message(result: StepResult, key: pb.RequestKey) -> pb.TrainResponse:
    """The TrainResponse that protobuf builds of ``result``: train_response's oracle."""
    message = pb.TrainResponse(
        loss=result.loss, td_errors=encode(result.td_errors, "td_errors"),
        priorities=encode(result.priorities, "priorities"), q_taken_mean=result.q_taken_mean,
        grad_norm=result.grad_norm, step=result.step, version=result.step, key=key)
    if result.entropy is not None:
        message.entropy = result.entropy
    return message


@pytest.mark.parametrize("rows", [0, 1, 31, 127, 128, 1024, 4097])
@pytest.mark.parametrize("entropy", [None, 0.0, 1.25])
def test_an_encoded_train_response_is_protobufs_own_bytes(rows, entropy):
    rng = np.random.default_rng(rows)
    for key in (pb.RequestKey(), pb.RequestKey(actor_id="actor-7", seq=2**33 + 5)):
        result = _result(rng, rows, entropy=entropy)
        encoded = train_response(result, key.SerializeToString())
        assert encoded.SerializeToString() == _message(result, key).SerializeToString()
        assert (encoded.step, encoded.loss, encoded.rows, encoded.replayed) == (
            result.step, result.loss, rows, False)


@pytest.mark.parametrize("fields", [
    dict(loss=0.0, q_taken_mean=0.0, grad_norm=0.0, step=0),         # defaults left out
    dict(loss=-0.0, q_taken_mean=-0.0, grad_norm=0.0, step=1),       # -0.0 is written
    dict(loss=1e-320, q_taken_mean=-3.5, grad_norm=math.inf, step=128),   # a 2-byte varint
    dict(loss=0.5, q_taken_mean=1.0, grad_norm=2.0, step=2**64 - 1),
])
def test_an_encoded_train_response_writes_scalars_as_protobuf_does(fields):
    result = _result(np.random.default_rng(0), 3, **fields)
    key = pb.RequestKey(actor_id="a", seq=1)
    assert train_response(result, key.SerializeToString()).SerializeToString() == \
        _message(result, key).SerializeToString()


def test_an_encoded_response_is_recorded_replayed_and_checkpointed_as_its_message():
    rng = np.random.default_rng(3)
    key = pb.RequestKey(actor_id="a", seq=4)
    result = _result(rng, 8)
    message = _message(result, key)
    guard = KeyGuard(capacity=4, window=8)
    guard.record("a", 4, train_response(result, key.SerializeToString()))
    assert guard.lookup("a", 4, pb.TrainResponse).SerializeToString() == \
        message.SerializeToString()
    with pytest.raises(InvalidArgument, match="already used by a TrainResponse"):
        guard.lookup("a", 4, pb.ComputeEntropyResponse)
    restored = KeyGuard.from_bytes(guard.to_bytes(), RECORDED_KINDS)
    assert restored.lookup("a", 4, pb.TrainResponse) == message


def test_a_repeated_key_answered_encoded_is_replayed_as_a_message(rng):
    learner = Learner(SMALL, backend="reference")
    service = LearnerService(ServerOptions(max_message_bytes=1 << 24, max_batch_size=64,
                                           max_streams=4).limits())
    service.attach(learner)
    data = encode_batch_wire(random_batch(rng, 8), actor_id="a", seq=1)
    answers = []
    for _ in range(2):
        with service.relay_prepare(memoryview(data), "TrainStream") as job:
            answers.append(service.apply_train(job, None))
    first, again = answers
    assert isinstance(first, EncodedTrainResponse) and isinstance(again, pb.TrainResponse)
    assert again.replayed and learner.step_count == 1
    again.replayed = False
    assert again.SerializeToString() == first.SerializeToString()
