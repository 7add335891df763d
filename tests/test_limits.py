"""Limits and overload: queue depth, batch limits of every rpc, deadlines, a bounded load test.

(Message size, batch size of TrainStep and the stream / rpc concurrency limits
are in test_service.py.)
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from duelq.client import LearnerClient, encode_batch, errors
from duelq.server.service import NotServing
from duelq.wire.tensors import encode
from duelq.v1 import learner_pb2 as pb
from duelq.v1 import learner_pb2_grpc as pb_grpc

from conftest import SMALL, random_batch
from helpers import wait_for
from test_faults import Served, free_port


class Gate:
    """Makes the backend's step wait at a gate: the first ``hold`` proposals block."""

    def __init__(self, backend, hold: int = 1):
        self.entered, self.opened = threading.Semaphore(0), threading.Event()
        self._propose, self._hold = backend.propose, hold
        backend.propose = self.propose

    def propose(self, batch, upload=None):
        if self._hold > 0:
            self._hold -= 1
            self.entered.release()
            self.opened.wait(30)
        return self._propose(batch, upload)


def keyed(rng, seq: int, actor: str = "a") -> pb.TrainRequest:
    request = encode_batch(random_batch(rng, 8))
    request.key.CopyFrom(pb.RequestKey(actor_id=actor, seq=seq))
    return request


def test_queue_past_max_queue_is_resource_exhausted(make_server):
    server = make_server(max_queue=1)
    gate = Gate(server.learner.backend)
    rng = np.random.default_rng(0)
    s = pb_grpc.LearnerStub(grpc.insecure_channel(server.target))
    running = s.TrainStep.future(keyed(rng, 1))
    assert gate.entered.acquire(timeout=10)            # step 1 holds the learner
    queued = s.TrainStep.future(keyed(rng, 2))
    wait_for(lambda: server.service._queued == 1)     # step 2 waits: the queue is full
    with pytest.raises(grpc.RpcError) as info:
        s.TrainStep(keyed(rng, 3), timeout=10)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_queue 1" in info.value.details()
    gate.opened.set()
    assert (running.result(10).step, queued.result(10).step) == (1, 2)
    assert s.TrainStep(keyed(rng, 3)).step == 3         # refused, so not applied: new again


class CountingLock:
    """A lock that counts the callers blocked in acquire."""

    def __init__(self):
        self._lock, self._meta, self.waiting = threading.Lock(), threading.Lock(), 0

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        with self._meta:
            self.waiting += blocking
        try:
            return self._lock.acquire(blocking, timeout)
        finally:
            with self._meta:
                self.waiting -= blocking

    def release(self) -> None:
        self._lock.release()

    __enter__ = acquire

    def __exit__(self, *exc) -> None:
        self.release()


def test_the_replay_loop_takes_no_place_in_the_queue(make_server):
    """The server's replay loop waiting for the learner leaves max_queue to the clients,
    as with --front-processes (whose fronts count only the clients' calls); once a drain
    has begun it starts no run."""
    server = make_server(max_queue=1)
    service, rng = server.service, np.random.default_rng(0)
    lock = service._apply_lock = CountingLock()
    results: list = []
    loop = threading.Thread(target=lambda: results.append(service.train_due(4)))
    s = pb_grpc.LearnerStub(grpc.insecure_channel(server.target))
    lock.acquire()                                      # a request holds the learner
    try:
        loop.start()
        wait_for(lambda: lock.waiting == 1)             # the loop waits
        queued = s.TrainStep.future(keyed(rng, 1))
        wait_for(lambda: lock.waiting == 2 or queued.done())
        assert not queued.done(), queued.exception()    # the client's call waits too
        assert service._queued == 1
    finally:
        lock.release()
    assert queued.result(10).step == 1
    loop.join(10)
    assert results == [None]                            # the buffer is off: nothing due
    service.drain()
    with pytest.raises(NotServing):
        service.train_due(4)


def test_act_and_entropy_over_the_batch_limit_are_resource_exhausted(make_server):
    server = make_server(max_batch_size=16)
    s = pb_grpc.LearnerStub(grpc.insecure_channel(server.target))
    before = server.learner.snapshot().checksum()
    act = pb.ActRequest(h=encode(np.zeros((17, SMALL.hidden_dim), np.float32), "h"))
    entropy = pb.ComputeEntropyRequest(actions=encode(np.zeros(17, np.int32), "actions"),
                                       slot=pb.SlotRef(name="policy_entropy_ema"), alpha=0.5)
    for call, request in ((s.Act, act), (s.ComputeEntropy, entropy)):
        with pytest.raises(grpc.RpcError) as info:
            call(request, timeout=10)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "17" in info.value.details() and "16" in info.value.details()
    assert server.learner.snapshot().checksum() == before


def test_deadline_passing_in_the_queue_applies_nothing(make_server):
    server = make_server()
    gate = Gate(server.learner.backend)
    rng = np.random.default_rng(1)
    batch = random_batch(rng, 8)
    with LearnerClient(server.target, actor_id="other") as other, \
            LearnerClient(server.target, actor_id="late", timeout=0.3) as late:
        worker = threading.Thread(target=other.train_step, args=(random_batch(rng, 8),))
        worker.start()
        assert gate.entered.acquire(timeout=10)          # the learner is busy
        with pytest.raises(errors.DeadlineExceeded) as info:
            late.train_step(batch)
        assert info.value.seq == 1
        wait_for(lambda: server.service._queued == 0)  # it left the queue...
        gate.opened.set()
        worker.join(10)
        assert server.learner.step_count == 1           # ...without being applied
        resent = late.train_step(batch, seq=info.value.seq)
        assert not resent.replayed and resent.step == 2


def test_deadline_passing_during_the_step_keeps_it_applied_once(make_server):
    server = make_server()
    gate = Gate(server.learner.backend)
    batch = random_batch(np.random.default_rng(2), 8)
    with LearnerClient(server.target, actor_id="slow", timeout=2.0) as client:
        with pytest.raises(errors.DeadlineExceeded) as info:
            client.train_step(batch)                    # the gate holds the step past it
        assert gate.entered.acquire(timeout=30)         # the step had started...
        gate.opened.set()
        wait_for(lambda: server.learner.step_count == 1)  # ...so it is applied
        resent = client.train_step(batch, seq=info.value.seq)
        assert resent.replayed and resent.step == 1 and server.learner.step_count == 1
        with pytest.raises(errors.InvalidArgument, match="seq"):
            client.train_step(batch, seq=2)             # never used by this client


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RSS from /proc")
def test_many_actors_for_seconds_hold_memory_steady_and_see_no_errors():
    actors, seconds, rows = 16, 4.0, 64
    server = Served(free_port(), "--max-streams", "16", "--max-rpcs", "24")
    results = [0] * actors
    failures: list[BaseException] = []
    stop = threading.Event()

    def batches(rng):
        pool = [random_batch(rng, rows) for _ in range(8)]
        while not stop.is_set():
            yield pool[rng.integers(len(pool))]

    def actor(a: int) -> None:
        try:
            with LearnerClient(server.target, actor_id=f"load-{a}") as client:
                for _ in client.train_stream(batches(np.random.default_rng(a)), window=4):
                    results[a] += 1
        except BaseException as exc:  # noqa: BLE001 — reported below
            failures.append(exc)

    try:
        server.wait_serving()
        pid = server.process.pid
        threads = [threading.Thread(target=actor, args=(a,)) for a in range(actors)]
        for t in threads:
            t.start()
        wait_for(lambda: min(results) > 0 or failures, 120, "an actor never got an answer")
        time.sleep(1.0)                                   # warm-up: caches and pools fill
        samples, started = [rss_bytes(pid)], time.monotonic()
        while time.monotonic() - started < seconds:
            time.sleep(0.25)
            samples.append(rss_bytes(pid))
        stop.set()
        for t in threads:
            t.join(30)
        with LearnerClient(server.target) as client:
            step = client.info().step
    finally:
        stop.set()
        server.kill()
    assert not failures, failures[:3]
    assert step == sum(results) and min(results) > 0
    growth = max(samples) - samples[0]
    print(f"load: {actors} actors, {sum(results)} steps of B={rows} in ~{seconds + 1:.0f} s, "
          f"server RSS {samples[0] / 2**20:.1f} MiB after warm-up, max "
          f"{max(samples) / 2**20:.1f} MiB (+{growth / 2**20:.1f} MiB)")
    assert growth < 32 * 2**20
