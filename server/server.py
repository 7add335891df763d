"""The gRPC server around a learner: limits, health, reflection, auth, TLS, shutdown.

Threading model: grpcio's synchronous server with one worker thread per
running rpc (``max_rpcs`` threads; a TrainStream holds its thread while
open).  grpc itself answers RESOURCE_EXHAUSTED past ``max_rpcs`` concurrent
rpcs and for messages over ``max_message_bytes``; the service refuses
TrainStreams past ``max_streams``.  Steps from all threads serialise on the
service's apply lock.

Lifecycle: :meth:`LearnerServer.start` binds and serves health (NOT_SERVING)
and reflection at once; :meth:`LearnerServer.attach` hands over a ready
learner and flips health to SERVING; :meth:`LearnerServer.stop` flips it to
NOT_SERVING, refuses new rpcs and drains running ones for ``grace_s``.
"""

from __future__ import annotations

import hmac
import logging
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from duelq.v1 import learner_pb2 as pb
from duelq.v1 import learner_pb2_grpc as pb_grpc

from .config import LearnerConfig
from .errors import InvalidArgument
from .idempotency import ReplayGuard
from .learner import Learner
from .metrics import Metrics
from .service import Checkpointer, LearnerService, Limits

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Learner"].full_name  # "duelq.v1.Learner"
HEALTH_PREFIX = "/grpc.health.v1.Health/"


@dataclass(frozen=True)
class ServerOptions:
    """How the server listens and what it limits; each is a `duelq serve` flag."""

    host: str = "127.0.0.1"
    """Address to bind; 0.0.0.0 or [::] to accept remote actors."""
    port: int = 50051
    """TCP port; 0 picks a free one."""
    max_message_bytes: int = 64 << 20
    """Largest request or response message, bytes."""
    max_batch_size: int = 16384
    """Largest B of a train or act request, M of an entropy request."""
    max_streams: int = 32
    """TrainStreams open at once."""
    max_rpcs: int = 64
    """Rpcs (streams included) running at once; also the worker thread count."""
    replay_cache: int = 1024
    """Recorded responses kept for idempotent retries (besides each actor's latest)."""
    token: str = ""
    """If set, every rpc but health needs metadata ``authorization: Bearer <token>``."""
    tls_cert: str = ""
    """PEM certificate chain file; with ``tls_key`` turns TLS on."""
    tls_key: str = ""
    """PEM private key file of ``tls_cert``."""
    tls_client_ca: str = ""
    """PEM CA bundle file; if set, clients must present a certificate it signed (mTLS)."""
    grace_s: float = 5.0
    """Seconds running rpcs get to finish on shutdown."""
    metrics_port: int = 0
    """HTTP port of the Prometheus /metrics endpoint (on ``host``); 0 turns metrics off."""

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, problem: str) -> None:
            if not ok:
                raise InvalidArgument(name, f"{problem} (got {getattr(self, name)!r})")

        need(0 <= self.port <= 65535, "port", "must be in [0, 65535]")
        need(self.max_message_bytes >= 1 << 16, "max_message_bytes", "must be ≥ 65536")
        need(self.max_batch_size >= 1, "max_batch_size", "must be ≥ 1")
        need(self.max_streams >= 1, "max_streams", "must be ≥ 1")
        need(self.max_rpcs > self.max_streams, "max_rpcs",
             f"must exceed max_streams={self.max_streams}, leaving room for unary rpcs")
        need(self.replay_cache >= 0, "replay_cache", "must be ≥ 0")
        need(bool(self.tls_cert) == bool(self.tls_key), "tls_key",
             "tls_cert and tls_key go together")
        need(not self.tls_client_ca or bool(self.tls_cert), "tls_client_ca",
             "needs tls_cert and tls_key")
        need(self.grace_s >= 0, "grace_s", "must be ≥ 0")
        need(0 <= self.metrics_port <= 65535, "metrics_port", "must be in [0, 65535]")


class BearerAuth(grpc.ServerInterceptor):
    """Refuses rpcs (health excepted) without the right bearer token; constant-time compare."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or details.method.startswith(HEALTH_PREFIX):
            return handler
        got = dict(details.invocation_metadata).get("authorization", "")
        if hmac.compare_digest(got.encode() if isinstance(got, str) else got, self._expected):
            return handler
        return _deny(handler)


def _deny(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that answers UNAUTHENTICATED."""
    def deny(request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

    make = {(False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler}
    return make[handler.request_streaming, handler.response_streaming](
        deny, request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer)


def _read(path: str) -> bytes:
    return Path(path).read_bytes()


class LearnerServer:
    """A running duelq gRPC server; attach a learner to start serving it."""

    def __init__(self, options: ServerOptions, *, checkpoint: Checkpointer | None = None,
                 interceptors: tuple[grpc.ServerInterceptor, ...] = ()):
        self.options = options
        self.health = health.HealthServicer()
        self.service = LearnerService(
            Limits(options.max_message_bytes, options.max_batch_size, options.max_streams),
            replay=ReplayGuard(capacity=options.replay_cache), checkpoint=checkpoint)
        auth = (BearerAuth(options.token),) if options.token else ()
        # Outermost, so refusals by the auth interceptor are counted too.
        self.metrics = Metrics(lambda: self.service._learner) if options.metrics_port else None
        if self.metrics is not None:
            auth = (self.metrics.interceptor,) + auth
        size = options.max_message_bytes
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=options.max_rpcs,
                                       thread_name_prefix="duelq-rpc"),
            interceptors=auth + tuple(interceptors),
            options=[("grpc.max_receive_message_length", size),
                     ("grpc.max_send_message_length", size),
                     ("grpc.so_reuseport", 0)],  # a port in use is an error, not shared
            maximum_concurrent_rpcs=options.max_rpcs)
        pb_grpc.add_LearnerServicer_to_server(self.service, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME), self._server)
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.port: int | None = None

    def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            self.health.set(name, status)

    @property
    def learner(self) -> Learner:
        return self.service.learner

    @property
    def target(self) -> str:
        """host:port a client on this machine can dial."""
        host = self.options.host
        host = {"0.0.0.0": "127.0.0.1", "[::]": "[::1]", "::": "[::1]"}.get(host, host)
        return f"{host}:{self.port}"

    def start(self) -> int:
        """Bind and start serving health and reflection; returns the bound port."""
        address = f"{self.options.host}:{self.options.port}"
        if self.options.tls_cert:
            credentials = grpc.ssl_server_credentials(
                [(_read(self.options.tls_key), _read(self.options.tls_cert))],
                root_certificates=(_read(self.options.tls_client_ca)
                                   if self.options.tls_client_ca else None),
                require_client_auth=bool(self.options.tls_client_ca))
            bind = lambda: self._server.add_secure_port(address, credentials)  # noqa: E731
        else:
            bind = lambda: self._server.add_insecure_port(address)  # noqa: E731
        try:
            self.port = bind()
        except RuntimeError as exc:  # grpcio raises RuntimeError when it cannot bind
            raise OSError(f"cannot listen on {address}: {exc}") from exc
        if self.port == 0:
            raise OSError(f"cannot listen on {address}")
        self._server.start()
        if self.metrics is not None:
            self.metrics_port = self.metrics.serve(self.options.metrics_port, self.options.host)
        log.info("listening on %s (%s), health NOT_SERVING until the backend is ready",
                 f"{self.options.host}:{self.port}", "TLS" if self.options.tls_cert else
                 "plaintext")
        return self.port

    def attach(self, learner: Learner) -> None:
        """Serve ``learner`` and report SERVING."""
        self.service.attach(learner)
        self._set_health(health_pb2.HealthCheckResponse.SERVING)
        log.info("serving %s: backend %s on %s, step %d", SERVICE_NAME, learner.backend.name,
                 learner.backend.device, learner.step_count)

    def stop(self, grace_s: float | None = None) -> None:
        """NOT_SERVING, refuse new rpcs, let running ones finish for ``grace_s``, stop."""
        self.health.enter_graceful_shutdown()
        grace = self.options.grace_s if grace_s is None else grace_s
        self._server.stop(grace).wait()
        if self.metrics is not None:
            self.metrics.close()
        log.info("stopped")


def start_server(config: LearnerConfig, options: ServerOptions, *, backend: str = "auto",
                 checkpoint: Checkpointer | None = None,
                 interceptors: tuple[grpc.ServerInterceptor, ...] = ()) -> LearnerServer:
    """Start a server, build the learner on ``backend`` and attach it (SERVING on return)."""
    server = LearnerServer(options, checkpoint=checkpoint, interceptors=interceptors)
    server.start()
    try:
        server.attach(Learner(config, backend=backend, max_batch_size=options.max_batch_size))
    except BaseException:
        server.stop(0)
        raise
    return server
