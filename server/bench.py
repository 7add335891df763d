"""``duelq bench``: the learner service's throughput, side by side with a bare gRPC byte stream.

Each figure is measured in one run next to its ceiling, and printed as a ratio to it:

* ``echo``   a bare gRPC bidi stream of bytes (a generic handler, no protobuf, no numpy)
             that answers each request with a reply the size of a TrainResponse.  Same
             request size, window, actor count and transport as the cells it is the
             ceiling of: the most the wire and gRPC's Python runtime can carry.
* ``stream`` ``LearnerClient.train_stream`` (``--window`` batches in flight).
* ``unary``  ``LearnerClient.train_step`` in a loop.

Actors are processes (``multiprocessing``, spawn), each with its own client and
a few pre-built batches it cycles through, so actor-side work is the client
library's (checks, encode, decode), not data generation.  All actors of a cell
start at the same instant, run ``--warmup`` seconds unmeasured, then count the
answers that arrive during the next ``--duration`` seconds: steps/s is that
count over the duration, summed over actors; transitions/s is steps/s × B.
Latency runs from the moment an actor hands a batch to the client to the moment
its answer is back (client encode, the window's queueing and the server included).

Learner backends: the real one (``--backend``: reference on a CPU, cuda on a GPU)
and ``null`` (every cell also run with a no-op step): decode, validate,
idempotency keys and encode without arithmetic, i.e. what the service path costs
on top of the wire.  Server-side overhead per step is measured in-line on the
in-process server by an interceptor (protobuf parse and serialise in grpc's
(de)serializers, time in the handler) and a timed backend wrapper (``propose``,
``commit``): overhead = parse + handler − propose − commit − lock wait + serialise.
The copy into pinned memory towards the device (``upload``, before the step's turn on
the cuda backend) is not subtracted: it counts as overhead.
A breakdown by phase (tensor decode, validation, response encode) is timed off-line
on the same sizes.  On a cuda backend the device step time against PyTorch comes
from benchmarks/device_step.py (the CUDA benchmark), when it is present.

Output: a markdown table on stdout, ``bench.json`` and ``bench.png`` under ``--out``.
Exit codes: 0 every cell measured, 1 a cell or the device benchmark failed (what
was measured is still written), 2 a usage error.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import ctypes.util
import importlib.util
import json
import logging
import multiprocessing
import os
import platform
import queue
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import deque
from concurrent import futures
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import grpc
import numpy as np

from duelq.client.client import LearnerClient, _train_result, encode_batch, encode_batch_wire
from duelq.v1 import learner_pb2 as pb

from .backend import Backend, StepOutputs, Upload
from .batch import Batch, validate_batch
from .config import LearnerConfig
from .learner import Learner, StepResult, make_backend
from .reference import ReferenceBackend
from .server import LearnerServer, ServerOptions
from .service import decode_batch, train_response
from .state import LearnerState

log = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
ECHO_SERVICE = "duelq.bench.Echo"
ECHO_PATH = f"/{ECHO_SERVICE}/Stream"
REPLY_BYTES = "x-reply-bytes"        # metadata: size of each echo reply
TRAIN_METHODS = ("/duelq.v1.Learner/TrainStep", "/duelq.v1.Learner/TrainStream")
WIRES = ("float32", "float16", "bfloat16")
TRANSPORTS = ("tcp", "uds")
POOL = 4                             # distinct batches each actor cycles through
ACTOR_TIMEOUT_S = 120.0              # setup or drain longer than this: the bench stops
#: Channel arguments tried as "tuned": a larger initial HTTP/2 stream window, larger
#: frames and larger socket reads than gRPC's defaults (64 KiB, 16 KiB, 8 KiB).
TUNED_OPTIONS = (("grpc.http2.lookahead_bytes", 8 << 20),
                 ("grpc.http2.max_frame_size", 4 << 20),
                 ("grpc.experimental.tcp_read_chunk_size", 1 << 20),
                 ("grpc.experimental.tcp_min_read_chunk_size", 256 << 10),
                 ("grpc.experimental.tcp_max_read_chunk_size", 8 << 20))


def tune_malloc(mmap_threshold: int = 32 << 20, trim_threshold: int = 256 << 20) -> bool:
    """Keep multi-MB buffers in glibc's heap; True when it took effect (the "malloc" cells).

    glibc serves allocations above a dynamic threshold (128 KiB at first) with mmap and
    trims freed heap tops, so a process that allocates and frees 1 MB messages at a high
    rate can page-fault every one back in.  Fixing both thresholds (as the environment
    variables MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ do) reuses the memory.
    Process-wide and irreversible, hence run in processes of their own.
    """
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3   # malloc.h
    return mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1 and \
        mallopt(M_TRIM_THRESHOLD, trim_threshold) == 1


class BenchError(Exception):
    """A cell could not be measured."""


class UsageError(ValueError):
    """A bench flag has a value that cannot be used."""


# -- what to measure -------------------------------------------------------------------

@dataclass(frozen=True)
class Cell:
    """One measurement: ``actors`` processes driving one kind of call for ``duration``."""

    section: str      # "main" (by batch size), "scaling" (by actors) or "experiment"
    kind: str         # "echo" | "stream" | "unary"
    backend: str      # "echo" for the byte stream, else the learner's backend
    batch: int        # B
    wire: str         # feature dtype on the wire (echo: the one whose message size it copies)
    transport: str    # "tcp" | "uds" | "target"
    actors: int
    variant: str = ""  # experiments: "aio" (echo server on grpc.aio), "tuned" (channel
    #                   args), "malloc" (tune_malloc() in servers and actors)

    @property
    def label(self) -> str:
        v = f" {self.variant}" if self.variant else ""
        return (f"{self.kind}/{self.backend}{v} B={self.batch} {self.wire} "
                f"{self.transport} K={self.actors}")


@dataclass(frozen=True)
class Plan:
    """The flags of one run, checked."""

    batch_sizes: tuple[int, ...]
    actors: int
    scaling_actors: tuple[int, ...]
    scaling_batch: int
    transports: tuple[str, ...]
    wires: tuple[str, ...]
    duration: float
    warmup: float
    window: int
    experiments: bool
    device_step: bool
    target: str
    out: Path
    quick: bool

    @staticmethod
    def from_args(args: argparse.Namespace) -> "Plan":
        def ints(name: str) -> tuple[int, ...]:
            text = getattr(args, name)
            try:
                values = tuple(int(x) for x in text.split(",") if x.strip())
            except ValueError:
                raise UsageError(f"--{name.replace('_', '-')}: {text!r} is not a "
                                 f"comma-separated list of integers") from None
            if not values or min(values) < 1:
                raise UsageError(f"--{name.replace('_', '-')}: needs integers ≥ 1")
            return values

        def names(name: str, allowed: Sequence[str]) -> tuple[str, ...]:
            values = tuple(x.strip() for x in getattr(args, name).split(",") if x.strip())
            bad = [v for v in values if v not in allowed]
            if not values or bad:
                raise UsageError(f"--{name.replace('_', '-')}: choose from {','.join(allowed)}"
                                 f" (got {getattr(args, name)!r})")
            return tuple(dict.fromkeys(values))

        plan = Plan(batch_sizes=ints("batch_sizes"), actors=args.actors,
                    scaling_actors=ints("scaling_actors") if args.scaling_actors else (),
                    scaling_batch=args.scaling_batch, transports=names("transports", TRANSPORTS),
                    wires=names("wire_dtypes", WIRES), duration=args.duration,
                    warmup=args.warmup, window=args.window, experiments=args.experiments,
                    device_step=args.device_step, target=args.target, out=Path(args.out),
                    quick=args.quick)
        if plan.quick:
            plan = replace(plan, batch_sizes=(256,), actors=1, scaling_actors=(1, 2),
                           scaling_batch=256, duration=0.25, warmup=0.1, experiments=False,
                           wires=tuple(w for w in plan.wires if w != "float16") or ("float32",))
        for name in ("actors", "window", "scaling_batch"):
            if getattr(plan, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')}: must be ≥ 1")
        if plan.duration <= 0 or plan.warmup < 0:
            raise UsageError("--duration must be > 0 and --warmup ≥ 0")
        if "float32" not in plan.wires:
            plan = replace(plan, wires=("float32",) + plan.wires)  # the ceiling's reference
        if plan.target:
            plan = replace(plan, transports=("target",))
        return plan

    def cells(self, backend: str, in_process: bool) -> list[Cell]:
        """Every cell of the run, in the order they are measured."""
        cells: list[Cell] = []
        half = [w for w in self.wires if w != "float32"]
        main_transport = self.transports[0]
        learners = [backend] + (["null"] if in_process else [])
        for B in self.batch_sizes:
            cell = lambda kind, be, wire: Cell("main", kind, be, B, wire,  # noqa: E731
                                               main_transport, self.actors)
            cells.append(cell("echo", "echo", "float32"))
            if half:
                cells.append(cell("echo", "echo", half[0]))  # float16, bfloat16: same size
            for be in learners:
                cells += [cell("stream", be, w) for w in self.wires]
            cells.append(cell("unary", backend, "float32"))
        B = self.scaling_batch
        for K in self.scaling_actors:
            for transport in self.transports:
                for kind, be in [("echo", "echo")] + [("stream", be) for be in learners]:
                    cells.append(Cell("scaling", kind, be, B, "float32", transport, K))
        if self.experiments and in_process:
            B = 1024 if 1024 in self.batch_sizes else self.batch_sizes[len(self.batch_sizes) // 2]
            for variant in ("aio", "tuned", "malloc"):
                cells.append(Cell("experiment", "echo", "echo", B, "float32", "tcp", self.actors,
                                  variant))
            for variant in ("tuned", "malloc"):
                cells.append(Cell("experiment", "stream", "null", B, "float32", "tcp",
                                  self.actors, variant))
        # One ceiling per (B, message size, transport, actors, variant): drop duplicates.
        return list(dict.fromkeys(cells))


# -- the learner side: a no-op backend and timing wrappers ----------------------------

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

    def propose(self, batch: Batch, upload: Upload | None = None) -> StepOutputs:
        zeros = np.zeros(batch.h_t.shape[0], np.float32)
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
        self.checks_features = inner.checks_features
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

    Each phase runs on the rpc's handler thread, so besides wall time it adds up
    that thread's CPU time (``time.thread_time``), which leaves out waiting: for
    the apply lock, for the GIL, for a core.  On a loaded machine the CPU figure
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
            started = deque()

            def arrivals():
                for request in request_iterator:
                    started.append((time.perf_counter(), time.thread_time()))
                    yield request
            for response in inner_stream(arrivals(), context):
                t0, c0 = started.popleft()
                self._add(requests=1, handler_s=time.perf_counter() - t0,
                          handler_cpu_s=time.thread_time() - c0)
                yield response
        return grpc.stream_stream_rpc_method_handler(stream, parse, serialize)


# -- the ceiling: bare gRPC byte streams ---------------------------------------------

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


def server_args(options: ServerOptions, extra: Iterable = ()) -> list:
    """The channel arguments of duelq's own server (server/server.py), plus ``extra``."""
    return [("grpc.max_receive_message_length", options.max_message_bytes),
            ("grpc.max_send_message_length", options.max_message_bytes),
            ("grpc.so_reuseport", 0), *extra]


class EchoServer:
    """The byte stream on grpc's sync server: duelq's threading model, no service code."""

    def __init__(self, options: ServerOptions, addresses: Sequence[str], extra: Iterable = ()):
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=options.max_rpcs,
                                       thread_name_prefix="bench-echo"),
            handlers=(_echo_handler(_echo_stream),), options=server_args(options, extra),
            maximum_concurrent_rpcs=options.max_rpcs)
        self.ports = [self._server.add_insecure_port(a) for a in addresses]
        self._server.start()

    def stop(self) -> None:
        self._server.stop(0).wait()


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


# -- actors: processes that drive one cell ---------------------------------------------

def make_batch(rng: np.random.Generator, B: int, H: int, N: int, wire: str) -> Batch:
    """A valid batch; features already float16 for a float16 wire (an actor producing them)."""
    features = np.float16 if wire == "float16" else np.float32
    return Batch(h_t=rng.standard_normal((B, H), dtype=np.float32).astype(features),
                 h_tp1=rng.standard_normal((B, H), dtype=np.float32).astype(features),
                 actions=rng.integers(0, N, B, dtype=np.int32),
                 rewards=rng.standard_normal(B, dtype=np.float32),
                 dones=(rng.random(B) < 0.1).astype(np.float32),
                 discounts=np.full(B, 0.99 ** 3, np.float32),
                 weights=rng.uniform(0.5, 1.5, B).astype(np.float32))


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


def cpu_seconds() -> float:
    """User + system CPU seconds of this process so far (all its threads)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


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


def _run_stream(client: LearnerClient, batches: list[Batch], job: dict, tally: _Tally) -> None:
    sent: deque[float] = deque()

    def feed():
        i = 0
        while time.monotonic() < tally.t_end:
            sent.append(time.monotonic())
            yield batches[i % len(batches)]
            i += 1
    for _ in client.train_stream(feed(), window=job["window"]):
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
        batches = [make_batch(rng, job["batch"], job["hidden_dim"], job["n_actions"], job["wire"])
                   for _ in range(POOL)]
        runner = _run_stream if job["kind"] == "stream" else _run_unary
        run = lambda t: runner(client, batches, job, t)  # noqa: E731
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

    def run(self, jobs: list[dict], warmup: float, duration: float) -> list[dict]:
        """Run one job per actor, all started together; their reports, in order."""
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


# -- sizes and codec costs --------------------------------------------------------------

def sample_messages(config: LearnerConfig, B: int, wire: str):
    """(batch, TrainRequest as an actor sends it, StepResult, TrainResponse as answered)."""
    batch = make_batch(np.random.default_rng(B), B, config.hidden_dim, config.n_actions, wire)
    key = pb.RequestKey(actor_id=f"bench-0-{os.getpid()}-{time.monotonic_ns()}", seq=123456)
    request = encode_batch(batch, feature_dtype=wire)
    request.key.CopyFrom(key)
    td = np.random.default_rng(0).standard_normal(B).astype(np.float32)
    result = StepResult(loss=1.0, td_errors=td, priorities=np.abs(td), q_taken_mean=0.5,
                        grad_norm=2.0, step=123456, version=123456, entropy=None)
    return batch, request, result, train_response(result, key)


def _median_us(fn: Callable[[], Any], reps: int) -> float:
    fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(samples)


def codec_costs(config: LearnerConfig, B: int, wire: str, reps: int = 20) -> dict:
    """Off-line µs per step of each phase outside the backend, on this machine."""
    batch, request, result, response = sample_messages(config, B, wire)
    data, reply = request.SerializeToString(), response.SerializeToString()
    parsed = pb.TrainRequest.FromString(data)
    decoded = decode_batch(parsed)
    return {
        "request_bytes": len(data), "response_bytes": len(reply),
        # What LearnerClient does per batch: checks and the wire bytes, one copy of the data.
        "client_encode_us": _median_us(lambda: encode_batch_wire(
            batch, feature_dtype=wire, actor_id=request.key.actor_id, seq=request.key.seq), reps),
        # The protobuf way, for comparison: build the message, then serialise it.
        "client_protobuf_encode_us": _median_us(
            lambda: encode_batch(batch, feature_dtype=wire).SerializeToString(), reps),
        "server_parse_us": _median_us(lambda: pb.TrainRequest.FromString(data), reps),
        "server_decode_us": _median_us(lambda: decode_batch(parsed), reps),
        "server_validate_us": _median_us(lambda: validate_batch(decoded, config, 1 << 30), reps),
        "server_encode_us": _median_us(lambda: train_response(result, request.key), reps),
        "server_serialize_us": _median_us(response.SerializeToString, reps),
        "client_decode_us": _median_us(lambda: _train_result(response), reps),
    }


# -- the coordinator ------------------------------------------------------------------

def _percentile_ms(values: list[float], q: float) -> float | None:
    return float(1e3 * np.percentile(values, q)) if values else None


class Bench:
    """Servers in this process, actors in others; measures the plan's cells."""

    def __init__(self, plan: Plan, config: LearnerConfig, options: ServerOptions,
                 backend: str, ready_timeout: float):
        self.plan, self.config, self.options = plan, config, options
        self.ready_timeout = ready_timeout
        self.tmp = Path(tempfile.mkdtemp(prefix="duelq-bench-"))
        self.sizes: dict[tuple[int, str], dict] = {}
        self.learners: dict[str, Learner] = {}
        self.server: LearnerServer | None = None
        self.clock = ServerClock()
        self.lock: TimedLock | None = None
        self.echo: dict[str, Any] = {}
        self.targets: dict[tuple[str, str], str] = {}   # (server, transport) → target
        self.pool: ActorPool | None = None
        self.malloc_pool: ActorPool | None = None     # actors that called tune_malloc()
        self.malloc_server: ServerProcess | None = None
        self.backend_name = backend
        self.device = ""

    # servers

    def start(self, backend: str) -> None:
        plan = self.plan
        addresses = {"tcp": "127.0.0.1:0", "uds": f"unix://{self.tmp}/{{name}}.sock"}
        if not plan.target:
            self.server = LearnerServer(self.options, interceptors=(self.clock,))
            if "uds" in plan.transports:
                uds = addresses["uds"].format(name="learner")
                grpc_server = getattr(self.server, "_server", None)
                if grpc_server is None:
                    raise BenchError("LearnerServer has no _server to add a UDS listener to")
                grpc_server.add_insecure_port(uds)   # bench only: serve has no UDS flag yet
                self.targets["learner", "uds"] = uds
            self.server.start()
            self.targets["learner", "tcp"] = self.server.target
            state = LearnerState.initial(self.config)
            main = make_backend(backend, self.config, state)
            self.backend_name, self.device = main.name, main.device
            for be in (main, NullBackend(self.config, state)):
                self.learners[be.name] = Learner(self.config, backend=TimedBackend(be),
                                                 max_batch_size=self.options.max_batch_size)
            self.server.attach(self.learners[main.name])
            lock = getattr(self.server.service, "_apply_lock", None)
            if lock is not None:
                self.lock = TimedLock(lock)
                self.server.service._apply_lock = self.lock
        else:
            self.targets["learner", "target"] = plan.target
            with LearnerClient(plan.target, token=self.options.token or None) as client:
                client.wait_ready(self.ready_timeout)
                info = client.info()
            self.backend_name, self.device = info.backend, f"{info.device} (remote)"
            if (info.config.hidden_dim, info.config.n_actions) != (self.config.hidden_dim,
                                                                    self.config.n_actions):
                raise UsageError(f"--target serves H={info.config.hidden_dim}, "
                                 f"N={info.config.n_actions}; pass --hidden-dim and --n-actions")
        self._start_echo("sync", EchoServer, (), addresses)

    def _start_echo(self, name: str, kind, extra, addresses) -> None:
        transports = [t for t in self.plan.transports if t != "target"] or ["tcp"]
        wanted = [addresses[t].format(name=f"echo-{name}") for t in transports]
        server = kind(self.options, wanted, extra)
        self.echo[name] = server
        for transport, address, port in zip(transports, wanted, server.ports):
            self.targets[f"echo-{name}", transport] = (
                f"127.0.0.1:{port}" if transport == "tcp" else address)
        if self.plan.target:
            self.targets[f"echo-{name}", "target"] = self.targets[f"echo-{name}", "tcp"]

    def echo_target(self, cell: Cell) -> str:
        name = {"aio": "aio", "tuned": "tuned"}.get(cell.variant, "sync")
        if name not in self.echo:
            addresses = {"tcp": "127.0.0.1:0", "uds": f"unix://{self.tmp}/{{name}}.sock"}
            kind = AioEchoServer if name == "aio" else EchoServer
            self._start_echo(name, kind, TUNED_OPTIONS if name == "tuned" else (), addresses)
        return self.targets[f"echo-{name}", cell.transport]

    def stop(self) -> None:
        for pool in (self.pool, self.malloc_pool):
            if pool is not None:
                pool.close()
        if self.malloc_server is not None:
            self.malloc_server.stop()
        for server in self.echo.values():
            server.stop()
        if self.server is not None:
            self.server.stop(0)
        shutil.rmtree(self.tmp, ignore_errors=True)

    # cells

    def size(self, B: int, wire: str) -> dict:
        if (B, wire) not in self.sizes:
            self.sizes[B, wire] = codec_costs(self.config, B, wire)
        return self.sizes[B, wire]

    def _server_totals(self, backend: str) -> dict:
        totals = self.clock.snapshot()
        totals["backend_s"] = self.learners[backend].backend.seconds
        totals["backend_cpu_s"] = self.learners[backend].backend.cpu_seconds
        totals["wait_s"] = self.lock.wait_s if self.lock is not None else 0.0
        return totals

    def measure(self, cell: Cell) -> dict:
        plan = self.plan
        size = self.size(cell.batch, cell.wire)
        job = {"kind": cell.kind, "batch": cell.batch, "wire": cell.wire,
               "hidden_dim": self.config.hidden_dim, "n_actions": self.config.n_actions,
               "window": 1 if cell.kind == "unary" else plan.window,
               "request_bytes": size["request_bytes"], "reply_bytes": size["response_bytes"],
               "max_message_bytes": self.options.max_message_bytes, "seed": 7,
               "channel_options": TUNED_OPTIONS if cell.variant == "tuned" else (),
               "tune_malloc": cell.variant == "malloc",
               "token": self.options.token, "ready_timeout": self.ready_timeout}
        pool, server_cpu_seconds = self.pool, cpu_seconds
        if cell.variant == "malloc":   # servers and actors in processes of their own
            if self.malloc_server is None:
                self.malloc_server = ServerProcess(self.config, self.options, tune=True)
                self.malloc_pool = ActorPool(self.plan.actors)
            job["target"] = self.malloc_server.targets["echo" if cell.kind == "echo"
                                                       else "learner"]
            pool, server_cpu_seconds = self.malloc_pool, self.malloc_server.cpu_seconds
        elif cell.kind == "echo":
            job["target"] = self.echo_target(cell)
        else:
            job["target"] = self.targets["learner", cell.transport]
            if self.server is not None:
                self.server.attach(self.learners[cell.backend])
        before = (self._server_totals(cell.backend)
                  if self.learners and cell.kind != "echo" and cell.variant != "malloc" else None)
        cpu = server_cpu_seconds()
        reports = pool.run([dict(job) for _ in range(cell.actors)], plan.warmup, plan.duration)
        server_cpu = server_cpu_seconds() - cpu   # the servers' process (coordinator idle)
        answers = sum(r["answers"] for r in reports) or 1
        latencies = [x for r in reports for x in r["latencies"]]
        steps_per_s = len(latencies) / plan.duration
        row = {**asdict(cell), "request_bytes": size["request_bytes"],
               "response_bytes": size["response_bytes"], "answers": len(latencies),
               "steps_per_s": steps_per_s, "transitions_per_s": steps_per_s * cell.batch,
               "mb_per_s": steps_per_s * size["request_bytes"] / 1e6,
               "p50_ms": _percentile_ms(latencies, 50), "p99_ms": _percentile_ms(latencies, 99),
               "client_cpu_us": 1e6 * sum(r["cpu_s"] for r in reports) / answers,
               # A remote learner's CPU is not ours to read (the echo server is local).
               "server_cpu_us": (None if self.server is None and cell.kind != "echo"
                                 else 1e6 * server_cpu / answers)}
        if before is not None:
            after = self._server_totals(cell.backend)
            n = after["requests"] - before["requests"]
            if n:
                us = {k: 1e6 * (after[k] - before[k]) / n for k in after if k.endswith("_s")}
                row["server_us"] = {   # wall µs per request, and thread-CPU µs ("cpu_…")
                    **{k[:-2]: v for k, v in us.items()}, "requests": n,
                    "overhead_wall": us["parse_s"] + us["handler_s"] - us["backend_s"]
                    - us["wait_s"] + us["serialize_s"],
                    "overhead": us["parse_cpu_s"] + us["handler_cpu_s"] - us["backend_cpu_s"]
                    + us["serialize_cpu_s"]}
        return row

    def run(self, cells: list[Cell], progress, rows: list[dict],
            after_each: Callable[[], Any]) -> list[str]:
        """Measure ``cells`` in order, appending to ``rows``; the failures."""
        failures = []
        self.pool = ActorPool(max(c.actors for c in cells))
        for cell in progress(cells):
            log.info("measuring %s", cell.label)
            try:
                row = self.measure(cell)
            except BenchError as exc:
                log.error("%s: %s", cell.label, exc)
                failures.append(f"{cell.label}: {exc}")
                rows.append({**asdict(cell), "error": str(exc)})
                after_each()
                if "did not answer" in str(exc) or "died" in str(exc):
                    break   # the pool is out of step with the plan: stop here
                continue
            rows.append(row)
            after_each()
            log.info("%s: %.0f steps/s, p50 %.2f ms", cell.label, row["steps_per_s"],
                     row["p50_ms"] or float("nan"))
        return failures


def add_ratios(rows: list[dict]) -> None:
    """Each row's throughput ÷ its echo ceiling (same B, message size, transport, actors)."""
    def size_class(wire: str) -> str:
        return "32" if wire == "float32" else "16"
    echo = {(r["section"], r["batch"], size_class(r["wire"]), r["transport"], r["actors"],
             r["variant"]): r for r in rows if r["kind"] == "echo" and "error" not in r}
    plain = {k[:5]: r for k, r in echo.items() if k[5] == ""}
    for r in rows:
        if r["kind"] == "echo" or "error" in r:
            continue
        key = (r["section"], r["batch"], size_class(r["wire"]), r["transport"], r["actors"])
        same = echo.get(key + (r["variant"],)) or plain.get(key)
        f32 = plain.get(key[:2] + ("32",) + key[3:])
        r["vs_echo"] = r["steps_per_s"] / same["steps_per_s"] if same else None
        r["vs_echo_f32"] = (r["transitions_per_s"] / f32["transitions_per_s"]) if f32 else None


def goals(rows: list[dict], backend: str) -> list[dict]:
    """Issue 5's goals, as measured in this run (informational, never asserted)."""
    def find(**match):
        return next((r for r in rows if "error" not in r and r["section"] == "main"
                     and all(r[k] == v for k, v in match.items())), None)
    out = []
    for be in (backend, "null"):
        r = find(kind="stream", backend=be, batch=1024, wire="float32")
        if r and r.get("vs_echo") is not None:
            out.append({"goal": f"TrainStream ({be}) ≥ 90 % of the byte stream at B=1024",
                        "value": f"{100 * r['vs_echo']:.0f} %", "met": r["vs_echo"] >= 0.9})
        if r and "server_us" in r:
            v = r["server_us"]["overhead"]
            out.append({"goal": f"server overhead ({be}) ≤ 100 µs/step at B=1024 (GPU host)",
                        "value": f"{v:.0f} µs", "met": v <= 100})
        for wire in ("float16", "bfloat16"):
            r = find(kind="stream", backend=be, batch=1024, wire=wire)
            if r and r.get("vs_echo_f32") is not None:
                out.append({"goal": f"{wire} TrainStream ({be}) ≥ 1.8× the float32 ceiling, "
                                    f"B=1024", "value": f"{r['vs_echo_f32']:.2f}×",
                            "met": r["vs_echo_f32"] >= 1.8})
    return out


# -- device step (the CUDA engineer's benchmark) --------------------------------------

def device_step(sizes: Sequence[int], config: LearnerConfig) -> dict:
    """Device µs per step vs PyTorch eager and CUDA graph, from benchmarks/device_step.py."""
    here = Path(__file__).resolve().parents[1] / "benchmarks" / "device_step.py"
    path = next((p for p in (here, Path.cwd() / "benchmarks" / "device_step.py") if p.exists()),
                None)
    if path is None:
        return {"skipped": "benchmarks/device_step.py not found (run from a duelq checkout)"}
    if (config.hidden_dim, config.n_actions) != (128, 11):
        return {"skipped": "benchmarks/device_step.py times H=128, N=11 only"}
    spec = importlib.util.spec_from_file_location("duelq_device_step", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        import torch
        torch.cuda.init()
    except ImportError:
        torch = None
    timer = module.Timer(20, 30)
    rng = np.random.default_rng(0)
    rows = [module.bench_step(B, timer, torch, rng) for B in sizes]
    return {"source": str(path), "torch": torch.__version__ if torch else None, "rows": rows}


# -- output ---------------------------------------------------------------------------

def _f(x, fmt: str = ".0f", unit: str = "") -> str:
    return "—" if x is None else f"{x:{fmt}}{unit}"


def table(rows: list[dict], section: str) -> str:
    head = ("| kind | backend | transport | K | B | wire | request KB | steps/s | transitions/s "
            "| MB/s | p50 ms | p99 ms | ÷ echo | ÷ f32 echo | server µs/step "
            "| CPU µs/step actor + server |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if r["section"] != section:
            continue
        kind = r["kind"] + (f" ({r['variant']})" if r["variant"] else "")
        if "error" in r:
            lines.append(f"| {kind} | {r['backend']} | {r['transport']} | {r['actors']} "
                         f"| {r['batch']} | {r['wire']} | failed: {r['error'][:80]} |")
            continue
        server = r.get("server_us", {}).get("overhead")
        lines.append(
            f"| {kind} | {r['backend']} | {r['transport']} | {r['actors']} | {r['batch']} "
            f"| {r['wire']} | {r['request_bytes'] / 1024:.0f} | {r['steps_per_s']:.0f} "
            f"| {r['transitions_per_s']:.3g} | {r['mb_per_s']:.0f} | {_f(r['p50_ms'], '.2f')} "
            f"| {_f(r['p99_ms'], '.2f')} | {_f(r.get('vs_echo'), '.2f')} "
            f"| {_f(r.get('vs_echo_f32'), '.2f')} | {_f(server)} "
            f"| {r['client_cpu_us']:.0f} + {_f(r['server_cpu_us'])} |")
    return "\n".join(lines)


def overhead_table(rows: list[dict], costs: dict) -> str:
    head = ("| backend | B | wire | K | parse | handler | backend step | serialise "
            "| **overhead** (CPU) | overhead (wall) | lock wait (wall) "
            "| off-line: parse / decode / validate / encode / serialise |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        s = r.get("server_us")
        if r["section"] != "main" or not s:
            continue
        c = costs.get(f"{r['batch']}/{r['wire']}", {})
        offline = " / ".join(_f(c.get(f"server_{k}_us")) for k in
                             ("parse", "decode", "validate", "encode", "serialize"))
        lines.append(
            f"| {r['backend']} ({r['kind']}) | {r['batch']} | {r['wire']} | {r['actors']} "
            f"| {s['parse_cpu']:.0f} | {s['handler_cpu']:.0f} | {s['backend_cpu']:.0f} "
            f"| {s['serialize_cpu']:.0f} | **{s['overhead']:.0f}** | {s['overhead_wall']:.0f} "
            f"| {s['wait']:.0f} | {offline} |")
    return "\n".join(lines)


def device_table(result: dict) -> str:
    if "rows" not in result:
        return f"device step: {result.get('skipped') or result.get('error')}"
    lines = ["| B | duelq device µs | torch eager µs | torch CUDA graph µs | eager ÷ duelq "
             "| graph ÷ duelq | propose() µs |", "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        d, e, g = r.get("duelq_us"), r.get("torch_eager_us"), r.get("torch_graph_us")
        lines.append(f"| {r['B']} | {_f(d, '.1f')} | {_f(e, '.1f')} | {_f(g, '.1f')} "
                     f"| {_f(e / d if d and e else None, '.1f', '×')} "
                     f"| {_f(g / d if d and g else None, '.1f', '×')} "
                     f"| {_f(r.get('propose_us'), '.1f')} |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    rows = [r for r in result["rows"] if "error" not in r]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    colour = {"float32": "tab:blue", "float16": "tab:orange", "bfloat16": "tab:green"}
    series: dict[tuple[str, str, str], list[tuple[int, float]]] = {}
    for r in rows:
        if r["section"] == "main":
            series.setdefault((r["kind"], r["backend"], r["wire"]), []).append(
                (r["batch"], r["transitions_per_s"]))
    order = {"echo": 0, "stream": 1, "unary": 2}
    for (kind, backend, wire), points in sorted(series.items(), key=lambda kv: (
            order[kv[0][0]], kv[0][1] != "null", WIRES.index(kv[0][2]))):
        xs, ys = zip(*sorted(points))
        if kind == "echo":
            label = f"byte stream (ceiling), {'float32' if wire == 'float32' else '16-bit'} size"
            style = dict(color="black" if wire == "float32" else "grey", ls="--", marker="s")
        else:
            label = f"{kind} {backend} {wire}"
            style = dict(color=colour[wire], marker="o",
                         ls="-" if backend == "null" else ":" if kind == "unary" else "-.")
        left.plot(xs, ys, label=label, **style)
    sizes = result["meta"]["batch_sizes"]
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xticks(sizes, [str(b) for b in sizes])
    left.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    left.set(xlabel="batch size B (transitions per request)", ylabel="transitions / s",
             title=f"throughput vs B ({result['meta']['actors']} actor processes)")
    left.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=7)
    scaling: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        if r["section"] == "scaling":
            name = f"{'echo' if r['kind'] == 'echo' else 'stream ' + r['backend']} {r['transport']}"
            scaling.setdefault(name, []).append((r["actors"], r["transitions_per_s"]))
    for name, points in sorted(scaling.items()):
        xs, ys = zip(*sorted(points))
        kind = name.rsplit(" ", 1)[0]
        right.plot(xs, ys, ("--" if name.endswith("uds") else "-") + ("s" if kind == "echo"
                                                                      else "o"),
                   color={"echo": "black", "stream null": "tab:blue"}.get(kind, "tab:red"),
                   label=name.replace("echo", "byte stream"))
    if scaling:
        actors = sorted({r["actors"] for r in rows if r["section"] == "scaling"})
        right.set_xticks(actors, [str(k) for k in actors])
    right.set(xlabel="actor processes", ylabel="transitions / s", ylim=(0, None),
              title=f"scaling, B={result['meta']['scaling_batch']} float32")
    right.grid(True, alpha=0.3)
    right.legend(fontsize=7)
    meta = result["meta"]
    fig.suptitle(f"duelq bench: backend {meta['backend']} on {meta['device']}; "
                 f"{meta['cpus']} CPUs; H={meta['hidden_dim']} N={meta['n_actions']}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine() -> dict:
    from importlib import metadata
    return {"platform": platform.platform(), "cpu": _cpu_name(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "grpcio": grpc.__version__,
            "protobuf": metadata.version("protobuf"), "numpy": np.__version__}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# -- entry point ----------------------------------------------------------------------

def run_bench(args: argparse.Namespace, config: LearnerConfig, options: ServerOptions,
              argv: Sequence[str] | None = None) -> int:
    """``duelq bench``; returns the exit code."""
    try:
        plan = Plan.from_args(args)
    except UsageError as exc:
        print(f"duelq: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    from tqdm import tqdm

    bench = Bench(plan, config, options, args.backend, args.ready_timeout)
    started = time.time()
    failures: list[str] = []
    rows: list[dict] = []
    device: dict = {"skipped": "the backend is not cuda"}
    plan.out.mkdir(parents=True, exist_ok=True)

    def result(partial: bool) -> dict:
        """Everything measured so far; written after each cell, so a killed run leaves data."""
        add_ratios(rows)
        out = {
            "meta": {**machine(), "backend": bench.backend_name, "device": bench.device or "?",
                     "target": plan.target or "in-process", "hidden_dim": config.hidden_dim,
                     "n_actions": config.n_actions, "actors": plan.actors,
                     "batch_sizes": list(plan.batch_sizes), "scaling_batch": plan.scaling_batch,
                     "window": plan.window, "duration_s": plan.duration,
                     "warmup_s": plan.warmup, "quick": plan.quick, "partial": partial,
                     "argv": list(argv) if argv is not None else sys.argv[1:],
                     "env": {k: v for k, v in os.environ.items()
                             if k.startswith(("OPENBLAS_", "OMP_", "MKL_", "MALLOC_"))},
                     "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
                     "wall_s": round(time.time() - started, 1)},
            "rows": rows, "codec_us": {f"{B}/{w}": c for (B, w), c in bench.sizes.items()},
            "goals": goals(rows, bench.backend_name), "device_step": device,
            "failures": failures}
        (plan.out / "bench.json").write_text(json.dumps(out, indent=1))
        return out

    try:
        try:
            bench.start(args.backend)
        except UsageError as exc:
            print(f"duelq: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        except Exception as exc:  # noqa: BLE001 — cannot bind, no usable backend, no target
            log.error("cannot start the bench: %s", exc)
            return EXIT_FAILURE
        cells = plan.cells(bench.backend_name, in_process=bench.server is not None)
        progress = lambda cells: tqdm(cells, desc="duelq bench", unit="cell",  # noqa: E731
                                      file=sys.stderr, disable=None)
        failures += bench.run(cells, progress, rows, lambda: result(partial=True))
        if bench.backend_name == "cuda" and plan.device_step:
            if bench.server is not None:
                bench.server.stop(0)   # the GPU to the device benchmark alone
                bench.server = None
            try:
                device = device_step(plan.batch_sizes, config)
            except Exception as exc:  # noqa: BLE001 — reported, the rest still written
                log.exception("device step benchmark failed")
                device = {"error": f"{type(exc).__name__}: {exc}"}
                failures.append(f"device step: {exc}")
        elif bench.backend_name == "cuda":
            device = {"skipped": "--no-device-step"}
    finally:
        bench.stop()

    final = result(partial=False)
    try:
        plot(final, plan.out / "bench.png")
    except Exception as exc:  # noqa: BLE001 — the JSON is written; say what failed
        log.exception("cannot draw the plot")
        failures.append(f"plot: {exc}")
        result(partial=False)
    print(report(final))
    print(f"\nwrote {plan.out / 'bench.json'} and {plan.out / 'bench.png'} "
          f"in {time.time() - started:.0f} s")
    if failures:
        print(f"duelq bench: {len(failures)} failure(s): " + "; ".join(failures),
              file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK


def report(result: dict) -> str:
    m = result["meta"]
    parts = [f"## duelq bench — backend {m['backend']} on {m['device']}, {m['cpus']} CPUs "
             f"({m['cpu']}), H={m['hidden_dim']} N={m['n_actions']}, window {m['window']}, "
             f"{m['duration_s']:g} s per cell",
             "", "### Throughput by batch size", "", table(result["rows"], "main")]
    if any(r["section"] == "scaling" for r in result["rows"]):
        parts += ["", f"### Scaling with actors, B={m['scaling_batch']} float32", "",
                  table(result["rows"], "scaling")]
    if any(r["section"] == "experiment" for r in result["rows"]):
        parts += ["", "### Experiments (aio: echo on grpc.aio; tuned: larger HTTP/2 windows, "
                      "frames and reads)", "", table(result["rows"], "experiment")]
    over = overhead_table(result["rows"], result["codec_us"])
    if over.count("\n") > 1:
        parts += ["", "### Server-side µs per step, in-line (CPU time of the handler thread; "
                      "overhead = parse + handler − backend step + serialise; the wall figure "
                      "also subtracts the lock wait)", "", over]
    parts += ["", "### Device step (benchmarks/device_step.py)", "",
              device_table(result["device_step"])]
    if result["goals"]:
        parts += ["", "### Issue 5 goals, as measured here", ""]
        parts += [f"- {g['goal']}: {g['value']} ({'met' if g['met'] else 'not met'})"
                  for g in result["goals"]]
    return "\n".join(parts)
