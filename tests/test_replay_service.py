"""The replay buffer through the wire: InsertStream, TrainReplay and GetReplayInfo on a real
in-process server (reference backend), the client's methods, the server's own loop holding
replay_ratio, checkpoints with --checkpoint-replay, and the refusals."""

from __future__ import annotations

import dataclasses
import queue
import time

import grpc
import numpy as np
import pytest

from duelq.apps import cli
from duelq.client import LearnerClient, ReplayInfo, Transitions, errors
from duelq.client.client import _transition_arrays, _wire_request
from duelq.server.core.config import LearnerConfig
from duelq.server.core.errors import ReplayTooLarge
from duelq.server.fronts import FrontServer, start_server
from duelq.server.server import ServerOptions
from duelq.v1 import learner_pb2 as pb
from duelq.v1 import learner_pb2_grpc as pb_grpc
from duelq.wire.tensors import INSERT_FIELDS

H, N = 8, 3
CONFIG = LearnerConfig(hidden_dim=H, n_actions=N, lr=1e-2, isv_size=4,
                       isv_slots={"action_entropy_ema": 1}, replay_capacity=128,
                       replay_batch_size=16, replay_min_size=8, replay_seed=3)


def rows(rng: np.random.Generator, n: int, *, priorities=None) -> Transitions:
    return Transitions(
        h_t=rng.standard_normal((n, H)).astype(np.float32),
        h_tp1=rng.standard_normal((n, H)).astype(np.float32),
        actions=rng.integers(0, N, n, dtype=np.int32),
        rewards=rng.standard_normal(n).astype(np.float32),
        dones=(rng.random(n) < 0.2).astype(np.float32),
        discounts=np.full(n, 0.97, np.float32), priorities=priorities)


def insert_request(t: Transitions, actor: str = "", seq: int = 0) -> pb.InsertStreamRequest:
    return pb.InsertStreamRequest.FromString(
        _wire_request(_transition_arrays(t, "float32"), actor, seq, INSERT_FIELDS))


def stub(server) -> pb_grpc.LearnerStub:
    return pb_grpc.LearnerStub(grpc.insecure_channel(server.target))


def refusal(call, *args) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        result = call(*args)
        if not isinstance(result, pb.InsertStreamResponse) and hasattr(result, "__iter__"):
            list(result)
    return info.value.code(), info.value.details()


def held_ratio(client: LearnerClient, ratio: float) -> ReplayInfo:
    """The buffer's figures once the server's replay loop has run every step ``ratio`` asks
    for (it runs on a thread of its own)."""
    deadline = time.monotonic() + 60
    while True:
        info = client.replay_info()
        if info.sampled + info.batch_size > ratio * info.inserted or \
                time.monotonic() > deadline:
            return info
        time.sleep(0.05)


@pytest.fixture
def replay_server(make_server):
    return make_server(CONFIG)


def test_inserts_are_acknowledged_in_order_and_stored_once_per_key(replay_server):
    rng = np.random.default_rng(0)
    learner = replay_server.learner
    sent = [insert_request(rows(rng, n), "actor-a", seq) for seq, n in ((1, 5), (2, 7), (3, 4))]
    answers = list(stub(replay_server).InsertStream(iter(sent)))
    assert [(a.rows, a.size, a.inserted, a.key.seq, a.replayed) for a in answers] == [
        (5, 5, 5, 1, False), (7, 12, 12, 2, False), (4, 16, 16, 3, False)]
    before = learner.replay_snapshot().checksum()
    again = list(stub(replay_server).InsertStream(iter([sent[1], sent[2]])))
    assert [(a.rows, a.size, a.replayed) for a in again] == [(7, 12, True), (4, 16, True)]
    assert learner.replay_snapshot().checksum() == before
    stored = learner.replay_snapshot()
    np.testing.assert_array_equal(stored.h_t[5:12], np.frombuffer(sent[1].h_t.data,
                                                                  np.float32).reshape(7, H))


def test_inserts_are_read_zero_copy_by_grpc_and_by_the_relay(replay_server, monkeypatch):
    """An InsertStream request reaches the service as the zero-copy reader's
    WireInsertRequest, both from gRPC (one process) and from relayed bytes (fronts)."""
    from duelq.server.framing import WireInsertRequest
    from duelq.server.service import LearnerService
    seen, prepare = [], LearnerService.prepare_insert

    def spy(self, request):
        seen.append(type(request))
        return prepare(self, request)
    monkeypatch.setattr(LearnerService, "prepare_insert", spy)
    rng = np.random.default_rng(4)
    sent = insert_request(rows(rng, 5), "actor-z", 1)
    assert [a.rows for a in stub(replay_server).InsertStream(iter([sent]))] == [5]
    data = sent.SerializeToString()
    replay_server.service.relay_prepare(memoryview(data), "InsertStream")
    assert seen == [WireInsertRequest, WireInsertRequest]


def test_every_inserts_upload_is_given_back(replay_server, monkeypatch):
    """An insert's upload (a device backend's staging, taken before the apply lock) is given
    back whether its rows are stored or its key's answer is replayed: by gRPC's
    InsertStream, and by a relayed job's close (the relay closes every job it prepared:
    tests/test_front.py)."""
    from duelq.server.core.backend import Upload

    class Counted(Upload):
        def __init__(self):
            self.open = True
            taken.append(self)

        def close(self):
            self.open = False
    taken: list[Counted] = []
    monkeypatch.setattr(replay_server.learner.replay, "upload", lambda rows: Counted())
    rng = np.random.default_rng(5)
    sent = [insert_request(rows(rng, 3), "actor-u", seq) for seq in (1, 2)]
    answers = list(stub(replay_server).InsertStream(iter([sent[0], sent[1], sent[0]])))
    assert [a.replayed for a in answers] == [False, False, True]
    service = replay_server.service
    for request in (sent[1], insert_request(rows(rng, 2), "actor-u", 3)):   # replayed, new
        job = service.relay_prepare(memoryview(request.SerializeToString()), "InsertStream")
        service.apply_insert(job, None)
        job.close()   # as the relay closes every job
    assert len(taken) == 5 and not any(u.open for u in taken)
    assert replay_server.learner.replay.size == 3 + 3 + 2


@pytest.mark.parametrize("wire", ["float32", "float16"])
def test_a_packed_insert_is_stored_and_refused_as_its_bytes_are(make_server, monkeypatch, wire):
    """An insert a front packed (relay_prepare_packed) stores what its bytes do
    (relay_prepare) and is refused naming the same field; its packed words go to the
    replay's upload as they lie, float16 ones too (the float32 buffer widens them as it
    stores them)."""
    from duelq.server.core.batch import PackedBatch
    from duelq.server.fronts.packing import Packer, read_packed
    packed_server, bytes_server = make_server(CONFIG), make_server(CONFIG)
    uploaded = []
    replay = packed_server.learner.replay
    monkeypatch.setattr(replay, "upload", lambda t: uploaded.append(type(t)))
    rng = np.random.default_rng(14)
    good = rows(rng, 6, priorities=rng.uniform(0.5, 2, 6).astype(np.float32))
    bad = dataclasses.replace(rows(rng, 3), priorities=np.array([1, 0, 1], np.float32))
    if wire == "float16":
        good = dataclasses.replace(good, h_t=good.h_t.astype(np.float16),
                                   h_tp1=good.h_tp1.astype(np.float16))
    answers = {}
    for seq, t in ((1, good), (2, bad)):
        data = _wire_request(_transition_arrays(t, wire), "actor-p", seq, INSERT_FIELDS)
        buffer = np.zeros(1 << 16, np.uint8)
        descriptor = Packer().pack(data, buffer)
        assert descriptor is not None
        for server, prepare in (
                (packed_server, lambda s: s.relay_prepare_packed(*read_packed(
                    descriptor, memoryview(buffer), buffer.ctypes.data), "InsertStream")),
                (bytes_server, lambda s: s.relay_prepare(memoryview(data), "InsertStream"))):
            try:
                with prepare(server.service) as job:
                    answer = server.service.apply_insert(job, None)
                answers.setdefault(seq, []).append((answer.rows, answer.size))
            except Exception as exc:  # noqa: BLE001 — compared as the client would see it
                answers.setdefault(seq, []).append(str(exc))
    assert answers[1] == [(6, 6), (6, 6)]
    assert answers[2][0] == answers[2][1] and answers[2][0].startswith("priorities")
    assert uploaded == [PackedBatch]
    assert (packed_server.learner.replay_snapshot().checksum()
            == bytes_server.learner.replay_snapshot().checksum())


def insert_good_bad_more(server, rng: np.random.Generator, actor: str) -> None:
    """Stream a good insert, one whose actions are out of range, then another good one:
    the stream ends INVALID_ARGUMENT naming actions after answering the first only."""
    good = insert_request(rows(rng, 4), actor, 1)
    bad = insert_request(dataclasses.replace(rows(rng, 4), actions=np.array([0, N, 0, 0],
                                                                            np.int32)),
                         actor, 2)
    later = insert_request(rows(rng, 4), actor, 3)
    answers, call = [], stub(server).InsertStream(iter([good, bad, later]))
    with pytest.raises(grpc.RpcError) as info:
        for answer in call:
            answers.append(answer)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("actions:")
    assert [a.key.seq for a in answers] == [1]


def test_a_bad_insert_ends_the_stream_naming_its_field_and_stores_nothing(replay_server):
    insert_good_bad_more(replay_server, np.random.default_rng(1), "actor-b")
    assert replay_server.learner.replay_info().size == 4


def test_train_replay_runs_its_steps_once_per_key(replay_server):
    rng = np.random.default_rng(2)
    s = stub(replay_server)
    list(s.InsertStream(iter([insert_request(rows(rng, 20), "actor-c", 1)])))
    key = pb.RequestKey(actor_id="actor-c", seq=2)
    first = s.TrainReplay(pb.TrainReplayRequest(steps=3, key=key))
    assert (first.steps, first.refused, first.step, first.version) == (3, False, 3, 3)
    assert first.loss > 0 and first.grad_norm > 0
    again = s.TrainReplay(pb.TrainReplayRequest(steps=3, key=key))
    assert again.replayed and (again.steps, again.step) == (3, 3)
    info = s.GetReplayInfo(pb.GetReplayInfoRequest())
    assert (info.capacity, info.size, info.inserted, info.sampled, info.draws) == (
        128, 20, 20, 48, 3)
    assert info.ratio == pytest.approx(48 / 20) and info.dtype == "float32"
    assert (info.batch_size, info.min_size, info.cursor) == (16, 8, 20)
    assert replay_server.learner.step_count == 3


def test_train_replay_refusals(replay_server):
    s = stub(replay_server)
    code, details = refusal(s.TrainReplay, pb.TrainReplayRequest(steps=1))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "holds 0 rows" in details
    code, details = refusal(s.TrainReplay, pb.TrainReplayRequest(steps=0))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("steps:")
    code, _ = refusal(s.TrainReplay, pb.TrainReplayRequest(steps=5000))
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_the_buffers_rpcs_refuse_while_it_is_off(make_server):
    s = stub(make_server(dataclasses.replace(CONFIG, replay_capacity=0)))
    rng = np.random.default_rng(3)
    for call, request in ((s.TrainReplay, pb.TrainReplayRequest(steps=1)),
                          (s.GetReplayInfo, pb.GetReplayInfoRequest()),
                          (s.InsertStream, iter([insert_request(rows(rng, 2))]))):
        code, details = refusal(call, request)
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "off" in details


def test_the_client_inserts_trains_and_reads_figures(replay_server):
    rng = np.random.default_rng(4)
    with LearnerClient(replay_server.target) as client:
        acks = list(client.insert_stream((rows(rng, 6) for _ in range(4)), window=2))
        assert [a.size for a in acks] == [6, 12, 18, 24]
        assert [a.seq for a in acks] == [1, 2, 3, 4] and not any(a.replayed for a in acks)
        one = client.insert(rows(rng, 2, priorities=np.full(2, 3.0, np.float32)))
        assert (one.rows, one.size, one.version) == (2, 26, 0)
        result = client.train_replay(4)
        assert (result.steps, result.refused, result.version) == (4, False, 4)
        info = client.replay_info()
        assert (info.size, info.sampled, info.draws, info.target_ratio) == (26, 64, 4, 0.0)
        assert client.insert(rows(rng, 1)).version == 4
        with pytest.raises(errors.InvalidArgument, match="transitions"):
            client.insert(object())
        with pytest.raises(errors.InvalidArgument, match="priorities"):
            client.insert(rows(rng, 2, priorities=np.ones(2, np.int32)))
        with pytest.raises(errors.InvalidArgument, match="steps"):
            client.train_replay(0)


def test_the_server_holds_the_replay_ratio_by_itself(make_server):
    server = make_server(dataclasses.replace(CONFIG, replay_ratio=2.0))
    rng = np.random.default_rng(5)
    with LearnerClient(server.target) as client:
        for _ in range(10):
            client.insert(rows(rng, 8))
        info = held_ratio(client, 2.0)
    assert info.inserted == 80
    assert info.sampled == 160 and info.ratio == 2.0
    assert server.learner.step_count == 10 and server.replay_loop.steps == 10


def test_checkpoints_carry_the_buffer_and_resume_bit_identically(make_server, tmp_path):
    rng = np.random.default_rng(6)
    batches = [rows(rng, 9) for _ in range(6)]
    options = dict(checkpoint_dir=str(tmp_path), checkpoint_replay=True,
                   checkpoint_every_seconds=0)
    first = make_server(CONFIG, **options)
    with LearnerClient(first.target) as client:
        for t in batches[:3]:
            client.insert(t)
        client.train_replay(2)
        path, step = client.save_checkpoint()
        for t in batches[3:]:
            client.insert(t)
        client.train_replay(3)
    expected = (first.learner.snapshot().checksum(),
                first.learner.replay_snapshot().checksum())
    first.stop(0, final_checkpoint=False)

    resumed = make_server(CONFIG, **options)
    assert resumed.learner.step_count == 2
    assert resumed.learner.replay_info().size == 27
    with LearnerClient(resumed.target) as client:
        for t in batches[3:]:
            client.insert(t)
        client.train_replay(3)
    assert (resumed.learner.snapshot().checksum(),
            resumed.learner.replay_snapshot().checksum()) == expected


def test_without_checkpoint_replay_a_resumed_buffer_starts_empty(make_server, tmp_path):
    rng = np.random.default_rng(7)
    first = make_server(CONFIG, checkpoint_dir=str(tmp_path), checkpoint_every_seconds=0)
    with LearnerClient(first.target) as client:
        client.insert(rows(rng, 10))
        client.train_replay(1)
    first.stop(0)     # the final checkpoint
    resumed = make_server(CONFIG, checkpoint_dir=str(tmp_path), checkpoint_every_seconds=0)
    assert resumed.learner.step_count == 1
    assert resumed.learner.replay_info().size == 0


@pytest.fixture(params=[1, 2], ids=["1-front", "2-fronts"])
def fronts(request) -> int:
    """``front_processes`` of a server whose rpcs pass through fronts to a learner process."""
    return request.param


def test_fronts_insert_train_and_report(make_server, fronts):
    server = make_server(CONFIG, front_processes=fronts)
    rng = np.random.default_rng(10)
    s = stub(server)
    with LearnerClient(server.target) as client:
        one = client.insert(rows(rng, 6))
        assert (one.rows, one.size, one.inserted, one.replayed) == (6, 6, 6, False)
        sent = insert_request(rows(rng, 7), "actor-f", 1)
        first = list(s.InsertStream(iter([sent])))
        again = list(s.InsertStream(iter([sent])))   # a retried key: stored once
        assert [(a.rows, a.size, a.replayed) for a in first + again] == [
            (7, 13, False), (7, 13, True)]
        result = client.train_replay(3)
        assert (result.steps, result.refused, result.step, result.version) == (3, False, 3, 3)
        info = client.replay_info()
        assert (info.capacity, info.size, info.inserted, info.sampled, info.draws) == (
            128, 13, 13, 48, 3)
        assert info.ratio == pytest.approx(48 / 13) and info.dtype == "float32"
        assert client.info().step == 3


def test_fronts_refuse_a_bad_insert_naming_its_field_and_store_nothing(make_server, fronts):
    server = make_server(CONFIG, front_processes=fronts)
    rng = np.random.default_rng(11)
    insert_good_bad_more(server, rng, "actor-g")
    with LearnerClient(server.target) as client:
        assert client.replay_info().size == 4
        with pytest.raises(errors.InvalidArgument, match="rewards"):
            client.insert(dataclasses.replace(rows(rng, 2), rewards=np.array([1.0, np.nan],
                                                                             np.float32)))
        assert client.replay_info().inserted == 4


def test_the_learner_process_holds_the_replay_ratio(make_server, fronts):
    server = make_server(dataclasses.replace(CONFIG, replay_ratio=2.0), front_processes=fronts)
    rng = np.random.default_rng(12)
    with LearnerClient(server.target) as client:
        for _ in range(10):
            client.insert(rows(rng, 8))
        info = held_ratio(client, 2.0)
        assert (info.inserted, info.sampled, info.ratio) == (80, 160, 2.0)
        assert client.info().step == 10


def test_fronts_count_an_insert_stream_against_max_streams(make_server):
    server = make_server(CONFIG, front_processes=2, max_streams=1)
    rng = np.random.default_rng(13)
    s = stub(server)
    feed: queue.SimpleQueue = queue.SimpleQueue()
    held = s.InsertStream(iter(feed.get, None))
    feed.put(insert_request(rows(rng, 2), "actor-h", 1))
    assert next(held).size == 2   # open, holding the one place
    limit = "too many concurrent streams, TrainStreams and InsertStreams (limit 1)"
    assert refusal(s.InsertStream, iter([insert_request(rows(rng, 2))])) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED, limit)
    assert refusal(s.TrainStream, iter([])) == (grpc.StatusCode.RESOURCE_EXHAUSTED, limit)
    feed.put(None)
    assert list(held) == []   # half-closed and over: its place is back
    assert [a.size for a in s.InsertStream(iter([insert_request(rows(rng, 2))]))] == [4]
    cancelled = s.InsertStream(iter(feed.get, None))
    feed.put(insert_request(rows(rng, 2)))
    assert next(cancelled).size == 6
    cancelled.cancel()   # its place comes back, and the learner process's stream ends too
    deadline = time.monotonic() + 30
    while True:
        try:
            answers = list(s.InsertStream(iter([insert_request(rows(rng, 2))])))
            break
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert time.monotonic() < deadline, "the cancelled stream kept its place"
            time.sleep(0.02)
    assert [a.size for a in answers] == [8]


def test_fronts_answer_unavailable_before_the_learner_process_is_up():
    front = FrontServer(ServerOptions(port=0, front_processes=1))
    front.start()
    try:
        s = stub(front)
        for call, request in ((s.InsertStream, iter([pb.InsertStreamRequest()])),
                              (s.TrainReplay, pb.TrainReplayRequest(steps=1)),
                              (s.GetReplayInfo, pb.GetReplayInfoRequest())):
            code, details = refusal(call, request)
            assert code == grpc.StatusCode.UNAVAILABLE and "still starting" in details
    finally:
        front.stop(0)


def test_a_replay_too_large_for_its_memory_is_refused_as_with_one_process(capsys):
    huge = ["--replay-capacity", str(1 << 30), "--replay-min-size", "1", "--hidden-dim",
            "1024", "--backend", "reference", "--port", "0"]
    with pytest.raises(ReplayTooLarge, match="GiB of host memory"):
        start_server(cli.from_args(LearnerConfig, cli.build_parser().parse_args(
            ["serve"] + huge)), ServerOptions(port=0, front_processes=1), backend="reference")
    said = []
    for fronts in ("0", "1"):
        assert cli.main(["serve", "--front-processes", fronts] + huge) == cli.EXIT_USAGE
        said.append([line.partition(" ERROR ")[2] for line in capsys.readouterr().err.splitlines()
                     if "refusing to start" in line])
    assert said[0] == said[1] and len(said[0]) == 1


def test_replay_settings_are_flags_and_environment_variables(monkeypatch):
    monkeypatch.setenv("DUELQ_REPLAY_ALPHA", "0.7")
    args = cli.build_parser().parse_args(
        ["serve", "--replay-capacity", "1000", "--replay-dtype", "bfloat16",
         "--replay-ratio", "8", "--checkpoint-replay"])
    config = cli.from_args(LearnerConfig, args)
    assert (config.replay_capacity, config.replay_dtype, config.replay_ratio,
            config.replay_alpha) == (1000, "bfloat16", 8.0, 0.7)
    assert cli.from_args(ServerOptions, args).checkpoint_replay is True
    bad = cli.build_parser().parse_args(["serve", "--replay-capacity", "10"])
    with pytest.raises(cli.UsageError, match="--replay-min-size"):
        cli.from_args(LearnerConfig, bad)


def test_metrics_show_the_buffers_figures(make_server):
    import socket
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = make_server(CONFIG, metrics_port=port)
    with LearnerClient(server.target) as client:
        client.insert(rows(np.random.default_rng(9), 20))
        client.train_replay(2)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples = {(s.name, tuple(s.labels.values())): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("duelq_replay_rows", ("size",))] == 20
    assert samples[("duelq_replay_rows", ("sampled",))] == 32
    assert samples[("duelq_replay_ratio", ())] == 32 / 20
    assert samples[("duelq_step", ())] == 2
