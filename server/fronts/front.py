"""``--front-processes``: gRPC in front processes, the learner in one more.

In one Python process gRPC's own per-message work and the learner's (parse, checks,
copy, launch, encode) take turns on one GIL, which bounds the steps/s whatever the GPU
does (docs/benchmarks.md).  :class:`FrontServer` splits them:

* a front process binds the public port and serves health, reflection and the
  :class:`~duelq.server.gate.Gate` (token, rpc places, receive deadlines).  TrainStep,
  TrainStream and InsertStream requests go into a shared-memory buffer (their arrays
  already in the step kernel's input layout where their dtypes and shapes allow,
  server/fronts/packing.py; else the bytes as they came), and a frame tells the learner
  process (server/fronts/relay.py).  A stream's requests are read and sent on by a thread of
  their own while its handler writes the answers; up to :data:`STREAM_DEPTH` are at the
  learner while earlier answers go out, and no more are read while that many are unsent:
  a client that does not read its answers is stopped by HTTP/2 flow control, as with
  one process;
* the learner process is an ordinary :class:`LearnerServer` bound to a private
  Unix socket (no TLS or token: a 0700 directory).  It runs relayed requests through
  the same service code (:class:`RelayedService`).  The small rpcs (``RELAYED_CALLS``:
  Act, GetWeights …) travel whole over the relay too, run between two steps;
  SaveCheckpoint and the replay buffer's unary rpcs (TrainReplay, GetReplayInfo) are
  forwarded to the private socket as raw bytes.  Checkpoints,
  idempotency keys, the replay buffer (and its ratio loop) and /metrics live there.

With ``front_processes`` = K > 1, K − 1 more front processes bind the same port
(SO_REUSEPORT: the kernel spreads incoming connections over the K), each with a GIL of
its own.  Each connects to the learner process's relay socket in the private directory
and hands it a buffer pool of its own; the learner process takes requests from every
front on its one relay thread (which reads every front's frames), in arrival order.  The
first front starts and stops the others.

Every limit is server-wide, as with one process: the fronts count admitted rpcs, open
streams and calls waiting for the learner together (server/fronts/shared.py) and
refuse at the same point, with the same code and words.

Shutdown: :meth:`FrontServer.stop` turns health NOT_SERVING (the other fronts too), asks
the learner process to drain and write its final checkpoint, then stops gRPC.  If the
learner process dies, health turns NOT_SERVING, open calls get UNAVAILABLE and
:attr:`broken` is set.  Another front that dies takes its connections with it (their
clients reconnect to the rest); the first front's death stops the learner process and
the other fronts.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import shutil
import signal
import socket
import tempfile
import threading
import time
from dataclasses import replace
from multiprocessing.connection import wait as wait_for
from pathlib import Path
from typing import Iterator

import grpc
from grpc_health.v1 import health_pb2

from duelq.v1 import learner_pb2 as pb

from duelq.server.core.batch import PackedBatch
from duelq.server.core.checkpoint import CheckpointError
from duelq.server.core.config import LearnerConfig
from duelq.server.core.errors import ReplayTooLarge, ResourceExhausted
from duelq.server.core.native import stream_copy
from duelq.server.fronts.packing import Packer
from duelq.server.fronts.relay import (CLOSED, LEARNER_GONE, QUEUE_FULL, REPLY, BufferPool,
                                       STREAMED, FrontStream, RelayCall, RelayClosed,
                                       RelayFront, RelayLearner)
from duelq.server.fronts.shared import SharedCounts
from duelq.server.gate import END, FAILED, STOPPED, StreamReader
from duelq.server.logs import setup_logging
from duelq.server.server import (SERVICE_NAME, LearnerServer, ServerOptions,
                                 add_health_and_reflection, bind, grpc_server, local_target,
                                 make_gate, set_health)
from duelq.server.service import (QUEUED_CALLS, RELAYED_CALLS, InsertJob, LearnerService,
                                  StreamIdle, TrainJob, queue_full, refusal, stream_idle,
                                  too_many_streams)
from duelq.server.metrics import Metrics

log = logging.getLogger(__name__)

#: The unary rpcs passed to the learner process (relayed or forwarded, :meth:`_forward`);
#: the others' requests go through the relay as a stream's (relay.STREAMED).
FORWARDED = tuple(name for name in pb.DESCRIPTOR.services_by_name["Learner"].methods_by_name
                  if name not in STREAMED)
START_TIMEOUT_S = 600.0   # building a cuda backend compiles kernels
STOP_TIMEOUT_S = 300.0    # draining and the final checkpoint
FRONT_START_TIMEOUT_S = 60.0
STOP_ACK_TIMEOUT_S = 5.0    # for another front to take in that the learner is stopping
_STARTING = "the learner's backend is still starting; retry shortly"
LEARNER_SOCKET, RELAY_SOCKET = "learner.sock", "relay.sock"   # in the private directory
COUNTS_FILE = "counts"   # in the private directory: the fronts' shared counts
#: Requests of one TrainStream read and not yet answered to its client, at most: enough
#: to keep the learner busy while answers go out; a client that reads none of its answers
#: gets no more than this many applied past what HTTP/2 flow control lets through.
STREAM_DEPTH = 8


class LearnerProcessError(RuntimeError):
    """The learner process could not start (the message says why)."""


def _port_free(host: str, port: int) -> None:
    """OSError when a server listens on ``host:port``.  The fronts bind it with SO_REUSEPORT,
    which would otherwise share it silently with another such server of the same user."""
    if port == 0:
        return
    try:
        found = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise OSError(f"cannot listen on {host}:{port}: {exc}") from exc
    for family, kind, proto, _, address in found:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as grpc binds
            try:
                probe.bind(address)
            except OSError as exc:
                raise OSError(f"cannot listen on {host}:{port}: {exc.strerror} (is another "
                              f"server there?)") from exc


def _reply_payload(context: grpc.ServicerContext, code: grpc.StatusCode, payload: bytes) -> bytes:
    """A relayed reply's payload: the response's bytes when OK, else the rpc ends with
    ``code`` and the payload as its details."""
    if code is not grpc.StatusCode.OK:
        context.abort(code, payload.decode(errors="replace"))
    return payload


def usable_cpus(cpu_max: Path = Path("/sys/fs/cgroup/cpu.max")) -> int:
    """CPUs this process may run on: its affinity, capped by a cgroup v2 CPU quota
    (``cpu_max``; what ``docker run --cpus`` sets), rounded up."""
    count = len(os.sched_getaffinity(0))
    try:
        quota, period = cpu_max.read_text().split()
        if quota != "max":
            count = min(count, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):   # no cgroup v2 file, or not in that form
        pass
    return count


def buffer_pool_size(options: ServerOptions) -> tuple[int, int]:
    """(buffers, bytes per buffer) of each front's pool, from the server's limits: 2 ·
    max_queue buffers over all fronts (at least 4 each), so the requests in flight to the
    learner process follow the queue limit, of max_message_bytes / 8 each (8 MiB by
    default: a packed B = 4096, H = 128 float32 batch); a request that does not fit goes
    through the socket (slower, the same result)."""
    return (max(4, -(-2 * options.max_queue // options.front_processes)),
            options.max_message_bytes // 8)


def _buffer_pool(options: ServerOptions, fd: int | None = None) -> BufferPool:
    """A front's buffer pool: a new one, or the one shared as ``fd``."""
    return BufferPool(*buffer_pool_size(options), fd)


def _page_lock(server: LearnerServer, buffers: BufferPool) -> None:
    """Let the backend upload straight from ``buffers`` (cuda page-locks them)."""
    try:
        server.learner.backend.pin(buffers.bytes)
    except Exception as exc:  # noqa: BLE001 — uploads then go through staging buffers
        log.warning("cannot page-lock a relay buffer pool (%s); uploads are staged", exc)


def _deadline(context: grpc.ServicerContext) -> float | None:
    left = context.time_remaining()
    return None if left is None or left > 1e6 else time.monotonic() + left


def _time_left(context: grpc.ServicerContext) -> float | None:
    """The timeout of a call made on behalf of ``context``: its deadline carries over."""
    deadline = _deadline(context)
    return None if deadline is None else max(deadline - time.monotonic(), 0.0)


class FrontServer:
    """The public gRPC server of ``--front-processes``; the learner runs in a child process.

    ``index`` > 0: one of the other front processes of ``front_processes`` (started by the
    first, see :func:`front_main`), which joins the running learner process whose sockets
    are in ``directory``."""

    def __init__(self, options: ServerOptions, *, index: int = 0,
                 directory: Path | None = None):
        self.options, self.index = options, index
        # 0700: the learner's sockets and the shared counts (the other fronts join them)
        self._dir = Path(tempfile.mkdtemp(prefix="duelq-")) if index == 0 else directory
        self._counts = SharedCounts(self._dir / COUNTS_FILE, options.front_processes, index,
                                    create=index == 0)
        self._stream_places = self._counts.tally("streams", options.max_streams)
        # The calls at the learner process: max_queue waiting, and the one it steps.
        self._queue_places = self._counts.tally("queue", options.max_queue + 1)
        self.gate = make_gate(options, self._counts.tally("rpcs", options.max_rpcs),
                              self._refused)
        self._server = grpc_server(options, (self.gate,),
                                   share_port=options.front_processes > 1)
        handlers = {name: grpc.unary_unary_rpc_method_handler(self._forward(name))
                    for name in FORWARDED}
        handlers["TrainStep"] = grpc.unary_unary_rpc_method_handler(self._train_step)
        for name in ("TrainStream", "InsertStream"):
            handlers[name] = grpc.stream_stream_rpc_method_handler(self._stream_handler(name))
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
        self.health = add_health_and_reflection(self._server)
        self.port: int | None = None
        self.broken = threading.Event()
        """Set when the learner process died (not on an orderly stop)."""
        self._relay: RelayFront | None = None
        self._channel: grpc.Channel | None = None
        self._calls: dict[str, grpc.UnaryUnaryMultiCallable] = {}
        self._process = None
        self._conn = None
        self._buffers: BufferPool | None = None
        self._sock: socket.socket | None = None
        self._stopping = False
        self._stop_coming = False   # the first front is stopping the learner process
        self._fronts: list[tuple] = []   # the other front processes: (process, pipe)
        self._reaping = threading.Lock()   # one join at a time: two would race in waitpid

    @property
    def target(self) -> str:
        return local_target(self.options.host, self.port)

    def start(self) -> int:
        """Bind the public port and serve health (NOT_SERVING) and reflection."""
        if self.index == 0 and self.options.front_processes > 1:
            _port_free(self.options.host, self.options.port)
            cpus = usable_cpus()
            if self.options.front_processes >= cpus:
                log.warning("%d front processes and the learner process on %d CPUs share "
                            "cores: consider --front-processes %d (DUELQ_FRONT_PROCESSES)",
                            self.options.front_processes, cpus, max(1, cpus // 2))
        self.port = bind(self._server, self.options)
        self._server.start()
        log.info("listening on %s:%d (%s), front process %d of %d; health NOT_SERVING until "
                 "the learner process is ready", self.options.host, self.port,
                 "TLS" if self.options.tls_cert else "plaintext", self.index + 1,
                 self.options.front_processes)
        return self.port

    def serve_learner(self, config: LearnerConfig, *, backend: str = "auto") -> dict:
        """Start the learner process (resuming from ``checkpoint_dir``) and report SERVING.

        Returns what it says of itself (backend, device, step).  Raises
        :class:`CheckpointError`, :class:`ReplayTooLarge` or :class:`LearnerProcessError`
        when it cannot start.
        """
        o = self.options
        self._buffers = buffers = _buffer_pool(o)
        mine, theirs = socket.socketpair()
        self._sock = mine
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        uds = f"unix:{self._dir / LEARNER_SOCKET}"
        self._process = ctx.Process(
            target=learner_main, name="duelq-learner", daemon=True,
            args=(child, theirs, config, o, backend, uds, _log_setup()))
        self._process.start()
        child.close()
        theirs.close()
        socket.send_fds(mine, [b"m"], [buffers.fd])
        if not self._conn.poll(START_TIMEOUT_S):
            raise LearnerProcessError(f"the learner process did not start in "
                                      f"{START_TIMEOUT_S:g} s")
        try:
            kind, info = self._conn.recv()
        except EOFError:
            raise LearnerProcessError("the learner process exited while starting "
                                      "(see its log above)") from None
        if kind != "ready":   # it exits: stop() then finds it gone, with nothing to say
            self._process.join(STOP_ACK_TIMEOUT_S)
            if kind == "checkpoint":
                raise CheckpointError(*info)
            if kind == "replay":
                raise ReplayTooLarge(info)
            raise LearnerProcessError(info)
        self._connect(mine, buffers)
        self._start_fronts(ctx)
        set_health(self.health, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving %s from %s: learner process %d, backend %s on %s, step %d",
                 SERVICE_NAME, "a front process" if o.front_processes == 1 else
                 f"{o.front_processes} front processes", self._process.pid, info["backend"],
                 info["device"], info["step"])
        return info

    def _connect(self, sock: socket.socket, buffers: BufferPool) -> None:
        """Relay train requests and the small rpcs over ``sock`` (requests in ``buffers``)
        and forward the others (SaveCheckpoint, the replay buffer's unary ones) to the
        learner process's private socket."""
        size = self.options.max_message_bytes
        self._channel = grpc.insecure_channel(f"unix:{self._dir / LEARNER_SOCKET}", options=[
            ("grpc.max_receive_message_length", size), ("grpc.max_send_message_length", size)])
        self._calls = {name: self._channel.unary_unary(f"/{SERVICE_NAME}/{name}")
                       for name in FORWARDED}
        self._relay = RelayFront(sock, buffers, Packer(stream_copy()).pack)
        self._relay.on_close = self._learner_gone

    def _start_fronts(self, ctx) -> None:
        """Start the other front processes on this port; return once each serves."""
        o = replace(self.options, port=self.port)
        for index in range(1, o.front_processes):
            conn, child = ctx.Pipe()
            process = ctx.Process(target=front_main, name=f"duelq-front-{index + 1}", daemon=True,
                                  args=(child, o, str(self._dir), _log_setup(), index))
            process.start()
            child.close()
            self._fronts.append((process, conn))
        for index, (process, conn) in enumerate(self._fronts, 1):
            try:
                answer = (conn.recv() if conn.poll(FRONT_START_TIMEOUT_S)
                          else ("error", f"no answer in {FRONT_START_TIMEOUT_S:g} s"))
            except (EOFError, OSError):
                answer = ("error", "it exited while starting (see its log above)")
            if answer[0] != "ready":
                raise LearnerProcessError(f"front process {index + 1} did not start: "
                                          f"{answer[1]}")
            threading.Thread(target=self._watch_front, args=(process, index), daemon=True,
                             name=f"duelq-front-watch-{index}").start()

    def _watch_front(self, process, index: int) -> None:
        wait_for([process.sentinel])   # not join: stop() may be reaping it meanwhile
        if self._stopping or self.broken.is_set():
            return
        with self._reaping:
            process.join(0)
        self._counts.clear(index)   # its calls went with it
        log.error("front process %d (pid %d) exited with code %s: its connections are gone, "
                  "the other fronts serve on", index + 1, process.pid, process.exitcode)

    def join_learner(self) -> None:
        """(Another front process.) Connect to the learner process that the first front
        started and report SERVING."""
        o = self.options
        self._buffers = buffers = _buffer_pool(o)
        self._sock = sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(str(self._dir / RELAY_SOCKET))
        socket.send_fds(sock, [b"m"], [buffers.fd])
        self._connect(sock, buffers)
        set_health(self.health, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving %s: front process %d of %d", SERVICE_NAME, self.index + 1,
                 o.front_processes)

    def expect_stop(self) -> None:
        """(Another front process.) The first front is about to stop the learner process:
        its going is no fault."""
        self._stop_coming = True

    def _learner_gone(self) -> None:
        if not (self._stopping or self._stop_coming):
            log.error("the learner process went away: NOT_SERVING")
            set_health(self.health, health_pb2.HealthCheckResponse.NOT_SERVING)
            self.broken.set()

    def stop(self, grace_s: float | None = None, *,
             learner_drains: bool = True) -> tuple[Path, int] | None:
        """NOT_SERVING and no new calls (running ones get ``grace_s``); the learner process
        drains and writes its final checkpoint.  Returns that checkpoint's (path, step), or
        None.

        Another front process (``index`` > 0) waits, while ``learner_drains``, for the learner
        process to end (its requests are drained too) before it stops gRPC."""
        if self._stopping:
            return None
        self._stopping = True
        self.health.enter_graceful_shutdown()
        grace = self.options.grace_s if grace_s is None else grace_s
        stopped = self._server.stop(grace)   # first, as LearnerServer.stop says why
        saved = failure = None
        try:
            for _, conn in self._fronts:
                _tell(conn, "stop")
            for _, conn in self._fronts:   # each expects the learner process to go
                _answered(conn, STOP_ACK_TIMEOUT_S)
            if self.index > 0:
                if learner_drains and self._relay is not None:
                    self._relay.closed.wait(STOP_TIMEOUT_S)
            elif self._process is not None and self._process.is_alive():
                saved, failure = self._stop_learner()
                self._process.join(30)
                if self._process.is_alive():
                    log.error("the learner process did not exit: killing it")
                    self._process.kill()
        finally:
            if self._relay is not None:
                self._relay.close()   # open calls get UNAVAILABLE
            elif self._sock is not None:
                self._sock.close()
            if self._channel is not None:
                self._channel.close()
            stopped.wait()
            self.gate.close()
            if self._buffers is not None:   # after the handlers that write into it
                self._buffers.close()
            for index, (process, _) in enumerate(self._fronts, 2):
                with self._reaping:
                    process.join(grace + 30)
                    if process.is_alive():
                        log.error("front process %d did not exit: killing it", index)
                        process.kill()
            self._counts.close()
            if self.index == 0:
                shutil.rmtree(self._dir, ignore_errors=True)
            log.info("stopped")
        if failure is not None:
            raise failure
        return saved

    def _stop_learner(self) -> tuple[tuple[Path, int] | None, Exception | None]:
        """Ask the learner process to drain and checkpoint: (saved, failure)."""
        try:
            self._conn.send("stop")
            deadline = time.monotonic() + STOP_TIMEOUT_S
            while self._conn.poll(max(deadline - time.monotonic(), 0.0)):
                kind, answer = self._conn.recv()   # skips a late "ready"
                if kind == "stopped":
                    return answer, None
                if kind == "checkpoint":
                    return None, CheckpointError(*answer)
            log.error("the learner process did not stop in %g s", STOP_TIMEOUT_S)
        except (EOFError, OSError):
            log.error("the learner process died while stopping")
        return None, None

    # ── rpcs ─────────────────────────────────────────────────────────────────────────

    def _refuse(self, context: grpc.ServicerContext, method: str, exc: Exception) -> None:
        """Answer ``exc`` as the one-process service would (logged, counted) and end."""
        code, details = refusal(exc, method, context.peer())
        self._refused(method, code.name)
        context.abort(code, details)

    def _refused(self, method: str, code: str) -> None:
        """Count an rpc refused here in the learner process's metrics, once it runs."""
        if self._relay is not None:
            self._relay.report_refusal(method, code)

    def _not_sent(self, context: grpc.ServicerContext, method: str, why: str) -> None:
        """End the rpc whose request :meth:`FrontStream.submit` did not send, ``why``."""
        if why == QUEUE_FULL:
            self._refuse(context, method, ResourceExhausted(queue_full(self.options.max_queue)))
        if why == LEARNER_GONE:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the learner process went away; "
                          "retry with the same keys")
        context.abort(grpc.StatusCode.CANCELLED, "the call ended")   # closed: it is over

    def _open(self, context: grpc.ServicerContext, method: str) -> FrontStream:
        relay = self._relay
        try:
            if relay is None:
                raise RelayClosed(_STARTING)
            stream = relay.open(method=method, deadline=_deadline(context),
                                queue_places=self._queue_places)
        except RelayClosed as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        # Cancelled or past its deadline: END at once, so requests not started are not
        # applied (the one-process server's rule) and a wait for a free buffer ends.
        if not context.add_callback(stream.close):   # over already
            stream.close()
        return stream

    def _train_step(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        stream = self._open(context, "TrainStep")
        try:
            why = stream.submit(request)
            if why is not None:
                self._not_sent(context, "TrainStep", why)
            kind, reply = stream.inbox.get()
            if kind == CLOSED:   # the call ended meanwhile
                context.abort(grpc.StatusCode.CANCELLED, "the call ended")
            return _reply_payload(context, *reply)
        finally:
            stream.close()

    def _stream_handler(self, method: str):
        """The handler of stream ``method`` (TrainStream, InsertStream): its requests go
        to the learner through the relay, holding one of the server's stream places."""
        def handler(requests: Iterator[bytes], context: grpc.ServicerContext
                    ) -> Iterator[bytes]:
            if not self._stream_places.take():
                self._refuse(context, method,
                             ResourceExhausted(too_many_streams(self.options.max_streams)))
            try:
                stream = self._open(context, method)
                reader = StreamReader(requests, stream.inbox, ahead=STREAM_DEPTH,
                                      handle=stream.submit)
                try:
                    yield from self._relay_stream(method, stream, reader, context)
                finally:
                    reader.close()
                    stream.close()
            finally:
                self._stream_places.give_back()
        return handler

    def _relay_stream(self, method: str, stream: FrontStream, reader: StreamReader,
                      context: grpc.ServicerContext) -> Iterator[bytes]:
        """Yield the answers of the requests ``reader`` sends to the learner, in order.  A
        refusal ends the stream once the answers before it are out; no request is sent
        after it.  With nothing at the learner and no request for ``receive_timeout_s``, the
        stream ends UNAVAILABLE, as with one process."""
        timeout = self.options.receive_timeout_s
        answered = 0
        reading, unsent = True, None   # unsent: why a request was not sent; it ends the stream
        while reading or answered < reader.handled:
            try:
                kind, item = stream.inbox.get(
                    timeout=timeout if answered == reader.handled else None)
            except queue.Empty:   # the reader may have sent one since the wait began
                if answered < reader.handled:
                    continue
                self._refuse(context, method, StreamIdle(stream_idle(timeout)))
            if kind == REPLY:
                answered += 1   # a refusal ends the stream at _reply_payload
                yield from self.gate.watchdog.send(_reply_payload(context, *item), context,
                                                   method)
                reader.done()
            elif kind == STOPPED:
                reading, unsent = False, item
            elif kind == END:
                reading = False
            elif kind == FAILED and not isinstance(item, grpc.RpcError):
                raise item   # sending a request failed: the call ends in error, not OK
            elif kind in (FAILED, CLOSED):   # the call was cancelled or has ended
                return
        if unsent is not None:
            self._not_sent(context, method, unsent)

    def _forward(self, name: str):
        """A handler passing ``name``'s request bytes to the learner process and back: over
        the relay for the small rpcs (RELAYED_CALLS), else over gRPC.  Those that wait for
        the learner in one process (QUEUED_CALLS) hold a queue place meanwhile."""
        relay = name in RELAYED_CALLS
        method = RELAYED_CALLS.index(name) if relay else -1   # its index in the learner's table
        queued = name in QUEUED_CALLS

        def passed(request: bytes, context: grpc.ServicerContext) -> bytes:
            starting = self._relay is None if relay else name not in self._calls
            if starting:
                context.abort(grpc.StatusCode.UNAVAILABLE, _STARTING)
            if queued and not self._queue_places.take():
                self._refuse(context, name, ResourceExhausted(queue_full(self.options.max_queue)))
            try:
                if relay:
                    reply = self._relay.call(method, request, _deadline(context),
                                             context.add_callback)
                    return _reply_payload(context, *reply)
                future = self._calls[name].future(request, timeout=_time_left(context))
                context.add_callback(future.cancel)   # a cancelled call is cancelled inside too
                try:
                    return future.result()
                except grpc.RpcError as exc:
                    context.abort(exc.code(), exc.details())
            finally:
                if queued:
                    self._queue_places.give_back()
        return passed

# ── the learner process ──────────────────────────────────────────────────────────────


def _log_setup() -> tuple[str, str]:
    """(level, format) of this process's logging, for the learner process to copy."""
    root = logging.getLogger()
    json_lines = any(type(h.formatter).__name__ == "JsonFormatter" for h in root.handlers)
    return logging.getLevelName(root.level), "json" if json_lines else "text"


def front_main(conn, options: ServerOptions, directory: str, log_setup: tuple[str, str],
               index: int) -> None:
    """Another front process of ``front_processes``: serve the port beside the first front
    until it says stop (or goes away), or the learner process dies."""
    setup_logging(*log_setup, role=f"front-{index + 1}")
    for signum in (signal.SIGINT, signal.SIGTERM):   # the first front decides when to stop
        signal.signal(signum, signal.SIG_IGN)
    front = FrontServer(options, index=index, directory=Path(directory))
    try:
        front.start()
        front.join_learner()
    except Exception as exc:  # noqa: BLE001 — reported to the first front
        _tell(conn, ("error", f"{type(exc).__name__}: {exc}"))
        front.stop(0, learner_drains=False)
        return
    _tell(conn, ("ready", os.getpid()))
    asked = False
    while not front.broken.is_set():
        if conn.poll(0.2):
            try:
                asked = conn.recv() == "stop"
            except (EOFError, OSError):   # the first front is gone
                pass
            break
    if asked:
        front.expect_stop()
        _tell(conn, "stopping")
    front.stop(learner_drains=asked)


def learner_main(conn, sock: socket.socket, config: LearnerConfig, options: ServerOptions,
                 backend: str, address: str, log_setup: tuple[str, str]) -> None:
    """The learner process: a LearnerServer on ``address`` plus the relay's learner end.  On
    its way out it removes its sockets, the fronts' counts and their folder, which a killed
    front cannot."""
    path = Path(address.removeprefix("unix:"))
    try:
        _serve_relayed(conn, sock, config, options, backend, address, log_setup)
    finally:
        for name in (LEARNER_SOCKET, RELAY_SOCKET, COUNTS_FILE):
            (path.parent / name).unlink(missing_ok=True)
        try:
            path.parent.rmdir()   # only if empty: nothing else is removed
        except OSError:
            pass


def _answered(conn, timeout: float) -> None:
    """Wait up to ``timeout`` for a word on ``conn`` (or its end) and take it."""
    try:
        if conn.poll(timeout):
            conn.recv()
    except (EOFError, OSError):   # that front is gone
        pass


def _tell(conn, message) -> bool:
    """Send ``message`` to the front; False when it is gone."""
    try:
        conn.send(message)
        return True
    except OSError:
        return False


def _serve_relayed(conn, sock: socket.socket, config: LearnerConfig, options: ServerOptions,
                   backend: str, address: str, log_setup: tuple[str, str]) -> None:
    setup_logging(*log_setup, role="learner")
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the front decides when to stop
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    _, fds, _, _ = socket.recv_fds(sock, 1, 1)
    buffers = _buffer_pool(options, fds[0])
    private = replace(options, token="", token_file="", tls_cert="", tls_key="",
                      tls_client_ca="", front_processes=0)
    server = LearnerServer(private)
    try:
        server.start(address)
        server.serve_learner(config, backend=backend)
    except Exception as exc:  # noqa: BLE001 — the front raises it again (serve's exit, words)
        _tell(conn, ("checkpoint", (str(exc.path), exc.problem))
              if isinstance(exc, CheckpointError) else
              ("replay" if isinstance(exc, ReplayTooLarge) else "error", str(exc)))
        server.stop(0)
        return
    _page_lock(server, buffers)
    relay = RelayLearner(sock, buffers, RelayedService(server.service, server.metrics))
    relay.start()
    listener = None
    if options.front_processes > 1:   # the other fronts connect here, each with its buffers
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(Path(address.removeprefix("unix:")).parent / RELAY_SOCKET))
        listener.listen()
        threading.Thread(target=_accept_fronts, args=(listener, relay, options, server),
                         name="duelq-relay-accept", daemon=True).start()
    learner = server.learner
    ready = _tell(conn, ("ready", {"backend": learner.backend.name,
                                   "device": learner.backend.device,
                                   "step": learner.step_count}))
    asked = False   # by the front ("stop") or by SIGTERM
    while ready and not (stop.is_set() or relay.closed.is_set()):
        if conn.poll(0.2):
            try:
                asked = conn.recv() == "stop"
            except (EOFError, OSError):   # the front is gone (a reset, when it was killed)
                pass
            break
    orphaned = not (asked or stop.is_set())
    if orphaned:  # like a crash of the server: a successor may already be resuming
        log.warning("the front process went away: stopping without a final checkpoint")
    try:
        saved = server.stop(final_checkpoint=not orphaned)
        answer = ("stopped", saved)
    except CheckpointError as exc:
        answer = ("checkpoint", (str(exc.path), exc.problem))
    _tell(conn, answer)
    if listener is not None:
        try:
            listener.shutdown(socket.SHUT_RDWR)   # wakes the accepting thread
        except OSError:
            pass
        listener.close()
    relay.close()   # the buffer pools (page-locked on cuda) go with the process


class RelayedService:
    """The learner process's side of the relay (relay.RelayService): the service's work on
    each relayed request, and the metrics the one-process server's interceptor keeps."""

    def __init__(self, service: LearnerService, metrics: Metrics | None):
        self._service, self._metrics = service, metrics
        self._relayed: list = []   # duelq_relayed_requests of each front, by index

    def prepare(self, request: memoryview, method: str) -> TrainJob | InsertJob:
        return self._service.relay_prepare(request, method)

    def prepare_packed(self, packed: PackedBatch, key: bytes, method: str
                       ) -> TrainJob | InsertJob:
        return self._service.relay_prepare_packed(packed, key, method)

    def apply(self, job: TrainJob | InsertJob, call: RelayCall) -> bytes:
        if type(job) is InsertJob:
            return self._service.apply_insert(job, call).SerializeToString()
        response = self._service.apply_train(job, call)
        if self._metrics is not None:   # the latency from the request's arrival here
            self._metrics.observe_answer(response, call.arrived)
        return response.SerializeToString()

    def refusal(self, exc: Exception, method: str) -> tuple[grpc.StatusCode, str]:
        code, details = refusal(exc, method, "relay")
        self.front_refused(method, code.name)
        return code, details

    def call(self, method: int, request: bytes, call: RelayCall
             ) -> tuple[grpc.StatusCode, bytes]:
        if not 0 <= method < len(RELAYED_CALLS):
            return grpc.StatusCode.UNIMPLEMENTED, f"no relayed method {method}".encode()
        name = RELAYED_CALLS[method]
        try:
            return grpc.StatusCode.OK, self._service.call_relayed(name, request, call)
        except Exception as exc:  # noqa: BLE001 — answered, as the gRPC server would
            code, details = refusal(exc, name, "relay")
            self.front_refused(name, code.name)
            return code, details.encode()

    def received(self, front: int) -> None:
        if self._metrics is not None:
            while len(self._relayed) <= front:
                self._relayed.append(self._metrics.relayed.labels(str(len(self._relayed) + 1)))
            self._relayed[front].inc()
            self._metrics.queue_depth.inc()

    def answered(self) -> None:
        if self._metrics is not None:
            self._metrics.queue_depth.dec()

    def stream_opened(self) -> None:
        if self._metrics is not None:
            self._metrics.active_streams.inc()

    def stream_closed(self) -> None:
        if self._metrics is not None:
            self._metrics.active_streams.dec()

    def front_refused(self, method: str, code: str, count: int = 1) -> None:
        if self._metrics is not None:
            self._metrics.count_refusal(method, code, count)


def _accept_fronts(listener: socket.socket, relay: RelayLearner, options: ServerOptions,
                   server: LearnerServer) -> None:
    """Attach each of the other front processes as it connects, with the buffer pool it sends
    (``front_processes`` − 1 of them; then the listener closes)."""
    joined = 0
    while joined < options.front_processes - 1:
        try:
            sock, _ = listener.accept()
        except OSError:   # closed: the learner process is stopping
            return
        try:
            _, fds, _, _ = socket.recv_fds(sock, 1, 1)
            buffers = _buffer_pool(options, fds[0])
        except (OSError, IndexError, ValueError) as exc:
            log.warning("a front process's relay connection failed: %s", exc)
            sock.close()
            continue
        _page_lock(server, buffers)
        log.info("front process %d joined the relay", relay.attach(sock, buffers) + 1)
        joined += 1
    listener.close()


def make_server(options: ServerOptions, *,
                interceptors: tuple[grpc.ServerInterceptor, ...] = ()) -> LearnerServer:
    """A :class:`LearnerServer`, or a :class:`FrontServer` with ``front_processes``; not
    started."""
    if not options.front_processes:
        return LearnerServer(options, interceptors=interceptors)
    if interceptors:
        raise ValueError("interceptors are not supported with front processes")
    return FrontServer(options)


def start_server(config: LearnerConfig, options: ServerOptions, *, backend: str = "auto",
                 interceptors: tuple[grpc.ServerInterceptor, ...] = ()) -> LearnerServer:
    """Start a server (a :class:`FrontServer` with ``front_processes``), build (or resume)
    the learner on ``backend``; SERVING on return."""
    server = make_server(options, interceptors=interceptors)
    try:
        server.start()
        server.serve_learner(config, backend=backend)
    except BaseException:
        server.stop(0)
        raise
    return server
