"""Greedy and hostile clients cannot starve the actors; every limit holds in every model.

Each test runs through the real wire against one server per model, one process and two
front processes, with a bearer token and small limits.  Where a test needs the learner
busy it holds it (:func:`learner_held`): one process, a step waits at a gate in its
backend; front processes, the learner process is stopped (SIGSTOP) while a step waits for
it.  Either way a call is held by the learner, never by a clock, so the counts are exact.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import threading
import time

import grpc
import numpy as np
import pytest

from duelq.client import LearnerClient, encode_batch
from duelq.server.fronts import FrontServer, start_server
from duelq.server.gate import too_many_rpcs
from duelq.server.server import SERVICE_NAME, ServerOptions
from duelq.server.service import queue_full, stream_idle, too_many_streams
from duelq.v1 import learner_pb2 as pb
from duelq.v1 import learner_pb2_grpc as pb_grpc

from conftest import SMALL, random_batch
from test_limits import Gate, wait_for

TOKEN = "sekrit"
GOOD = (("authorization", f"Bearer {TOKEN}"),)
MAX_RPCS, MAX_STREAMS, MAX_QUEUE, RECEIVE_TIMEOUT_S, MAX_ACTORS = 8, 3, 4, 2.0, 2
REFUSED = 3   # calls past a limit in each test


@pytest.fixture(scope="module", params=[0, 2], ids=["one-process", "two-front-processes"])
def served(request):
    server = start_server(SMALL, ServerOptions(
        port=0, front_processes=request.param, token=TOKEN, max_rpcs=MAX_RPCS,
        max_streams=MAX_STREAMS, max_queue=MAX_QUEUE, receive_timeout_s=RECEIVE_TIMEOUT_S,
        max_actors=MAX_ACTORS), backend="reference")
    yield server
    server.stop(0)


def connections(server, n: int) -> list[grpc.Channel]:
    """``n`` channels to ``server``, each on a connection of its own (which the kernel
    gives to either front), connected."""
    channels = [grpc.insecure_channel(server.target, options=[
        ("grpc.use_local_subchannel_pool", 1)]) for _ in range(n)]
    for channel in channels:
        grpc.channel_ready_future(channel).result(timeout=30)
    return channels


def step_request(rows: int = 8, seed: int = 0) -> pb.TrainRequest:
    """A train request without a key (these tests leave the actors' table alone)."""
    return encode_batch(random_batch(np.random.default_rng(seed), rows))


def steps(server) -> int:
    with grpc.insecure_channel(server.target) as channel:
        return pb_grpc.LearnerStub(channel).GetInfo(pb.GetInfoRequest(), metadata=GOOD,
                                                    timeout=30).step


@contextlib.contextmanager
def learner_held(server, *, applied: bool = True):
    """The learner busy with one step (which holds an rpc place) until the block ends;
    ``applied``: check that the step is applied then (else only that it is answered)."""
    channel = grpc.insecure_channel(server.target)
    stub = pb_grpc.LearnerStub(channel)
    try:
        if isinstance(server, FrontServer):
            pid = server._process.pid
            os.kill(pid, signal.SIGSTOP)
            try:
                held = stub.TrainStep.future(step_request(), metadata=GOOD)
                wait_for(lambda: server._counts.total("queue") == 1, 30)   # at the learner
                yield
            finally:
                os.kill(pid, signal.SIGCONT)
        else:
            gate = Gate(server.learner.backend)
            held = stub.TrainStep.future(step_request(), metadata=GOOD)
            assert gate.entered.acquire(timeout=30)
            try:
                yield
            finally:
                gate.opened.set()
        if applied:
            assert held.result(timeout=30).step >= 1
        else:
            held.exception(timeout=30)
    finally:
        channel.close()


def open_streams(server) -> int:
    """Stream places held, server-wide."""
    if isinstance(server, FrontServer):
        return server._counts.total("streams")
    return MAX_STREAMS - server.service._streams._value


def refusals(futures: list, want: int) -> list[tuple[grpc.StatusCode, str]]:
    """(code, details) of the first ``want`` of ``futures`` to end, waiting 30 s at most
    (the others wait for the held learner)."""
    deadline = time.monotonic() + 30
    while sum(f.done() for f in futures) < want:
        assert time.monotonic() < deadline, f"{sum(f.done() for f in futures)} of {want} ended"
        time.sleep(0.01)
    return [(f.exception().code(), f.exception().details()) for f in futures if f.done()]


def assert_rpc_places_are_all_free(server) -> None:
    """With the learner held, MAX_RPCS − 1 more calls hold a place each and REFUSED more are
    refused, whichever front each came to."""
    channels = connections(server, MAX_RPCS - 1 + REFUSED)
    try:
        with learner_held(server):
            calls = [pb_grpc.LearnerStub(c).GetWeights.future(pb.GetWeightsRequest(),
                                                              metadata=GOOD)
                     for c in channels]
            assert refusals(calls, REFUSED) == [(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                 too_many_rpcs(MAX_RPCS))] * REFUSED
        served = [c for c in calls if c.exception(timeout=30) is None]
        assert len(served) == MAX_RPCS - 1
    finally:
        for channel in channels:
            channel.close()


def nothing(release: threading.Event):
    """A request stream that sends nothing (its call's headers only) until ``release``."""
    release.wait()
    return
    yield


def test_header_only_calls_without_the_token_hold_nothing(served):
    """A client without the token sends headers and nothing more, three times max_rpcs
    over: every call is refused at once, and an actor with the token is served."""
    release = threading.Event()
    channel = grpc.insecure_channel(served.target)
    try:
        calls = [channel.stream_unary(f"/{SERVICE_NAME}/GetInfo").future(nothing(release))
                 for _ in range(3 * MAX_RPCS)]
        assert {(f.exception(timeout=30).code()) for f in calls} == {
            grpc.StatusCode.UNAUTHENTICATED}
        with LearnerClient(served.target, token=TOKEN, retries=0) as actor:
            assert actor.info().max_streams == MAX_STREAMS
    finally:
        release.set()
        channel.close()


def test_calls_that_send_no_request_end_after_the_receive_timeout(served):
    """With the token: max_rpcs calls that send their headers only, a TrainStream and an
    InsertStream that send nothing and a TrainStream that sent a request and then nothing,
    hold their places no longer than receive_timeout_s: unary calls are cancelled, streams
    end UNAVAILABLE (the client reopens them); every place is free again."""
    release = threading.Event()
    channels = connections(served, MAX_RPCS)
    try:
        unary = [c.stream_unary(f"/{SERVICE_NAME}/GetInfo").future(nothing(release),
                                                                   metadata=GOOD)
                 for c in channels[:MAX_RPCS - 3]]
        silent, silent_insert = (channel.stream_stream(f"/{SERVICE_NAME}/{method}")(
            nothing(release), metadata=GOOD, timeout=60) for channel, method in
            zip(channels[-3:-1], ("TrainStream", "InsertStream")))

        def one_then_nothing():
            yield step_request()
            yield from nothing(release)
        paused = pb_grpc.LearnerStub(channels[-1]).TrainStream(one_then_nothing(),
                                                              metadata=GOOD, timeout=60)
        assert next(paused).step >= 1
        assert {f.exception(timeout=30).code() for f in unary} == {grpc.StatusCode.CANCELLED}
        for stream in (silent, silent_insert, paused):
            with pytest.raises(grpc.RpcError) as ended:
                next(stream)   # waits at most receive_timeout_s
            assert (ended.value.code(), ended.value.details()) == (
                grpc.StatusCode.UNAVAILABLE, stream_idle(RECEIVE_TIMEOUT_S))
    finally:
        release.set()
        for channel in channels:
            channel.close()
    assert_rpc_places_are_all_free(served)


def test_max_rpcs_is_server_wide_and_refused_at_the_call(served):
    assert_rpc_places_are_all_free(served)


def test_max_streams_is_server_wide_and_refused_at_open(served):
    """max_streams streams open (each with a request at the held learner); more, on other
    connections, are refused at open, before they send anything."""
    channels = connections(served, MAX_STREAMS + REFUSED)
    release = threading.Event()

    def one_then_nothing():
        yield step_request()
        yield from nothing(release)
    try:
        with learner_held(served):
            opened = [pb_grpc.LearnerStub(c).TrainStream(one_then_nothing(), metadata=GOOD,
                                                         timeout=60)
                      for c in channels[:MAX_STREAMS]]
            wait_for(lambda: _at_learner(served) == MAX_STREAMS, 30)
            extra = [c.stream_stream(f"/{SERVICE_NAME}/TrainStream")(
                nothing(release), metadata=GOOD, timeout=60) for c in channels[MAX_STREAMS:]]
            for stream in extra:
                with pytest.raises(grpc.RpcError) as refused:
                    next(stream)   # it sent nothing: refused at its headers
                assert (refused.value.code(), refused.value.details()) == (
                    grpc.StatusCode.RESOURCE_EXHAUSTED, too_many_streams(MAX_STREAMS))
        assert [next(s).step >= 1 for s in opened] == [True] * MAX_STREAMS
    finally:
        release.set()
        for channel in channels:
            channel.close()


def _at_learner(server) -> int:
    """Requests that wait for the learner (one process) or are at the learner process
    besides the held step (fronts): what max_queue counts."""
    if isinstance(server, FrontServer):
        return server._counts.total("queue") - 1
    return server.service._queued


def test_max_queue_is_server_wide_and_refused_at_once(served):
    """With the learner held, max_queue TrainSteps wait; more are refused at once, with the
    one-process server's words, and change nothing."""
    channels = connections(served, MAX_QUEUE + REFUSED)
    before = steps(served)
    try:
        with learner_held(served):
            calls = [pb_grpc.LearnerStub(c).TrainStep.future(step_request(seed=i),
                                                             metadata=GOOD)
                     for i, c in enumerate(channels)]
            assert refusals(calls, REFUSED) == [(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                 queue_full(MAX_QUEUE))] * REFUSED
        waited = [c for c in calls if c.exception(timeout=30) is None]
        assert len(waited) == MAX_QUEUE
        # Each applied once; with two fronts the held step need not be the first applied.
        got = sorted(c.result().step for c in waited)
        assert len(set(got)) == MAX_QUEUE and before < got[0] and got[-1] <= before + 1 + MAX_QUEUE
        assert steps(served) == before + 1 + MAX_QUEUE   # the held step and those that waited
    finally:
        for channel in channels:
            channel.close()


def test_train_replay_waits_in_the_same_queue_as_the_steps(served):
    """With the learner held, TrainReplay and TrainStep calls share max_queue's places, in
    every model: of MAX_QUEUE + REFUSED of them, REFUSED are refused at once."""
    channels = connections(served, MAX_QUEUE + REFUSED)
    try:
        with learner_held(served):
            calls = [pb_grpc.LearnerStub(c).TrainReplay.future(
                         pb.TrainReplayRequest(steps=1), metadata=GOOD) if i % 2 else
                     pb_grpc.LearnerStub(c).TrainStep.future(step_request(seed=i),
                                                             metadata=GOOD)
                     for i, c in enumerate(channels)]
            assert refusals(calls, REFUSED) == [(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                 queue_full(MAX_QUEUE))] * REFUSED
        ended = [c.exception(timeout=30) for c in calls]
        # Those that waited: a step applied, or TrainReplay refused for want of a buffer.
        waited = [e for e in ended if e is None or e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED]
        assert len(waited) == MAX_QUEUE
        assert all(e is None or e.code() == grpc.StatusCode.FAILED_PRECONDITION for e in waited)
    finally:
        for channel in channels:
            channel.close()


def test_refusals_wait_for_nothing_while_the_learner_is_busy(served):
    """With the learner held (front processes: not reading their frames), 1500 calls
    without the token are all refused at once: a refusal waits for no learner, so a flood
    of them holds no thread that a health check or an actor needs."""
    with grpc.insecure_channel(served.target) as channel, learner_held(served):
        stub = pb_grpc.LearnerStub(channel)
        calls = [stub.GetInfo.future(pb.GetInfoRequest()) for _ in range(1500)]
        got = collections.Counter(refusals(calls, len(calls)))
    # A refusal does not read the request, so a call whose request was still on its way
    # may end CANCELLED instead (a few of thousands); none gets anything else.
    assert got[grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token"] > 0
    assert set(got) <= {(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token"),
                        (grpc.StatusCode.CANCELLED, "CANCELLED")}


def test_a_stream_whose_answers_are_not_read_is_not_served_past_its_window(served):
    """A client streams 300 requests and reads none of its answers (8 KiB each, into an
    HTTP/2 window of 64 KiB): the server stops reading it after a few, as HTTP/2 flow
    control stops it, while an actor beside it trains 100 steps; receive_timeout_s after
    an answer went unread the server cancels it, and every stream place is free again."""
    flood_channel = grpc.insecure_channel(served.target, options=[
        ("grpc.http2.bdp_probe", 0), ("grpc.use_local_subchannel_pool", 1)])
    big = step_request(rows=1024).SerializeToString()
    before = steps(served)

    def flood():
        for _ in range(300):
            yield big
    flooding = flood_channel.stream_stream(f"/{SERVICE_NAME}/TrainStream")(
        flood(), metadata=GOOD)   # never read
    try:
        with grpc.insecure_channel(served.target) as channel:
            actor = pb_grpc.LearnerStub(channel)
            for i in range(100):
                actor.TrainStep(step_request(seed=i), metadata=GOOD, timeout=30)
        flooded = steps(served) - before - 100
        assert flooded <= 48, f"{flooded} requests of a stream whose answers nobody reads"
        wait_for(lambda: open_streams(served) == 0, 30)   # cancelled by the server
        channels, done = connections(served, MAX_STREAMS), threading.Event()

        def one_then_wait():   # a stream that stays open, holding its place, until done
            yield step_request()
            done.wait(30)
        try:
            streams = [pb_grpc.LearnerStub(c).TrainStream(one_then_wait(), metadata=GOOD,
                                                          timeout=30) for c in channels]
            assert all(next(stream).step > 0 for stream in streams)
        finally:
            done.set()
            for channel in channels:
                channel.close()
    finally:
        flooding.cancel()
        flood_channel.close()


def test_past_max_actors_a_new_actor_is_refused_and_no_key_applies_twice(served):
    """max_actors actors are tracked; a new one is refused (nothing applied) rather than
    forget one, so a tracked actor's resent key is answered, not applied again."""
    def keyed(actor: str, seq: int) -> pb.TrainRequest:
        request = step_request(seed=seq)
        request.key.CopyFrom(pb.RequestKey(actor_id=actor, seq=seq))
        return request
    with grpc.insecure_channel(served.target) as channel:
        stub = pb_grpc.LearnerStub(channel)
        first = [stub.TrainStep(keyed(f"actor-{a}", 1), metadata=GOOD, timeout=30)
                 for a in range(MAX_ACTORS)]
        before = steps(served)
        with pytest.raises(grpc.RpcError) as refused:
            stub.TrainStep(keyed("newcomer", 1), metadata=GOOD, timeout=30)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"max_actors {MAX_ACTORS}" in refused.value.details()
        again = stub.TrainStep(keyed("actor-0", 1), metadata=GOOD, timeout=30)
        assert (again.replayed, again.step) == (True, first[0].step)
        assert steps(served) == before
        assert stub.TrainStep(keyed("actor-0", 2), metadata=GOOD, timeout=30).step == before + 1
