"""``--front-process``: gRPC in this process, the learner in a second one.

One Python process tops out near 1300 train steps/s whatever the GPU does: gRPC's
own per-message work and the learner's (parse, checks, copy, launch, encode) take
turns on one GIL (docs/benchmarks.md).  :class:`FrontServer` splits them:

* this process (the front) binds the public port and serves health, reflection and
  the bearer-token check.  TrainStep and TrainStream requests are not parsed here:
  their bytes go into a shared-memory slot and a frame tells the learner process
  (server/relay.py).  A stream keeps reading while earlier requests are learned on;
* the learner process is an ordinary :class:`LearnerServer` bound to a private
  Unix socket (no TLS or token: a 0700 directory).  It runs relayed requests through
  the same service code, and every other rpc is forwarded to it as raw bytes.
  Checkpoints, idempotency keys and /metrics live there.

Shutdown: :meth:`FrontServer.stop` turns health NOT_SERVING, asks the learner process
to drain and write its final checkpoint, then stops gRPC.  If the learner process
dies, health turns NOT_SERVING, open calls get UNAVAILABLE and :attr:`broken` is set.
"""

from __future__ import annotations

import logging
import multiprocessing
import shutil
import signal
import socket
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import grpc
from grpc_health.v1 import health_pb2

from duelq.v1 import learner_pb2 as pb

from .checkpoint import CheckpointError
from .config import LearnerConfig
from .errors import ResourceExhausted
from .relay import FrontStream, RelayClosed, RelayFront, RelayLearner, SlotPool
from .server import (SERVICE_NAME, LearnerServer, ServerOptions, add_health_and_reflection,
                     auth_interceptors, bind, grpc_server, local_target, set_health)
from .service import TrainJob, refusal, too_many_streams

log = logging.getLogger(__name__)

TRAIN = ("TrainStep", "TrainStream")
FORWARDED = tuple(name for name in pb.DESCRIPTOR.services_by_name["Learner"].methods_by_name
                  if name not in TRAIN)
START_TIMEOUT_S = 600.0   # building a cuda backend compiles kernels
STOP_TIMEOUT_S = 300.0    # draining and the final checkpoint


class LearnerProcessError(RuntimeError):
    """The learner process could not start (the message says why)."""


def _deadline(context: grpc.ServicerContext) -> float | None:
    left = context.time_remaining()
    return None if left is None or left > 1e6 else time.monotonic() + left


class FrontServer:
    """The public gRPC server of ``--front-process``; the learner runs in a child process."""

    def __init__(self, options: ServerOptions):
        self.options = options
        self._server = grpc_server(options, auth_interceptors(options, on_deny=self._denied))
        handlers = {name: grpc.unary_unary_rpc_method_handler(self._forward(name))
                    for name in FORWARDED}
        handlers["TrainStep"] = grpc.unary_unary_rpc_method_handler(self._train_step)
        handlers["TrainStream"] = grpc.stream_stream_rpc_method_handler(self._train_stream)
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
        self.health = add_health_and_reflection(self._server)
        self.port: int | None = None
        self.broken = threading.Event()
        """Set when the learner process died (not on an orderly stop)."""
        self._dir = Path(tempfile.mkdtemp(prefix="duelq-"))   # 0700: the learner's socket
        self._relay: RelayFront | None = None
        self._channel: grpc.Channel | None = None
        self._calls: dict[str, grpc.UnaryUnaryMultiCallable] = {}
        self._process = None
        self._conn = None
        self._slots: SlotPool | None = None
        self._sock: socket.socket | None = None
        self._stopping = False
        # Refused at open, as the one-process server does (the learner process counts too).
        self._streams = threading.BoundedSemaphore(options.max_streams)

    @property
    def target(self) -> str:
        return local_target(self.options.host, self.port)

    def start(self) -> int:
        """Bind the public port and serve health (NOT_SERVING) and reflection."""
        self.port = bind(self._server, self.options)
        self._server.start()
        log.info("listening on %s:%d (%s), front process; health NOT_SERVING until the "
                 "learner process is ready", self.options.host, self.port,
                 "TLS" if self.options.tls_cert else "plaintext")
        return self.port

    def serve_learner(self, config: LearnerConfig, *, backend: str = "auto") -> dict:
        """Start the learner process (resuming from ``checkpoint_dir``) and report SERVING.

        Returns what it says of itself (backend, device, step).  Raises
        :class:`CheckpointError` or :class:`LearnerProcessError` when it cannot start.
        """
        o = self.options
        self._slots = slots = SlotPool(o.relay_slots, int(o.relay_slot_mb * (1 << 20)))
        mine, theirs = socket.socketpair()
        self._sock = mine
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        uds = f"unix:{self._dir / 'learner.sock'}"
        self._process = ctx.Process(
            target=learner_main, name="duelq-learner", daemon=True,
            args=(child, theirs, config, o, backend, uds, _log_setup()))
        self._process.start()
        child.close()
        theirs.close()
        socket.send_fds(mine, [b"m"], [slots.fd])
        if not self._conn.poll(START_TIMEOUT_S):
            raise LearnerProcessError(f"the learner process did not start in "
                                      f"{START_TIMEOUT_S:g} s")
        try:
            kind, info = self._conn.recv()
        except EOFError:
            raise LearnerProcessError("the learner process exited while starting "
                                      "(see its log above)") from None
        if kind == "checkpoint":
            raise CheckpointError(*info)
        if kind != "ready":
            raise LearnerProcessError(info)
        size = o.max_message_bytes
        self._channel = grpc.insecure_channel(uds, options=[
            ("grpc.max_receive_message_length", size), ("grpc.max_send_message_length", size)])
        self._calls = {name: self._channel.unary_unary(f"/{SERVICE_NAME}/{name}")
                       for name in FORWARDED}
        self._relay = RelayFront(mine, slots)
        self._relay.on_close = self._learner_gone
        set_health(self.health, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving %s from a front process: learner process %d, backend %s on %s, "
                 "step %d", SERVICE_NAME, self._process.pid, info["backend"], info["device"],
                 info["step"])
        return info

    def _learner_gone(self) -> None:
        if not self._stopping:
            log.error("the learner process went away: NOT_SERVING")
            set_health(self.health, health_pb2.HealthCheckResponse.NOT_SERVING)
            self.broken.set()

    def stop(self, grace_s: float | None = None) -> tuple[Path, int] | None:
        """NOT_SERVING; the learner process drains and writes its final checkpoint; gRPC
        stops after ``grace_s``.  Returns that checkpoint's (path, step), or None."""
        if self._stopping:
            return None
        self._stopping = True
        self.health.enter_graceful_shutdown()
        grace = self.options.grace_s if grace_s is None else grace_s
        saved = failure = None
        try:
            if self._process is not None and self._process.is_alive():
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
            self._server.stop(grace).wait()
            if self._slots is not None:   # after the handlers that write into it
                self._slots.close()
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

    def _open(self, context: grpc.ServicerContext, *, unary: bool) -> FrontStream:
        relay = self._relay
        try:
            if relay is None:
                raise RelayClosed("the learner's backend is still starting; retry shortly")
            stream = relay.open(unary=unary, deadline=_deadline(context))
        except RelayClosed as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        # Cancelled or past its deadline: END at once, so requests not started are not
        # applied (the one-process server's rule) and a wait for a free slot ends.
        context.add_callback(stream.close)
        return stream

    def _train_step(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        stream = self._open(context, unary=True)
        try:
            stream.submit(request)
            stream.done_sending()
            for code, payload in stream.replies():
                if code is not grpc.StatusCode.OK:
                    context.abort(code, payload.decode(errors="replace"))
                return payload
            context.abort(grpc.StatusCode.UNAVAILABLE, "the learner process went away")
        finally:
            stream.close()

    def _train_stream(self, requests: Iterator[bytes],
                      context: grpc.ServicerContext) -> Iterator[bytes]:
        if not self._streams.acquire(blocking=False):
            code, details = refusal(ResourceExhausted(too_many_streams(self.options.max_streams)),
                                    "TrainStream", context.peer())
            self._refused("TrainStream", code)
            context.abort(code, details)
        try:
            yield from self._relay_stream(requests, context)
        finally:
            self._streams.release()

    def _relay_stream(self, requests: Iterator[bytes],
                      context: grpc.ServicerContext) -> Iterator[bytes]:
        stream = self._open(context, unary=False)

        def feed() -> None:   # keeps reading while earlier requests are learned on
            try:
                for data in requests:
                    if not stream.submit(data):
                        break
            except Exception:  # noqa: BLE001 — the rpc ended (cancelled, aborted, deadline)
                pass
            finally:
                stream.done_sending()
        threading.Thread(target=feed, name="duelq-front-feed", daemon=True).start()
        try:
            for code, payload in stream.replies():
                if code is not grpc.StatusCode.OK:
                    context.abort(code, payload.decode(errors="replace"))
                yield payload
            if not self._relay.alive:   # requests may have been dropped unanswered
                context.abort(grpc.StatusCode.UNAVAILABLE, "the learner process went away; "
                              "retry with the same keys")
        finally:
            stream.close()

    def _denied(self, method: str) -> None:
        """A token refusal of ``method`` (its path): counted for the Learner's rpcs, as the
        one-process server's metrics count them (not reflection's)."""
        service, _, name = method.rpartition("/")
        if service == f"/{SERVICE_NAME}":
            self._refused(name, grpc.StatusCode.UNAUTHENTICATED)

    def _refused(self, method: str, code: grpc.StatusCode) -> None:
        """Count an rpc refused here in the learner process's metrics, once it runs."""
        if self._relay is not None:
            self._relay.report_refusal(method, code)

    def _forward(self, name: str):
        """A handler passing ``name``'s request bytes to the learner process and back."""
        def forward(request: bytes, context: grpc.ServicerContext) -> bytes:
            call = self._calls.get(name)
            if call is None:
                context.abort(grpc.StatusCode.UNAVAILABLE,
                              "the learner's backend is still starting; retry shortly")
            deadline = _deadline(context)
            future = call.future(request, timeout=None if deadline is None else
                                 max(deadline - time.monotonic(), 0.0))
            context.add_callback(future.cancel)   # a cancelled call is cancelled inside too
            try:
                return future.result()
            except grpc.RpcError as exc:
                context.abort(exc.code(), exc.details())
        return forward


# ── the learner process ──────────────────────────────────────────────────────────────


def _log_setup() -> tuple[str, str]:
    """(level, format) of this process's logging, for the learner process to copy."""
    root = logging.getLogger()
    json_lines = any(type(h.formatter).__name__ == "JsonFormatter" for h in root.handlers)
    return logging.getLevelName(root.level), "json" if json_lines else "text"


def learner_main(conn, sock: socket.socket, config: LearnerConfig, options: ServerOptions,
                 backend: str, address: str, log_setup: tuple[str, str]) -> None:
    """The learner process: a LearnerServer on ``address`` plus the relay's learner end.  On
    its way out it removes its socket and their folder, which a killed front cannot."""
    try:
        _serve_relayed(conn, sock, config, options, backend, address, log_setup)
    finally:
        path = Path(address.removeprefix("unix:"))
        path.unlink(missing_ok=True)
        try:
            path.parent.rmdir()   # only if empty: nothing else is removed
        except OSError:
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
    from .cli import setup_logging
    setup_logging(*log_setup, role="learner")
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the front decides when to stop
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    _, fds, _, _ = socket.recv_fds(sock, 1, 1)
    slots = SlotPool(options.relay_slots, int(options.relay_slot_mb * (1 << 20)), fds[0])
    private = replace(options, token="", token_file="", tls_cert="", tls_key="",
                      tls_client_ca="", front_process=False)
    server = LearnerServer(private)
    try:
        server.start(address)
        server.serve_learner(config, backend=backend)
    except CheckpointError as exc:
        _tell(conn, ("checkpoint", (str(exc.path), exc.problem)))
        server.stop(0)
        return
    except Exception as exc:  # noqa: BLE001 — reported to the front, which exits with it
        _tell(conn, ("error", str(exc)))
        server.stop(0)
        return
    service, metrics = server.service, server.metrics
    try:
        server.learner.backend.register_host(slots.bytes)   # cuda: uploads straight from it
    except Exception as exc:  # noqa: BLE001 — uploads then go through staging buffers
        log.warning("cannot page-lock the relay's slot pool (%s); uploads are staged", exc)

    def apply(job: TrainJob, call) -> bytes:
        response = service.apply_train(job, call)
        if metrics is not None:   # the latency from the request's arrival in this process
            metrics.observe_answer(response, call.arrived)
        return response.SerializeToString()

    def refused(method: str, code: str) -> None:   # here, or by the front (token, max_streams)
        if metrics is not None:
            metrics.refused.labels(method, code).inc()

    def refuse(exc: Exception, unary: bool) -> tuple[grpc.StatusCode, str]:
        name = "TrainStep" if unary else "TrainStream"
        code, details = refusal(exc, name, "relay")
        refused(name, code.name)
        return code, details

    def open_stream() -> None:
        service.open_stream()
        if metrics is not None:
            metrics.active_streams.inc()

    def close_stream() -> None:
        service.close_stream()
        if metrics is not None:
            metrics.active_streams.dec()

    relay = RelayLearner(sock, slots, service.relay_prepare, apply, refuse,
                         open_stream=open_stream, close_stream=close_stream,
                         depth=metrics.queue_depth if metrics is not None else None,
                         refused=refused)
    relay.start()
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
    relay.close()   # the slot pool (page-locked on cuda) goes with the process
