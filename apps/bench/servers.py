"""The servers a bench cell talks to: the byte-echo ceiling, the learner server in a process of
its own, and the in-line instruments (timed backend, lock and interceptor) of server overhead."""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
import time
from collections import deque
from concurrent import futures
from typing import Any, Callable, Iterable, Sequence

import grpc
import numpy as np

from duelq.server.core.backend import Backend, StepOutputs, Upload
from duelq.server.core.batch import Batch, PackedBatch
from duelq.server.core.config import LearnerConfig
from duelq.server.core.learner import Learner
from duelq.server.core.reference import ReferenceBackend
from duelq.server.server import LearnerServer, ServerOptions
from duelq.server.server import server_args as duelq_server_args
from duelq.server.server import tune_malloc
from duelq.server.core.state import LearnerState
from duelq.apps.bench.base import ACTOR_TIMEOUT_S, BenchError, cpu_seconds


ECHO_SERVICE = "duelq.bench.Echo"
ECHO_PATH = f"/{ECHO_SERVICE}/Stream"
REPLY_BYTES = "x-reply-bytes"        # metadata: size of each echo reply
TRAIN_METHODS = ("/duelq.v1.Learner/TrainStep", "/duelq.v1.Learner/TrainStream")


#: Channel arguments tried as "tuned": a larger initial HTTP/2 stream window, larger
#: frames and larger socket reads than gRPC's defaults (64 KiB, 16 KiB, 8 KiB).
TUNED_OPTIONS = (("grpc.http2.lookahead_bytes", 8 << 20),
                 ("grpc.http2.max_frame_size", 4 << 20),
                 ("grpc.experimental.tcp_read_chunk_size", 1 << 20),
                 ("grpc.experimental.tcp_min_read_chunk_size", 256 << 10),
                 ("grpc.experimental.tcp_max_read_chunk_size", 8 << 20))


class NullBackend(ReferenceBackend):
    """A backend whose step does no arithmetic: the service path's cost without the math."""

    name = "null"
    device = "none (no-op step)"

    def __init__(self, config: LearnerConfig, state: LearnerState):
        super().__init__(config, state)
        self._steps = state.step

    @property
    def step(self) -> int:
        return self._steps

    def propose(self, batch: Batch | PackedBatch, upload: Upload | None = None) -> StepOutputs:
        zeros = np.zeros(batch.size, np.float32)
        return StepOutputs(loss=0.0, td_errors=zeros, priorities=zeros, q_taken_mean=0.0,
                           grad_norm=0.0, finite=True, entropy=None)

    def commit(self) -> None:
        self._steps += 1

    def discard(self) -> None:
        pass


class TimedBackend(Backend):
    """Delegates to ``inner``; adds up wall and thread-CPU seconds of propose and commit."""

    def __init__(self, inner: Backend):
        self.inner = inner
        self.config = inner.config
        self.name, self.device = inner.name, inner.device
        self.checks_values = inner.checks_values
        self.feature_dtypes = inner.feature_dtypes
        self.seconds = 0.0       # wall, propose + commit (+ discard)
        self.cpu_seconds = 0.0   # CPU time of the calling thread in them

    def __getattr__(self, name: str) -> Any:  # backend-specific extras (stream, stage, …)
        return getattr(self.inner, name)

    @property
    def step(self) -> int:
        return self.inner.step

    def _timed(self, fn: Callable, *args):
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return fn(*args)
        finally:
            self.seconds += time.perf_counter() - t0
            self.cpu_seconds += time.thread_time() - c0

    def upload(self, batch: Batch) -> Upload | None:  # the copy: not timed as backend work
        return self.inner.upload(batch)

    def pin(self, region: np.ndarray) -> None:
        self.inner.pin(region)

    def propose(self, batch: Batch, upload: Upload | None = None) -> StepOutputs:
        return self._timed(self.inner.propose, batch, upload)

    def commit(self) -> None:
        self._timed(self.inner.commit)

    def discard(self) -> None:
        self._timed(self.inner.discard)

    def snapshot(self) -> LearnerState:
        return self.inner.snapshot()

    def load(self, state: LearnerState) -> None:
        self.inner.load(state)

    def weights(self, target: bool = False):
        return self.inner.weights(target)

    def q_values(self, h: np.ndarray, target: bool = False) -> np.ndarray:
        return self.inner.q_values(h, target)

    def entropy(self, actions: np.ndarray, slot: int, alpha: float) -> tuple[float, float]:
        return self.inner.entropy(actions, slot, alpha)

    def read_isv(self, indices: np.ndarray):
        return self.inner.read_isv(indices)


class TimedLock:
    """A lock that adds up the seconds callers wait to acquire it."""

    def __init__(self, lock):
        self._lock = lock
        self.wait_s = 0.0

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        t0 = time.perf_counter()
        got = self._lock.acquire(blocking, timeout)
        self.wait_s += time.perf_counter() - t0
        return got

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class ServerClock(grpc.ServerInterceptor):
    """Times train rpcs in-line: grpc's protobuf parse and serialise, and the handler.

    Besides wall time it adds up the CPU time (``time.thread_time``) of the thread each
    phase runs on (a stream's handler: its thread's time between two answers), which
    leaves out waiting: for the apply lock, for the GIL, for a core.  On a loaded machine the CPU figure
    is the overhead; the wall figure is what a request sees.
    """

    def __init__(self):
        self.lock = threading.Lock()
        self.totals = dict(requests=0, parse_s=0.0, handler_s=0.0, serialize_s=0.0,
                           parse_cpu_s=0.0, handler_cpu_s=0.0, serialize_cpu_s=0.0)

    def snapshot(self) -> dict:
        with self.lock:
            return dict(self.totals)

    def _add(self, **seconds) -> None:
        with self.lock:
            for name, value in seconds.items():
                self.totals[name] += value

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or details.method not in TRAIN_METHODS:
            return handler

        def parse(data: bytes):
            t0, c0 = time.perf_counter(), time.thread_time()
            request = handler.request_deserializer(data)
            self._add(parse_s=time.perf_counter() - t0, parse_cpu_s=time.thread_time() - c0)
            return request

        def serialize(response) -> bytes:
            t0, c0 = time.perf_counter(), time.thread_time()
            data = handler.response_serializer(response)
            self._add(serialize_s=time.perf_counter() - t0,
                      serialize_cpu_s=time.thread_time() - c0)
            return data

        if handler.unary_unary:
            inner = handler.unary_unary

            def unary(request, context):
                t0, c0 = time.perf_counter(), time.thread_time()
                try:
                    return inner(request, context)
                finally:
                    self._add(requests=1, handler_s=time.perf_counter() - t0,
                              handler_cpu_s=time.thread_time() - c0)
            return grpc.unary_unary_rpc_method_handler(unary, parse, serialize)

        inner_stream = handler.stream_stream

        def stream(request_iterator, context):
            # The requests may be read on another thread (TrainStream reads ahead): wall
            # time from a request's arrival, CPU time of this thread since its last answer.
            started = deque()

            def arrivals():
                for request in request_iterator:
                    started.append(time.perf_counter())
                    yield request
            c0 = time.thread_time()
            for response in inner_stream(arrivals(), context):
                self._add(requests=1, handler_s=time.perf_counter() - started.popleft(),
                          handler_cpu_s=time.thread_time() - c0)
                yield response
                c0 = time.thread_time()
        return grpc.stream_stream_rpc_method_handler(stream, parse, serialize)


def _reply_size(context) -> int:
    return int(dict(context.invocation_metadata()).get(REPLY_BYTES, "0"))


def _echo_stream(request_iterator, context):
    reply = bytes(_reply_size(context))
    for _ in request_iterator:
        yield reply


async def _aio_echo_stream(request_iterator, context):
    reply = bytes(_reply_size(context))
    async for _ in request_iterator:
        yield reply


def _echo_handler(fn) -> grpc.GenericRpcHandler:
    # No (de)serializers: requests and replies are the raw message bytes.
    return grpc.method_handlers_generic_handler(
        ECHO_SERVICE, {"Stream": grpc.stream_stream_rpc_method_handler(fn)})


def server_args(options: ServerOptions, extra: Iterable = (), *,
                share_port: bool = False) -> list:
    """The channel arguments of duelq's own server (server/server.py), plus ``extra``."""
    return [*duelq_server_args(options, share_port=share_port), *extra]


class EchoServer:
    """The byte stream on grpc's sync server: duelq's threading model, no service code."""

    def __init__(self, options: ServerOptions, addresses: Sequence[str], extra: Iterable = (),
                 *, share_port: bool = False):
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=options.max_rpcs,
                                       thread_name_prefix="bench-echo"),
            handlers=(_echo_handler(_echo_stream),),
            options=server_args(options, extra, share_port=share_port),
            maximum_concurrent_rpcs=options.max_rpcs)
        self.ports = [self._server.add_insecure_port(a) for a in addresses]
        self._server.start()

    def stop(self) -> None:
        self._server.stop(0).wait()


def _echo_main(conn, options: ServerOptions, addresses: Sequence[str], extra: list) -> None:
    """One process of :class:`EchoProcesses`."""
    server = EchoServer(options, addresses, extra, share_port=True)
    conn.send(server.ports)
    try:
        conn.recv()
    except EOFError:
        pass
    server.stop()


class EchoProcesses:
    """The byte stream served by ``count`` processes that share each TCP port (SO_REUSEPORT:
    the kernel spreads connections over them), as ``--front-processes`` serves duelq; a Unix
    socket is served by the first process alone."""

    def __init__(self, options: ServerOptions, addresses: Sequence[str], extra: Iterable = (),
                 *, count: int):
        ctx = multiprocessing.get_context("spawn")
        self._procs: list = []
        self.ports: list[int] = []
        for index in range(count):
            wanted = addresses if index == 0 else [
                f"127.0.0.1:{port}" for a, port in zip(addresses, self.ports)
                if not a.startswith("unix:")]
            conn, child = ctx.Pipe()
            proc = ctx.Process(target=_echo_main, args=(child, options, wanted, list(extra)),
                               name=f"duelq-bench-echo-{index}", daemon=True)
            proc.start()
            child.close()
            self._procs.append((proc, conn))
            if not conn.poll(ACTOR_TIMEOUT_S):
                self.stop()
                raise BenchError("a byte-stream process did not start")
            ports = conn.recv()
            if index == 0:
                self.ports = ports

    def stop(self) -> None:
        for proc, conn in self._procs:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc, _ in self._procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()


class AioEchoServer:
    """The byte stream on grpc.aio, its event loop on a thread of its own."""

    def __init__(self, options: ServerOptions, addresses: Sequence[str], extra: Iterable = ()):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="bench-aio-echo",
                                        daemon=True)
        self._thread.start()

        async def start():
            server = grpc.aio.server(options=server_args(options, extra))
            server.add_generic_rpc_handlers((_echo_handler(_aio_echo_stream),))
            ports = [server.add_insecure_port(a) for a in addresses]
            await server.start()
            return server, ports
        self._server, self.ports = asyncio.run_coroutine_threadsafe(start(), self._loop).result()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._server.stop(0), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


def _server_main(conn, config: LearnerConfig, options: ServerOptions, tune: bool) -> None:
    """A learner on the null backend and a byte-stream server, in a process of their own."""
    if tune:
        tune_malloc()
    server = LearnerServer(options)
    server.start()
    server.attach(Learner(config, backend=NullBackend(config, LearnerState.initial(config)),
                          max_batch_size=options.max_batch_size))
    echo = EchoServer(options, ["127.0.0.1:0"])
    conn.send({"learner": server.target, "echo": f"127.0.0.1:{echo.ports[0]}"})
    try:
        while conn.recv() == "cpu":
            conn.send(cpu_seconds())
    except EOFError:
        pass
    echo.stop()
    server.stop(0)


class ServerProcess:
    """:func:`_server_main` in a spawned process; its targets and its CPU time."""

    def __init__(self, config: LearnerConfig, options: ServerOptions, tune: bool):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_server_main, args=(child, config, options, tune),
                                name="duelq-bench-server", daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(ACTOR_TIMEOUT_S):
            raise BenchError("the server process did not start")
        self.targets = self.conn.recv()

    def cpu_seconds(self) -> float:
        self.conn.send("cpu")
        return self.conn.recv()

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
