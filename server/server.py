"""The gRPC server around a learner: limits, health, reflection, auth, TLS, shutdown.

Threading model: grpcio's synchronous server with one worker thread per
running rpc (a TrainStream holds its thread while open).  The :class:`Gate`
(server/gate.py) admits at most ``max_rpcs`` calls at once, refuses calls
without the token before they hold anything, and bounds how long a call may
wait for its requests; grpc answers RESOURCE_EXHAUSTED for messages over
``max_message_bytes``; the service refuses streams (TrainStream, InsertStream) past ``max_streams``
and requests past ``max_queue``.  Steps from all threads serialise on the
service's apply lock.

Lifecycle: :meth:`LearnerServer.start` binds and serves health (NOT_SERVING)
and reflection at once; :meth:`LearnerServer.serve_learner` builds the learner
(resumed from the newest checkpoint in ``checkpoint_dir``, if any) and
:meth:`LearnerServer.attach` hands it over and flips health to SERVING;
:meth:`LearnerServer.stop` flips it to NOT_SERVING and takes no new calls (running
rpcs get ``grace_s``), refuses new state changes (UNAVAILABLE: clients retry with
the same key), waits for the admitted ones and writes a final checkpoint.

Request bytes that do not parse as the rpc's message get INVALID_ARGUMENT
(grpc's own answer would be INTERNAL); only our protobuf messages are ever
deserialised.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from duelq.v1 import learner_pb2 as pb
from duelq.v1 import learner_pb2_grpc as pb_grpc

from duelq.server.core.checkpoint import (TUNABLE_FIELDS, CheckpointError, CheckpointWriter,
                                          changed_fields, read_latest)
from duelq.server.core.config import LearnerConfig
from duelq.server.core.errors import InvalidArgument, check_setting
from duelq.server.core.learner import Learner, make_backend
from duelq.server.core.replay import ReplayState
from duelq.server.core.state import LearnerState
from duelq.server.framing import (insert_request_deserializer, train_request_deserializer,
                                  undecodable)
from duelq.server.gate import Count, Gate, Tally, same_shape, worker_count
from duelq.server.idempotency import KeyGuard
from duelq.server.metrics import Metrics
from duelq.server.reflection import enable_reflection
from duelq.server.replay_loop import ReplayLoop
from duelq.server.service import (KEY_RECORDS_EXTRA, RECORDED_KINDS, REPLAY_BUFFER_EXTRA,
                                  LearnerService, Limits)

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Learner"].full_name  # "duelq.v1.Learner"
#: Methods that time their own reads (an idle stream ends UNAVAILABLE; see gate.py).
SELF_TIMED = (f"/{SERVICE_NAME}/TrainStream", f"/{SERVICE_NAME}/InsertStream")


@dataclass(frozen=True)
class ServerOptions:
    """How the server listens and what it limits; each is a `duelq serve` flag."""

    host: str = "127.0.0.1"
    """Address to bind; 0.0.0.0 or [::] to accept remote actors."""
    port: int = 50051
    """TCP port; 0 picks a free one."""
    max_message_bytes: int = 64 << 20
    """Largest request or response message, bytes (≥ 65536)."""
    max_batch_size: int = 16384
    """Largest B of a train or act request, M of an entropy request."""
    max_streams: int = 32
    """TrainStreams and InsertStreams open at once, server-wide; past it RESOURCE_EXHAUSTED at
    open."""
    max_rpcs: int = 64
    """Rpcs (streams included, health checks not) running at once, server-wide, more than
    ``max_streams``; past it RESOURCE_EXHAUSTED."""
    recorded_responses: int = 1024
    """Recorded responses kept for idempotent retries (besides each actor's latest); a retry
    whose response is gone gets ALREADY_EXISTS."""
    max_actors: int = 4096
    """Actors whose idempotency keys are tracked; past it a new actor is refused
    (RESOURCE_EXHAUSTED) unless the least recently seen has been idle actor_idle_s."""
    actor_idle_s: float = 3600.0
    """Seconds an actor must have sent nothing before its keys may be forgotten to make
    room for a new actor (a retry of one of its keys after that would be applied again)."""
    max_queue: int = 64
    """Rpcs waiting for the learner at once, server-wide (a TrainStream counts once); past
    it RESOURCE_EXHAUSTED."""
    receive_timeout_s: float = 30.0
    """Seconds a call may take to send a request the server waits for, or to read an answer
    the server has sent: past it a unary call is cancelled, a TrainStream or InsertStream
    with no request in flight ends UNAVAILABLE, one whose answer goes unread is cancelled."""
    token: str = ""
    """If set, every rpc but health (reflection too) needs metadata ``authorization: Bearer
    <token>``."""
    token_file: str = ""
    """File holding the bearer token (surrounding whitespace stripped); instead of ``token``."""
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
    checkpoint_dir: str = ""
    """Directory of checkpoints: resume from the newest at start, save there; "" = off (and
    the checkpoint_every_* settings with it)."""
    checkpoint_every_steps: int = 0
    """Save a checkpoint every this many steps (off the step path); 0 = no step trigger."""
    checkpoint_every_seconds: float = 60.0
    """Save a checkpoint every this many seconds if steps were applied; 0 = no time trigger."""
    checkpoint_keep: int = 3
    """Checkpoints kept in ``checkpoint_dir`` (the newest ones)."""
    checkpoint_replay: bool = False
    """Checkpoints also carry the server-side replay buffer (rows, priorities, counters),
    written atomically with the learner state; a resumed server continues bit-identically.
    A checkpoint that holds one is resumed with it either way."""
    front_processes: int = 0
    """gRPC front processes sharing the port (SO_REUSEPORT), with the learner in one more
    process: each front decodes, checks and packs train requests on a GIL of its own.  0
    serves gRPC from the learner's own process."""

    def __post_init__(self) -> None:
        need = functools.partial(check_setting, self)

        need(0 <= self.port <= 65535, "port", "must be in [0, 65535]")
        need(self.max_message_bytes >= 1 << 16, "max_message_bytes", "must be ≥ 65536")
        need(self.max_batch_size >= 1, "max_batch_size", "must be ≥ 1")
        need(self.max_streams >= 1, "max_streams", "must be ≥ 1")
        need(self.max_rpcs > self.max_streams, "max_rpcs",
             f"must exceed max_streams={self.max_streams}, leaving room for unary rpcs")
        need(self.recorded_responses >= 0, "recorded_responses", "must be ≥ 0")
        need(self.max_actors >= 1, "max_actors", "must be ≥ 1")
        need(self.actor_idle_s >= 0, "actor_idle_s", "must be ≥ 0")
        need(self.receive_timeout_s > 0, "receive_timeout_s", "must be > 0")
        need(bool(self.tls_cert) == bool(self.tls_key), "tls_key",
             "tls_cert and tls_key go together")
        need(not self.tls_client_ca or bool(self.tls_cert), "tls_client_ca",
             "needs tls_cert and tls_key")
        need(self.grace_s >= 0, "grace_s", "must be ≥ 0")
        need(0 <= self.metrics_port <= 65535, "metrics_port", "must be in [0, 65535]")
        need(self.max_queue >= 1, "max_queue", "must be ≥ 1")
        need(not (self.token and self.token_file), "token_file", "give token or token_file, "
             "not both")
        need(self.checkpoint_every_steps >= 0, "checkpoint_every_steps", "must be ≥ 0")
        need(self.checkpoint_every_seconds >= 0, "checkpoint_every_seconds", "must be ≥ 0")
        need(self.checkpoint_keep >= 1, "checkpoint_keep", "must be ≥ 1")
        need(0 <= self.front_processes <= 64, "front_processes", "must be in [0, 64]")

    def limits(self) -> Limits:
        """The limits the service enforces."""
        return Limits(self.max_message_bytes, self.max_batch_size, self.max_streams,
                      self.max_queue, self.receive_timeout_s)

    def bearer_token(self) -> str:
        """``token``, or the contents of ``token_file``; "" when auth is off."""
        if not self.token_file:
            return self.token
        try:
            token = Path(self.token_file).read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidArgument("token_file", f"cannot read {self.token_file}: {exc}") from exc
        if not token:
            raise InvalidArgument("token_file", f"{self.token_file} is empty")
        return token


class DecodeGuard(grpc.ServerInterceptor):
    """Answers INVALID_ARGUMENT, not grpc's INTERNAL, when request bytes do not parse."""

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or not details.method.startswith(f"/{SERVICE_NAME}/"):
            return handler
        parse, name = handler.request_deserializer, details.method.rsplit("/", 1)[1]

        def deserialize(data: bytes):
            try:
                return parse(data)
            except Exception as exc:  # noqa: BLE001 — protobuf's DecodeError and kin
                return _Undecodable(undecodable(name, exc))

        def checked(requests):
            for request in requests:
                if isinstance(request, _Undecodable):
                    raise InvalidArgument("request", request.problem)
                yield request

        if handler.request_streaming:
            inner = handler.stream_stream or handler.stream_unary

            def behaviour(requests, context):
                return inner(checked(requests), context)
        else:
            inner = handler.unary_unary or handler.unary_stream

            def behaviour(request, context):
                if isinstance(request, _Undecodable):
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"request: {request.problem}")
                return inner(request, context)
        return same_shape(handler, behaviour, deserialize)


class _Undecodable:
    """Stands in for a request whose bytes did not parse."""

    def __init__(self, problem: str):
        self.problem = problem


#: Methods whose requests are parsed with zero-copy tensors (server/framing.py), and how.
ZERO_COPY_METHODS = {"TrainStep": train_request_deserializer,
                     "TrainStream": train_request_deserializer,
                     "InsertStream": insert_request_deserializer}


class _Recorder:
    """Stands in for a grpc server to catch the generated code's method handlers."""

    def __init__(self):
        self.handlers: dict[str, dict[str, grpc.RpcMethodHandler]] = {}

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self.handlers[service] = dict(handlers)


#: glibc malloc's settings for a server's processes, which allocate and free request-sized
#: buffers (about 1 MB at B = 1024) at a high rate: glibc serves those above a dynamic
#: threshold with mmap and trims freed heap tops, so each buffer is page-faulted back in;
#: with both thresholds fixed the memory is reused (docs/benchmarks.md measures the gain).
MALLOC_SETTINGS = {"MALLOC_MMAP_THRESHOLD_": 32 << 20, "MALLOC_TRIM_THRESHOLD_": 256 << 20}


def tune_malloc() -> bool:
    """Apply :data:`MALLOC_SETTINGS` to this process and, through the environment, to the
    processes it starts from now on.  A setting the environment already has is the user's:
    glibc read it when this process started, and it is left as it is.  True when glibc's
    ``mallopt`` took every setting it was given (False off glibc)."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    ours = {name: value for name, value in MALLOC_SETTINGS.items() if name not in os.environ}
    os.environ.update({name: str(value) for name, value in ours.items()})
    return all(mallopt(_MALLOPT[name], value) == 1 for name, value in ours.items())


_MALLOPT = {"MALLOC_MMAP_THRESHOLD_": -3, "MALLOC_TRIM_THRESHOLD_": -1}   # malloc.h's M_*


def add_learner_servicer(servicer, server: grpc.Server) -> None:
    """``add_LearnerServicer_to_server``, with the requests of :data:`ZERO_COPY_METHODS`
    parsed by server/framing.py instead of protobuf's ``FromString``, and their answers
    serialised by :func:`_serialize` (a train answer comes as its bytes)."""
    recorder = _Recorder()
    pb_grpc.add_LearnerServicer_to_server(servicer, recorder)
    (service, handlers), = recorder.handlers.items()
    for name, deserializer in ZERO_COPY_METHODS.items():
        handlers[name] = same_shape(handlers[name], handlers[name].stream_stream
                                     or handlers[name].unary_unary, deserializer,
                                     response_serializer=_serialize)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    server.add_registered_method_handlers(service, handlers)


def _serialize(response) -> bytes:
    """A message's bytes, or those of a train answer already encoded (EncodedTrainResponse)."""
    return response.SerializeToString()


def _read(path: str) -> bytes:
    return Path(path).read_bytes()


def learner_method(path: str) -> str | None:
    """The Learner rpc's name of a method path ("/duelq.v1.Learner/Act" → "Act"), else None
    (health, reflection)."""
    service, _, name = path.rpartition("/")
    return name if service == f"/{SERVICE_NAME}" else None


def make_gate(options: ServerOptions, rpcs: Tally,
              on_refuse: Callable[[str, str], None] | None = None) -> Gate:
    """The :class:`Gate` of ``options`` (token, receive deadline) over ``rpcs``;
    ``on_refuse``: told (rpc name, code name) of each refusal of a Learner rpc."""
    def refused(path: str, code: grpc.StatusCode) -> None:
        name = learner_method(path)
        if name is not None and on_refuse is not None:
            on_refuse(name, code.name)
    return Gate(rpcs, options.receive_timeout_s, token=options.bearer_token(),
                on_refuse=refused, self_timed=SELF_TIMED)


def server_args(options: ServerOptions, *, share_port: bool = False) -> list[tuple[str, int]]:
    """The gRPC server arguments of ``options``: message-size limits; a port in use is an
    error, unless ``share_port`` (several front processes, each binding it with this)."""
    size = options.max_message_bytes
    return [("grpc.max_receive_message_length", size), ("grpc.max_send_message_length", size),
            ("grpc.so_reuseport", int(share_port))]


def grpc_server(options: ServerOptions, interceptors: tuple, *,
                share_port: bool = False) -> grpc.Server:
    """grpc's sync server with ``options``' message-size limits and workers for
    ``max_rpcs`` admitted calls (the first interceptor, a :class:`Gate`, admits them)."""
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=worker_count(options.max_rpcs),
                                   thread_name_prefix="duelq-rpc"),
        interceptors=interceptors, options=server_args(options, share_port=share_port))


def add_health_and_reflection(server: grpc.Server) -> health.HealthServicer:
    """Health (NOT_SERVING for now) and reflection (v1 and v1alpha) of the Learner, Health
    and reflection services; returns the health servicer."""
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    enable_reflection((SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name),
                      server)
    set_health(servicer, health_pb2.HealthCheckResponse.NOT_SERVING)
    return servicer


def set_health(servicer: health.HealthServicer, status: int) -> None:
    for name in ("", SERVICE_NAME):
        servicer.set(name, status)


def bind(server: grpc.Server, options: ServerOptions, address: str = "") -> int:
    """Listen on ``options``' host:port (TLS if configured) or on ``address`` (plaintext, for
    a private Unix socket); the bound port.  OSError when it cannot."""
    private, address = bool(address), address or f"{options.host}:{options.port}"
    try:
        if private:
            port = server.add_insecure_port(address)
        elif options.tls_cert:
            port = server.add_secure_port(address, grpc.ssl_server_credentials(
                [(_read(options.tls_key), _read(options.tls_cert))],
                root_certificates=(_read(options.tls_client_ca)
                                   if options.tls_client_ca else None),
                require_client_auth=bool(options.tls_client_ca)))
        else:
            port = server.add_insecure_port(address)
    except RuntimeError as exc:  # grpcio raises RuntimeError when it cannot bind
        raise OSError(f"cannot listen on {address}: {exc}") from exc
    if port == 0 and not private:
        raise OSError(f"cannot listen on {address}")
    return port


def key_guard(options: ServerOptions, records: bytes | None = None) -> KeyGuard:
    """The idempotency records of ``options``' bounds: empty, or read from ``records`` (a
    checkpoint's; ValueError when malformed)."""
    bounds = dict(capacity=options.recorded_responses, max_actors=options.max_actors,
                  idle_s=options.actor_idle_s)
    if records is None:
        return KeyGuard(**bounds)
    return KeyGuard.from_bytes(records, RECORDED_KINDS, **bounds)


def local_target(host: str, port: int | None) -> str:
    """host:port a client on this machine can dial for a server bound to ``host``."""
    host = {"0.0.0.0": "127.0.0.1", "[::]": "[::1]", "::": "[::1]"}.get(host, host)
    return f"{host}:{port}"


class LearnerServer:
    """A running duelq gRPC server; attach a learner to start serving it."""

    def __init__(self, options: ServerOptions, *,
                 interceptors: tuple[grpc.ServerInterceptor, ...] = ()):
        self.options = options
        self.service = LearnerService(options.limits(), keys=key_guard(options))
        self.metrics = Metrics(lambda: self.service._learner) if options.metrics_port else None
        inner: tuple[grpc.ServerInterceptor, ...] = (DecodeGuard(),) + tuple(interceptors)
        on_refuse = None
        if self.metrics is not None:
            inner = (self.metrics.interceptor,) + inner
            self.metrics.checkpoint_dir = options.checkpoint_dir
            on_refuse = self.metrics.count_refusal
        self.gate = make_gate(options, Count(options.max_rpcs), on_refuse)
        self._server = grpc_server(options, (self.gate,) + inner)
        add_learner_servicer(self.service, self._server)
        self.health = add_health_and_reflection(self._server)
        self.port: int | None = None
        self.replay_loop: ReplayLoop | None = None
        """Trains from the replay buffer to hold replay_ratio (when it is set)."""

    def _set_health(self, status: int) -> None:
        set_health(self.health, status)

    @property
    def learner(self) -> Learner:
        return self.service.learner

    @property
    def target(self) -> str:
        """host:port a client on this machine can dial."""
        return local_target(self.options.host, self.port)

    def start(self, address: str = "") -> int:
        """Bind (``host:port``, or ``address``) and start serving health and reflection;
        returns the bound port (0 for a Unix socket)."""
        self.port = bind(self._server, self.options, address)
        if self.metrics is not None:  # before serving: a busy port leaves nothing running
            self.metrics_port = self.metrics.serve(self.options.metrics_port, self.options.host)
        self._server.start()
        log.info("listening on %s (%s), health NOT_SERVING until the backend is ready",
                 address or f"{self.options.host}:{self.port}",
                 "TLS" if self.options.tls_cert and not address else "plaintext")
        return self.port

    def serve_learner(self, config: LearnerConfig, *, backend: str = "auto") -> Learner:
        """Build the learner, resumed from ``checkpoint_dir``'s newest checkpoint, and attach it.

        Raises :class:`CheckpointError` when that checkpoint is unreadable, corrupt or
        written under a config that differs outside TUNABLE_FIELDS (a difference inside
        them is logged), or the directory is unusable: never starts fresh over a checkpoint
        it cannot read.
        """
        directory, state, keys, found = self.options.checkpoint_dir, None, None, None
        if directory:
            try:
                Path(directory).mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise CheckpointError(directory, f"cannot use as checkpoint directory: "
                                                 f"{exc}") from exc
            found = read_latest(directory, config, allow_changes=TUNABLE_FIELDS)
            if found is None:
                log.info("no checkpoint in %s: starting fresh at step 0", directory)
            else:
                state = found.state
                if KEY_RECORDS_EXTRA in found.extras:
                    try:
                        keys = key_guard(self.options, found.extras[KEY_RECORDS_EXTRA])
                    except ValueError as exc:
                        raise CheckpointError(found.path, str(exc)) from exc
                else:
                    log.warning("%s holds no idempotency records: a retried request applied "
                                "before it would be applied again", found.path)
                log.info("resuming from %s: step %d", found.path, state.step)
                changed = changed_fields(found.config, config)
                if changed:
                    log.warning("resuming with changed settings: %s", "; ".join(
                        f"{name} {getattr(found.config, name)!r} → {getattr(config, name)!r}"
                        for name in changed))
        state = state if state is not None else LearnerState.initial(config)
        learner = Learner(config, backend=make_backend(backend, config, state),
                          max_batch_size=self.options.max_batch_size)
        if found is not None and REPLAY_BUFFER_EXTRA in found.extras:
            _resume_buffer(learner, found.extras[REPLAY_BUFFER_EXTRA], found.path)
        self.attach(learner, keys=keys)
        return learner

    def attach(self, learner: Learner, *, keys: KeyGuard | None = None) -> None:
        """Serve ``learner`` (with ``keys``' idempotency records) and report SERVING."""
        self.service.attach(learner, keys=keys)
        o = self.options
        self.service.checkpoint_replay = o.checkpoint_replay
        if learner.replay is not None and learner.config.replay_ratio > 0:
            self.replay_loop = ReplayLoop(self.service)
            self.service.on_insert = self.replay_loop.notify
            self.replay_loop.start()
        if o.checkpoint_dir:
            self.service.checkpoints = CheckpointWriter(
                o.checkpoint_dir, learner.config, self.service.snapshot, keep=o.checkpoint_keep,
                every_steps=o.checkpoint_every_steps, every_seconds=o.checkpoint_every_seconds,
                step=learner.step_count, backend=learner.backend.name)
            self.service.checkpoints.start()
        self._set_health(health_pb2.HealthCheckResponse.SERVING)
        log.info("serving %s: backend %s on %s, step %d", SERVICE_NAME, learner.backend.name,
                 learner.backend.device, learner.step_count)

    def stop(self, grace_s: float | None = None, *,
             final_checkpoint: bool = True) -> tuple[Path, int] | None:
        """NOT_SERVING and no new calls (running ones get ``grace_s``), drain state
        changes, final checkpoint (unless ``final_checkpoint`` is False).

        New calls are turned away before the drain, not after it: clients that the drain
        answers UNAVAILABLE retry at once, and a call of theirs that reached gRPC just as
        it shut down would be cancelled (CANCELLED, which the client library retries for
        its streams only) rather than find the port closed (UNAVAILABLE).

        Returns the final checkpoint's (path, step), or None without one.
        Raises :class:`CheckpointError` if it cannot be written (gRPC still stops).
        """
        self.health.enter_graceful_shutdown()
        grace = self.options.grace_s if grace_s is None else grace_s
        stopped = self._server.stop(grace)
        saved = None
        try:
            if self.replay_loop is not None:
                self.replay_loop.stop()
            if self.service._learner is not None:
                self.service.drain()
                if self.service.checkpoints is not None:
                    saved = self.service.checkpoints.close(final=final_checkpoint)
        finally:
            stopped.wait()
            self.gate.close()
            self.service.close()
            if self.metrics is not None:
                self.metrics.close()
            log.info("stopped")
        return saved


def _resume_buffer(learner: Learner, data: bytes, path: Path) -> None:
    """Load a checkpoint's replay buffer into ``learner``; CheckpointError when it does not
    fit the configuration."""
    if learner.replay is None:
        log.warning("%s holds a replay buffer, but replay_capacity is 0: it is not loaded",
                    path)
        return
    try:
        buffer = ReplayState.from_bytes(data, learner.config)
    except ValueError as exc:
        raise CheckpointError(path, f"replay buffer: {exc}") from exc
    learner.load_replay(buffer)
    log.info("replay buffer resumed from %s: %d rows, %d inserted, %d drawn", path,
             buffer.size, buffer.inserted, buffer.sampled)
