"""Actor processes: each drives one client (or a raw byte stream) through a cell and tallies
the answers."""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import time
from collections import deque
from typing import Any, Callable

import grpc
import numpy as np

from duelq.client.client import LearnerClient

from duelq.wire.types import BFLOAT16, Batch, Transitions
from duelq.apps.bench.base import ACTOR_TIMEOUT_S, BenchError, cpu_seconds
from duelq.apps.bench.servers import ECHO_PATH, REPLY_BYTES
from duelq.server.server import tune_malloc


POOL = 4                             # distinct batches each actor cycles through


def make_batch(rng: np.random.Generator, B: int, H: int, N: int, wire: str) -> Batch:
    """A valid batch; features already 16-bit for a 16-bit wire (an actor producing them:
    a float16 or bfloat16 model's output), so no actor converts them per request."""
    features = {"float16": np.float16, "bfloat16": BFLOAT16}.get(wire, np.float32)
    return Batch(h_t=rng.standard_normal((B, H), dtype=np.float32).astype(features),
                 h_tp1=rng.standard_normal((B, H), dtype=np.float32).astype(features),
                 actions=rng.integers(0, N, B, dtype=np.int32),
                 rewards=rng.standard_normal(B, dtype=np.float32),
                 dones=(rng.random(B) < 0.1).astype(np.float32),
                 discounts=np.full(B, 0.99 ** 3, np.float32),
                 weights=rng.uniform(0.5, 1.5, B).astype(np.float32))


def make_transitions(rng: np.random.Generator, B: int, H: int, N: int, wire: str) -> Transitions:
    """B rows for the server's replay buffer, as :func:`make_batch` (no weights, no
    priorities: each row gets the buffer's largest priority)."""
    b = make_batch(rng, B, H, N, wire)
    return Transitions(h_t=b.h_t, h_tp1=b.h_tp1, actions=b.actions, rewards=b.rewards,
                       dones=b.dones, discounts=b.discounts)


class _Tally:
    """Latencies of the answers that arrive inside the measured window; all answers."""

    def __init__(self, t0: float, t_end: float):
        self.t0, self.t_end = t0, t_end
        self.latencies: list[float] = []
        self.answers = 0

    def add(self, sent: float, now: float) -> None:
        self.answers += 1
        if self.t0 <= now < self.t_end:
            self.latencies.append(now - sent)


def _run_echo(channel: grpc.Channel, job: dict, tally: _Tally) -> None:
    call_of = channel.stream_stream(ECHO_PATH)   # bytes in, bytes out
    payload = bytes(job["request_bytes"])
    feed: queue.SimpleQueue = queue.SimpleQueue()
    sent: deque[float] = deque()
    call = call_of(iter(feed.get, None), metadata=((REPLY_BYTES, str(job["reply_bytes"])),))

    def send() -> None:
        sent.append(time.monotonic())
        feed.put(payload)
    for _ in range(job["window"]):
        send()
    closed = False
    try:
        for _ in call:
            now = time.monotonic()
            tally.add(sent.popleft(), now)
            if now < tally.t_end:
                send()
            elif not sent:
                feed.put(None)   # half-close: the server ends the stream
                closed = True
    finally:
        if not closed:
            feed.put(None)
            call.cancel()


def _run_streamed(open_stream, items: list, job: dict, tally: _Tally) -> None:
    """``items`` in turn through a client stream (``LearnerClient.train_stream`` or
    ``insert_stream``), ``window`` in flight, until the tally's end."""
    sent: deque[float] = deque()

    def feed():
        i = 0
        while time.monotonic() < tally.t_end:
            sent.append(time.monotonic())
            yield items[i % len(items)]
            i += 1
    for _ in open_stream(feed(), window=job["window"]):
        tally.add(sent.popleft(), time.monotonic())


def _run_unary(client: LearnerClient, batches: list[Batch], job: dict, tally: _Tally) -> None:
    i = 0
    while (sent := time.monotonic()) < tally.t_end:
        client.train_step(batches[i % len(batches)])
        tally.add(sent, time.monotonic())
        i += 1


def _sleep_until(t: float) -> None:
    while (left := t - time.monotonic()) > 0:
        time.sleep(min(left, 0.05))


def _actor_job(conn, index: int, job: dict) -> dict:
    """Set up, say ready, wait for go, run, report.  Runs in an actor process."""
    if job["tune_malloc"]:
        tune_malloc()
    options = [("grpc.max_receive_message_length", job["max_message_bytes"]),
               ("grpc.max_send_message_length", job["max_message_bytes"]),
               *job["channel_options"]]
    if job["kind"] == "echo":
        channel = grpc.insecure_channel(job["target"], options)
        grpc.channel_ready_future(channel).result(timeout=job["ready_timeout"])
        client, batches, run = None, [], lambda t: _run_echo(channel, job, t)
    else:
        client = LearnerClient(job["target"], token=job["token"] or None,
                               feature_dtype=job["wire"], actor_id=f"bench-{index}-{os.getpid()}"
                               f"-{time.monotonic_ns()}", channel_options=job["channel_options"])
        client.wait_ready(job["ready_timeout"])
        rng = np.random.default_rng([job["seed"], index])
        make = make_transitions if job["kind"] == "replay" else make_batch
        batches = [make(rng, job["batch"], job["hidden_dim"], job["n_actions"], job["wire"])
                   for _ in range(POOL)]
        if job["kind"] == "unary":
            run = lambda t: _run_unary(client, batches, job, t)  # noqa: E731
        else:
            streams = {"stream": client.train_stream, "replay": client.insert_stream}
            run = lambda t: _run_streamed(streams[job["kind"]], batches, job, t)  # noqa: E731
    try:
        conn.send({"ready": True})
        go = conn.recv()
        if go is None:
            return {"aborted": True}
        tally = _Tally(go["t0"], go["t_end"])
        _sleep_until(go["start"])
        cpu = cpu_seconds()
        run(tally)
        return {"latencies": tally.latencies, "answers": tally.answers,
                "cpu_s": cpu_seconds() - cpu}
    finally:
        (client or channel).close()


def _actor_main(conn, index: int) -> None:
    """An actor process: run the jobs the coordinator sends until it sends None."""
    logging.basicConfig(level=logging.WARNING)
    while True:
        try:
            job = conn.recv()
        except (EOFError, KeyboardInterrupt):
            return
        if job is None:
            return
        try:
            result = _actor_job(conn, index, job)
        except Exception as exc:  # noqa: BLE001 — reported to the coordinator
            result = {"error": f"actor {index}: {type(exc).__name__}: {exc}"}
        try:
            conn.send(result)
        except (BrokenPipeError, EOFError):
            return


class ActorPool:
    """``n`` actor processes (spawned once, reused by every cell)."""

    def __init__(self, n: int):
        ctx = multiprocessing.get_context("spawn")
        self.conns, self.procs = [], []
        for i in range(n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_actor_main, args=(child, i), name=f"duelq-bench-actor-{i}",
                               daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def _recv(self, conn, timeout: float) -> dict:
        if not conn.poll(timeout):
            raise BenchError(f"an actor did not answer within {timeout:g} s")
        try:
            return conn.recv()
        except EOFError:
            raise BenchError("an actor process died") from None

    def run(self, jobs: list[dict], warmup: float, duration: float,
            on_go: Callable[[float, float], Any] | None = None) -> list[dict]:
        """Run one job per actor, all started together; their reports, in order.
        ``on_go(t0, t_end)`` is told the measured window once the actors have it."""
        conns = self.conns[:len(jobs)]
        for conn, job in zip(conns, jobs):
            conn.send(job)
        first = [self._recv(conn, ACTOR_TIMEOUT_S) for conn in conns]
        failed = [m["error"] for m in first if "error" in m]
        start = time.monotonic() + 0.05
        go = None if failed else {"start": start, "t0": start + warmup,
                                  "t_end": start + warmup + duration}
        for conn, m in zip(conns, first):
            if "ready" in m:
                conn.send(go)
        if go is not None and on_go is not None:
            on_go(go["t0"], go["t_end"])
        reports = [self._recv(conn, warmup + duration + ACTOR_TIMEOUT_S) if "ready" in m else m
                   for conn, m in zip(conns, first)]
        failed += [r["error"] for r in reports if "error" in r and r not in first]
        if failed:
            raise BenchError("; ".join(dict.fromkeys(failed)))
        return reports

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self.procs:
            proc.join(5)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
