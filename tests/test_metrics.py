"""The Prometheus endpoint: counts that match what the server did."""

from __future__ import annotations

import math
import socket
import urllib.request
from dataclasses import replace

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from duelq.client import LearnerClient, errors
from duelq.client.client import encode_batch
from duelq.v1 import learner_pb2 as pb
from duelq.v1 import learner_pb2_grpc as pb_grpc

from conftest import random_batch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture
def metered(make_server, tmp_path):
    port = free_port()
    server = make_server(metrics_port=port)
    server.metrics.checkpoint_dir = str(tmp_path)
    return server, port


def test_metrics_count_steps_transitions_refusals_and_slots(metered, tmp_path):
    server, port = metered
    rng = np.random.default_rng(0)
    with LearnerClient(server.target) as client:
        for _ in range(3):
            client.train_step(random_batch(rng, 7))
        results = list(client.train_stream((random_batch(rng, 5) for _ in range(4)), window=2))
        with pytest.raises(errors.InvalidArgument):
            client.train_step(replace(random_batch(rng, 7), actions=np.full(7, 99, np.int32)))
        client.compute_entropy(np.array([0, 1, 1, 2], np.int32), "action_entropy_ema", 1.0)
    m = scrape(port)
    assert m[("duelq_steps_total", ())] == 7 == results[-1].step
    assert m[("duelq_transitions_total", ())] == 3 * 7 + 4 * 5
    assert m[("duelq_step_latency_seconds_count", ())] == 7
    assert m[("duelq_loss", ())] == pytest.approx(results[-1].loss, rel=1e-6)
    assert m[("duelq_refused_requests_total",
              (("code", "INVALID_ARGUMENT"), ("method", "TrainStep")))] == 1
    assert m[("duelq_queue_depth", ())] == 0
    assert m[("duelq_active_streams", ())] == 0
    assert m[("duelq_step", ())] == 7
    expect = -(0.25 * math.log(0.25) * 2 + 0.5 * math.log(0.5))
    assert m[("duelq_isv_value", (("slot", "action_entropy_ema"),))] == pytest.approx(expect)
    assert math.isnan(m[("duelq_isv_value", (("slot", "policy_entropy_ema"),))])
    assert ("duelq_checkpoint_age_seconds", ()) not in m  # no checkpoint written yet
    (tmp_path / "ckpt-000000000007.safetensors").write_bytes(b"")
    assert 0 <= scrape(port)[("duelq_checkpoint_age_seconds", ())] < 60


@pytest.mark.parametrize("fronts", [0, 1], ids=["one-process", "a-front-process"])
def test_an_insert_stream_counts_its_refusal_and_no_train_figures(make_server, fronts):
    """Both server models count an InsertStream's refusal, and neither counts it among the
    train requests' queue depth and open TrainStreams."""
    port = free_port()
    server = make_server(metrics_port=port, front_processes=fronts)   # no replay buffer
    request = pb.InsertStreamRequest(key=pb.RequestKey(actor_id="a", seq=1))
    with grpc.insecure_channel(server.target) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            list(pb_grpc.LearnerStub(channel).InsertStream(iter([request]), timeout=30))
    code = refused.value.code().name
    m = scrape(port)
    assert m[("duelq_refused_requests_total", (("code", code), ("method", "InsertStream")))] == 1
    assert m[("duelq_queue_depth", ())] == 0
    assert m[("duelq_active_streams", ())] == 0


def test_a_replayed_batch_is_not_counted_as_a_step(metered):
    server, port = metered
    stub = pb_grpc.LearnerStub(grpc.insecure_channel(server.target))
    request = encode_batch(random_batch(np.random.default_rng(1), 4))
    request.key.CopyFrom(pb.RequestKey(actor_id="a", seq=1))
    first, again = stub.TrainStep(request), stub.TrainStep(request)
    assert not first.replayed and again.replayed
    m = scrape(port)
    assert m[("duelq_steps_total", ())] == 1
    assert m[("duelq_step_latency_seconds_count", ())] == 2


def test_metrics_are_off_by_default(server):
    assert server.metrics is None


def test_a_busy_metrics_port_fails_the_start_and_leaves_nothing_serving():
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from duelq.server.server import LearnerServer, ServerOptions
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        server = LearnerServer(ServerOptions(port=0, metrics_port=busy.getsockname()[1]))
        with pytest.raises(OSError):
            server.start()
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        with pytest.raises(grpc.RpcError) as info:  # no answer at all, not NOT_SERVING
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                      timeout=1)
    assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
