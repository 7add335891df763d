"""LearnerClient against a real in-process server, checked against a local learner."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import grpc
import ml_dtypes
import numpy as np
import pytest

from duelq.client import LearnerClient, errors
from duelq.server.core.config import LearnerConfig
from duelq.server.core.learner import Learner

from conftest import SMALL, random_batch

N = SMALL.n_actions


@pytest.fixture
def rng():
    return np.random.default_rng(11)


@pytest.fixture
def client(server):
    with LearnerClient(server.target, actor_id="test-actor") as c:
        yield c


@pytest.fixture
def local():
    """The oracle: the same learner, in process, no wire."""
    return Learner(SMALL, backend="reference")


def assert_same_step(result, expected):
    assert result.loss == expected.loss and result.step == expected.step
    assert np.array_equal(result.td_errors, expected.td_errors)
    assert np.array_equal(result.priorities, expected.priorities)
    assert result.q_taken_mean == pytest.approx(expected.q_taken_mean, rel=1e-7)
    assert result.entropy == pytest.approx(expected.entropy, rel=1e-7)


# -- every rpc, round trip ------------------------------------------------------------

def test_train_step_and_stream_match_the_local_learner(client, local, rng):
    batches = [random_batch(rng, 12) for _ in range(6)]
    assert_same_step(client.train_step(batches[0]), local.step(batches[0]))
    results = list(client.train_stream(batches[1:], window=2))
    assert [r.seq for r in results] == [2, 3, 4, 5, 6]
    for result, batch in zip(results, batches[1:]):
        assert_same_step(result, local.step(batch))
        assert result.td_errors.dtype == np.float32 and not result.replayed


def test_act_weights_isv_entropy_and_info_match_the_local_learner(client, local, rng):
    batch = random_batch(rng, 8)
    client.train_step(batch)
    local.step(batch)
    h = rng.standard_normal((5, SMALL.hidden_dim), dtype=np.float32)
    for target in (False, True):
        act = client.act(h, target=target)
        assert np.array_equal(act.q_values, local.q_values(h, target))
        assert np.array_equal(act.actions, act.q_values.argmax(axis=1)) and act.version == 1
        weights = client.get_weights(target=target)
        params, version = local.weights(target)
        assert all(np.array_equal(a, b) for a, b in zip(weights.params.arrays(), params.arrays()))
        assert (weights.version, weights.step, weights.target) == (version, 1, target)

    actions = np.array([0, 0, 1, 3], np.int64)  # int64 is narrowed to int32 locally
    got = client.compute_entropy(actions, "policy_entropy_ema", alpha=0.25)
    want = local.compute_entropy(actions.astype(np.int32), "policy_entropy_ema", 0.25)
    assert (got.entropy, got.ema, got.slot) == pytest.approx((want.entropy, want.ema, want.slot))

    by_name = client.read_isv(["policy_entropy_ema", 583, 0])
    assert [(v.slot, v.name, v.observed) for v in by_name] == [
        (420, "policy_entropy_ema", True), (583, "action_entropy_ema", True), (0, "", False)]
    assert by_name[0].value == pytest.approx(want.ema)
    assert [v.slot for v in client.read_isv()] == [420, 583]

    info = client.info()
    assert (info.backend, LearnerConfig.from_dict(info.config), info.step, info.version) == (
        "reference", SMALL, 1, 1)
    assert (info.hidden_dim, info.n_actions) == (SMALL.hidden_dim, SMALL.n_actions)
    with pytest.raises(errors.FailedPrecondition, match="--checkpoint-dir"):
        client.save_checkpoint()


@pytest.mark.parametrize("wire", ["float16", "bfloat16"])
def test_half_precision_features_arrive_as_their_float32_values(server, local, rng, wire):
    batch = random_batch(rng, 8)
    rounded = {"float16": lambda a: a.astype(np.float16).astype(np.float32),
               "bfloat16": lambda a: a.astype(ml_dtypes.bfloat16).astype(np.float32)}[wire]
    with LearnerClient(server.target, feature_dtype=wire) as client:
        result = client.train_step(batch)
    expected = local.step(replace(batch, h_t=rounded(batch.h_t), h_tp1=rounded(batch.h_tp1)))
    assert_same_step(result, expected)


@pytest.mark.parametrize("wire", ["bfloat16", "float32", "float16"])
def test_bfloat16_features_are_taken_as_they_come(server, local, rng, wire):
    """Features already in bfloat16 (ml_dtypes) go on a bfloat16 wire as they are, and on the
    other wires converted as their float32 values would be (exactly, to float32)."""
    batch = random_batch(rng, 8)
    bf16 = replace(batch, h_t=batch.h_t.astype(ml_dtypes.bfloat16),
                   h_tp1=batch.h_tp1.astype(ml_dtypes.bfloat16))
    with LearnerClient(server.target, feature_dtype=wire) as client:
        result = client.train_step(bf16)
    on_wire = (lambda a: a.astype(np.float16).astype(np.float32)) if wire == "float16" \
        else (lambda a: a)
    expected = local.step(replace(batch, h_t=on_wire(bf16.h_t.astype(np.float32)),
                                  h_tp1=on_wire(bf16.h_tp1.astype(np.float32))))
    assert_same_step(result, expected)


# -- checks before sending ------------------------------------------------------------

@pytest.mark.parametrize("change, field", [
    ({"h_t": [[0.0] * SMALL.hidden_dim]}, "h_t"),
    ({"h_t": np.zeros((0, SMALL.hidden_dim), np.float32)}, "h_t"),
    ({"h_tp1": np.zeros((8, SMALL.hidden_dim + 1), np.float32)}, "h_tp1"),
    ({"h_t": np.zeros((8, SMALL.hidden_dim), np.int32)}, "h_t"),
    ({"actions": np.zeros(8, np.float32)}, "actions"),
    ({"actions": np.full(8, 2 ** 40)}, "actions"),
    ({"rewards": np.zeros(7, np.float32)}, "rewards"),
    ({"discounts": np.zeros((8, 1), np.float32)}, "discounts"),
    ({"weights": np.zeros(8, np.complex64)}, "weights"),
])
def test_malformed_batches_fail_locally_naming_the_field(server, client, rng, change, field):
    bad = replace(random_batch(rng, 8), **change)
    with pytest.raises(errors.InvalidArgument) as info:
        client.train_step(bad)
    assert info.value.field == field and info.value.details.startswith(f"{field}:")
    assert server.learner.step_count == 0


def test_float64_and_int64_inputs_are_narrowed(client, local, rng):
    batch = random_batch(rng, 8)
    wide = replace(batch, rewards=batch.rewards.astype(np.float64),
                   actions=batch.actions.astype(np.int64), dones=batch.dones.astype(bool))
    assert_same_step(client.train_step(wide), local.step(batch))


# -- errors ---------------------------------------------------------------------------

def test_server_errors_keep_code_message_and_field(make_server, rng):
    server = make_server(max_batch_size=16)
    with LearnerClient(server.target) as client:
        bad = random_batch(rng, 8)
        bad.actions[3] = N
        with pytest.raises(errors.InvalidArgument) as info:
            client.train_step(bad)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.field == "actions" and "element 3" in info.value.details
        with pytest.raises(errors.ResourceExhausted) as info:
            client.train_step(random_batch(rng, 17))
        assert "17" in str(info.value) and info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(errors.InvalidArgument, match="alpha"):
            client.compute_entropy(np.array([1, 2]), "action_entropy_ema", alpha=2.0)
        with pytest.raises(errors.InvalidArgument, match="slot"):
            client.read_isv(["no_such_slot"])


@pytest.mark.parametrize("code, cls", [
    (grpc.StatusCode.INVALID_ARGUMENT, errors.InvalidArgument),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, errors.ResourceExhausted),
    (grpc.StatusCode.FAILED_PRECONDITION, errors.FailedPrecondition),
    (grpc.StatusCode.ALREADY_EXISTS, errors.AlreadyApplied),
    (grpc.StatusCode.UNAVAILABLE, errors.Unavailable),
    (grpc.StatusCode.DEADLINE_EXCEEDED, errors.DeadlineExceeded),
    (grpc.StatusCode.UNAUTHENTICATED, errors.Unauthenticated),
    (grpc.StatusCode.UNIMPLEMENTED, errors.Unimplemented),
    (grpc.StatusCode.CANCELLED, errors.Cancelled),
    (grpc.StatusCode.INTERNAL, errors.ServerError),
    (grpc.StatusCode.PERMISSION_DENIED, errors.DuelqError),
])
def test_every_status_code_is_translated(code, cls):
    class Failed(grpc.RpcError):
        def code(self):
            return code

        def details(self):
            return "h_t: something"

    error = errors.from_rpc_error(Failed())
    assert type(error) is cls and error.code == code and error.details == "h_t: something"
    assert str(error) == f"{code.name}: h_t: something"


def test_stream_raises_at_the_failing_batch_and_applies_nothing_after_it(server, client, rng):
    bad = random_batch(rng, 8)
    bad.discounts[0] = 2.0
    batches = [random_batch(rng, 8), random_batch(rng, 8), bad, random_batch(rng, 8)]
    got = []
    with pytest.raises(errors.InvalidArgument) as info:
        for result in client.train_stream(batches, window=4):
            got.append(result.step)
    assert got == [1, 2] and info.value.field == "discounts"
    assert server.learner.step_count == 2


def test_stream_raises_a_local_check_after_the_batches_before_it(server, client, rng):
    malformed = replace(random_batch(rng, 8), rewards=np.zeros(3, np.float32))
    batches = [random_batch(rng, 8), random_batch(rng, 8), malformed, random_batch(rng, 8)]
    got = []
    with pytest.raises(errors.InvalidArgument, match="rewards"):
        for result in client.train_stream(batches, window=8):
            got.append(result.step)
    assert got == [1, 2] and server.learner.step_count == 2


def test_stream_window_bounds_batches_in_flight(client, rng):
    pulled = 0

    def batches():
        nonlocal pulled
        for _ in range(20):
            pulled += 1
            yield random_batch(rng, 4)

    seen, ahead = 0, []
    for result in client.train_stream(batches(), window=3):
        seen += 1
        ahead.append(pulled - seen)  # sent, not yet answered, besides this result
        assert result.step == seen
    assert (pulled, seen) == (20, 20)
    assert max(ahead) == 2 and ahead[:5] == [2] * 5  # the window is used, never exceeded


# -- retries, dead servers ------------------------------------------------------------

class DropAfterApply(grpc.ServerInterceptor):
    """Fails the first call of ``method`` with UNAVAILABLE after the server applied it.

    For TrainStream: the first response is delivered, the second request is
    applied, and its response is lost with the connection.
    """

    def __init__(self, method: str):
        self.method, self.tripped = method, False

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if self.tripped or not details.method.endswith("/" + self.method):
            return handler

        def unary(request, context):
            handler.unary_unary(request, context)
            self.tripped = True
            context.abort(grpc.StatusCode.UNAVAILABLE, "connection dropped (test)")

        def stream(requests, context):
            responses = handler.stream_stream(requests, context)
            yield next(responses)
            next(responses)
            self.tripped = True
            context.abort(grpc.StatusCode.UNAVAILABLE, "connection dropped (test)")

        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                unary, handler.request_deserializer, handler.response_serializer)
        return grpc.stream_stream_rpc_method_handler(
            stream, handler.request_deserializer, handler.response_serializer)


def test_train_step_retry_reuses_the_key_and_is_not_applied_twice(make_server, rng):
    server = make_server(interceptors=(DropAfterApply("TrainStep"),))
    with LearnerClient(server.target, backoff=0.01) as client:
        result = client.train_step(random_batch(rng, 8))
        assert result.replayed and (result.step, result.seq) == (1, 1)
        assert client.train_step(random_batch(rng, 8)).step == 2
    assert server.learner.step_count == 2


def test_stream_reconnects_and_resends_unanswered_batches_once(make_server, rng):
    server = make_server(interceptors=(DropAfterApply("TrainStream"),))
    batches = [random_batch(rng, 8) for _ in range(10)]
    with LearnerClient(server.target, backoff=0.01) as client:
        results = list(client.train_stream(batches, window=4))
    assert [r.seq for r in results] == list(range(1, 11))
    assert [r.step for r in results] == list(range(1, 11))
    assert [r.replayed for r in results] == [False, True] + [False] * 8
    sequential = Learner(SMALL, backend="reference")
    for batch in batches:
        sequential.step(batch)
    assert server.learner.snapshot().checksum() == sequential.snapshot().checksum()


def test_a_stream_the_server_cancels_for_unread_answers_resumes_once(make_server, rng,
                                                                    caplog):
    """A slow producer leaves a full window of answers unread past the server's receive
    timeout: the server cancels the stream, and the client resends the unanswered
    batches under their keys, so each applies once."""
    server = make_server(receive_timeout_s=0.5, max_batch_size=4096)
    batches = [random_batch(rng, 4096) for _ in range(12)]   # 32 KiB answers

    def slowly():
        for i, batch in enumerate(batches):
            if i >= 8:
                time.sleep(1.2)   # 8 answers (256 KiB) unread, past a 64 KiB window
            yield batch
    with caplog.at_level("INFO", logger="duelq.server.gate"), LearnerClient(
            server.target, backoff=0.01,
            channel_options=[("grpc.http2.bdp_probe", 0)]) as client:
        results = list(client.train_stream(slowly(), window=8))
    assert "no read of its answer" in caplog.text
    assert [r.seq for r in results] == list(range(1, 13))
    assert sorted(r.step for r in results) == list(range(1, 13))
    sequential = Learner(SMALL, backend="reference")
    for batch in batches:
        sequential.step(batch)
    assert server.learner.snapshot().checksum() == sequential.snapshot().checksum()


def test_a_stream_ended_by_closing_its_client_is_not_resumed(server, rng):
    """Closing the client cancels its streams; that CANCELLED is the caller's, not resumed."""
    client, produced = LearnerClient(server.target, backoff=0.01), threading.Event()
    closed = threading.Event()

    def batches():
        yield random_batch(rng, 8)
        produced.set()
        assert closed.wait(30)
        yield random_batch(rng, 8)
    stream = client.train_stream(batches(), window=1)
    assert next(stream).step == 1
    ended: list = []
    reader = threading.Thread(target=lambda: ended.append(pytest.raises(
        errors.Cancelled, list, stream)))
    reader.start()
    assert produced.wait(30)
    client.close()
    closed.set()
    reader.join(30)
    assert len(ended) == 1


def test_dead_port_fails_fast_with_a_clear_error(dead_target):
    start = time.monotonic()
    with LearnerClient(dead_target, retries=3, backoff=0.05) as client:
        with pytest.raises(errors.Unavailable) as info:
            client.info()
        with pytest.raises(ConnectionError):
            list(client.train_stream([random_batch(np.random.default_rng(0), 4)]))
        with pytest.raises(errors.Unavailable, match="not SERVING"):
            client.wait_ready(timeout=0.3)
    assert time.monotonic() - start < 10
    message = str(info.value)
    assert dead_target in message and "after 4 attempt(s)" in message


def test_options_are_checked():
    with pytest.raises(errors.InvalidArgument, match="feature_dtype"):
        LearnerClient("localhost:1", feature_dtype="float64")
    with pytest.raises(errors.InvalidArgument, match="window"):
        next(LearnerClient("localhost:1").train_stream([], window=0))


def test_wide_float_vectors_are_sent_as_float32(server):
    batch = random_batch(np.random.default_rng(5), 6)
    with LearnerClient(server.target) as client:
        result = client.train_step(replace(batch, rewards=batch.rewards.astype(np.longdouble)))
        streamed = list(client.train_stream([replace(batch, weights=batch.weights.astype(
            np.longdouble))]))
    assert result.step == 1 and [r.step for r in streamed] == [2]
