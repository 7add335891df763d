"""The gRPC servicer of ``duelq.v1.Learner``: decode, validate, call the learner, encode.

Every handler goes through one choke point (:func:`_rpc`) that maps
exceptions to status codes with ``context.abort`` (see learner.proto's header):
InvalidArgument → INVALID_ARGUMENT, ResourceExhausted → RESOURCE_EXHAUSTED,
NonFiniteStep → FAILED_PRECONDITION, AlreadyApplied → ALREADY_EXISTS, anything
unexpected → INTERNAL with a reference number, the traceback only in the log.

State changes (train steps, entropy EMAs), and Act's read of θ with its
version, run under one lock (a train request is decoded, checked and sent on its way
to the device before it queues for that lock), so keys are checked and recorded atomically with
the step they guard and steps apply one at a time in arrival order.  At most
``max_queue`` requests wait for that lock (RESOURCE_EXHAUSTED past it).  A
stream (TrainStream, InsertStream) reads its requests on a thread of its own
(:class:`StreamReader`), one at a time, so a client that does not read its answers stops
being read, and is cancelled once an answer has waited ``receive_timeout_s``; one that
sends no request for as long is ended UNAVAILABLE.  A
request whose deadline passes, or whose client goes away, while it waits is
answered DEADLINE_EXCEEDED and not applied; one that has started is applied
and recorded under its key.  A checkpoint snapshot (state and idempotency
records) is taken under the same lock.  :meth:`LearnerService.drain` refuses
new state changes (UNAVAILABLE) and waits for those admitted to finish.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import logging
import queue
import secrets
import struct
import threading
import time
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Callable, Iterator

import grpc
import numpy as np

from duelq.server.core.batch import Batch, PackedBatch
from duelq.server.core.checkpoint import CheckpointError, CheckpointWriter
from duelq.server.core.errors import (InvalidArgument, LearnerError, NonFiniteStep,
                                      ReplayNotReady, ResourceExhausted)
from duelq.server.core.learner import Learner, Prepared, PreparedInsert, StepResult
from duelq.server.core.replay import ReplayRun
from duelq.server.core.state import LearnerState
from duelq.server.framing import (insert_request_deserializer, train_request_deserializer,
                                  undecodable)
from duelq.server.gate import END, FAILED, StreamReader, Watchdog
from duelq.server.idempotency import AlreadyApplied, KeyGuard
from duelq.v1 import learner_pb2 as pb
from duelq.v1 import learner_pb2_grpc as pb_grpc
from duelq.wire.tensors import TensorError, decode, encode, tensor_head, varint
from duelq.wire.types import FIELD_DTYPES, PARAM_NAMES, Transitions

log = logging.getLogger(__name__)

def _version() -> str:
    try:
        return metadata.version("duelq")
    except metadata.PackageNotFoundError:  # run from a source tree (the GPU image's link farm)
        return "0+source"


SERVER_VERSION = _version()

#: The recorded response types, by name, for idempotency records in checkpoints.
RECORDED_KINDS = {"TrainResponse": pb.TrainResponse,
                "ComputeEntropyResponse": pb.ComputeEntropyResponse,
                "InsertStreamResponse": pb.InsertStreamResponse,
                "TrainReplayResponse": pb.TrainReplayResponse}
#: Most steps of one TrainReplay request.
MAX_REPLAY_STEPS = 4096
#: The checkpoint extra that holds the replay buffer (``--checkpoint-replay``).
REPLAY_BUFFER_EXTRA = "replay_buffer"
#: The checkpoint extra that holds the idempotency records (its name, older than the
#: replay buffer, is part of the checkpoint format).
KEY_RECORDS_EXTRA = "replay"


class NotServing(LearnerError):
    """The backend is not ready yet (health NOT_SERVING)."""


class CheckpointsOff(LearnerError):
    """SaveCheckpoint on a server started without a checkpoint directory."""


class Expired(LearnerError):
    """The call's deadline passed (or its client left) before the request was applied."""


class StreamIdle(LearnerError):
    """A stream (TrainStream, InsertStream) sent no request for ``receive_timeout_s`` while
    none was in flight."""


_STATUS: tuple[tuple[tuple[type[BaseException], ...], grpc.StatusCode], ...] = (
    ((InvalidArgument, TensorError), grpc.StatusCode.INVALID_ARGUMENT),
    ((ResourceExhausted,), grpc.StatusCode.RESOURCE_EXHAUSTED),
    ((NonFiniteStep, CheckpointsOff, ReplayNotReady), grpc.StatusCode.FAILED_PRECONDITION),
    ((AlreadyApplied,), grpc.StatusCode.ALREADY_EXISTS),
    ((NotServing, StreamIdle), grpc.StatusCode.UNAVAILABLE),
    ((Expired,), grpc.StatusCode.DEADLINE_EXCEEDED),
    ((CheckpointError,), grpc.StatusCode.INTERNAL),  # the message names the file and the cause
)


def refusal(exc: Exception, method: str, peer: str) -> tuple[grpc.StatusCode, str]:
    """The choke point: one exception → (status code, details), logged."""
    for types, code in _STATUS:
        if isinstance(exc, types):
            message = str(exc)
            log.info("%s from %s: %s %s", method, peer, code.name, message)
            return code, message
    ref = secrets.token_hex(4)
    log.error("%s from %s: internal error (ref %s)", method, peer, ref, exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error (ref {ref}); see the server log"


def _abort(context: grpc.ServicerContext, method: str, exc: Exception) -> None:
    context.abort(*refusal(exc, method, context.peer()))


def _rpc(handler):
    """Route a unary or response-streaming handler's exceptions through :func:`_abort`."""
    if inspect.isgeneratorfunction(handler):
        @functools.wraps(handler)
        def stream(self, request, context):
            try:
                yield from handler(self, request, context)
            except Exception as exc:  # noqa: BLE001 — the one choke point
                if context.is_active():
                    _abort(context, handler.__name__, exc)
        return stream

    @functools.wraps(handler)
    def unary(self, request, context):
        try:
            return handler(self, request, context)
        except Exception as exc:  # noqa: BLE001 — the one choke point
            _abort(context, handler.__name__, exc)
    return unary


def _required(message, field: str) -> np.ndarray:
    if not message.HasField(field):
        raise InvalidArgument(field, "is required")
    return decode(getattr(message, field), field, dtypes=FIELD_DTYPES[field])


def _features(message, field: str, keep_16bit: bool) -> np.ndarray:
    """A feature matrix: float16 and bfloat16 as they came when the backend widens them
    itself, else widened to float32 here (exactly)."""
    if not message.HasField(field):
        raise InvalidArgument(field, "is required")
    a = decode(getattr(message, field), field, widen=not keep_16bit, dtypes=FIELD_DTYPES[field])
    return a.astype(np.float32) if a.dtype == np.float16 and not keep_16bit else a


def decode_batch(request: pb.TrainRequest, *, keep_16bit: bool = False) -> Batch:
    """The numpy Batch of a TrainRequest (size checks only; the learner checks values)."""
    return Batch(_features(request, "h_t", keep_16bit), _features(request, "h_tp1", keep_16bit),
                 _required(request, "actions"), _required(request, "rewards"),
                 _required(request, "dones"), _required(request, "discounts"),
                 _required(request, "weights") if request.HasField("weights") else None)


def decode_transitions(request: pb.InsertStreamRequest) -> Transitions:
    """The numpy Transitions of an InsertStreamRequest, features as they came (size checks only;
    the learner checks values; the buffer widens 16-bit rows it stores as float32)."""
    return Transitions(_features(request, "h_t", True), _features(request, "h_tp1", True),
                       _required(request, "actions"), _required(request, "rewards"),
                       _required(request, "dones"), _required(request, "discounts"),
                       _required(request, "priorities")
                       if request.HasField("priorities") else None)


def replay_response(run: ReplayRun, step: int, key: pb.RequestKey) -> pb.TrainReplayResponse:
    """The TrainReplayResponse of ``run`` (means over its applied steps, in step order)."""
    means = [float(np.mean(v)) if run.steps else 0.0
             for v in (run.losses, run.q_taken_means, run.grad_norms)]
    return pb.TrainReplayResponse(steps=run.steps, refused=run.refused, loss=means[0],
                                  q_taken_mean=means[1], grad_norm=means[2], step=step,
                                  version=step, key=key)


#: The small rpcs a front process relays whole (its others it forwards over gRPC:
#: SaveCheckpoint, which writes a file, would hold up the learner's steps meanwhile).
RELAYED_CALLS = ("Act", "GetWeights", "ReadISV", "GetInfo", "ComputeEntropy")
#: The unary rpcs that wait for the apply lock, so count against ``max_queue`` (a front
#: holds a place while one is at the learner, relayed or forwarded).
QUEUED_CALLS = ("Act", "ComputeEntropy", "TrainReplay")
_REQUESTS = {name: getattr(pb, pb.DESCRIPTOR.services_by_name["Learner"].methods_by_name[
    name].input_type.name) for name in RELAYED_CALLS}


def too_many_streams(limit: int) -> str:
    """What the server says to a stream past ``max_streams``, in every server model."""
    return f"too many concurrent streams, TrainStreams and InsertStreams (limit {limit})"


def queue_full(limit: int) -> str:
    """What the server says to a request past ``max_queue``, in every server model."""
    return f"{limit} requests already wait for the learner (max_queue {limit})"


def stream_idle(timeout_s: float) -> str:
    """What the server says to a stream idle for ``receive_timeout_s``."""
    return (f"no request for {timeout_s:g} s while none was in flight: the stream is "
            f"closed; open another to send more (resending unanswered keys is safe)")


def slot_of(ref: pb.SlotRef, field: str = "slot") -> str | int:
    which = ref.WhichOneof("ref")
    if which is None:
        raise InvalidArgument(field, "is required (a name or an index)")
    return getattr(ref, which)


class EncodedTrainResponse:
    """A TrainResponse already in its wire bytes (:func:`train_response`), with the fields
    the server reads back; recorded under its key as a message would be."""

    __slots__ = ("data", "step", "loss", "rows")
    DESCRIPTOR = pb.TrainResponse.DESCRIPTOR   # the message it encodes (KeyGuard)
    replayed = False

    def __init__(self, data: bytes, step: int, loss: float, rows: int):
        self.data, self.step, self.loss, self.rows = data, step, loss, rows

    def SerializeToString(self) -> bytes:  # noqa: N802 — protobuf's spelling
        return self.data


_DOUBLE = struct.Struct("<d")
_ZERO_DOUBLE = bytes(8)


def train_response(result: StepResult, key: bytes) -> EncodedTrainResponse:
    """The TrainResponse of ``result`` and a key given as its wire bytes, written straight
    to protobuf's canonical bytes (field order, defaults left out; the key's as given,
    canonical from a client or a front's Packer), the vectors copied once and no message
    built; tests hold it byte-equal to the message protobuf would serialise."""
    td = np.ascontiguousarray(result.td_errors, np.float32)          # [B]
    priorities = np.ascontiguousarray(result.priorities, np.float32)  # [B]
    step = varint(result.step)   # the version's value too
    parts = [_double_field(b"\x09", result.loss),
             _float32_head(2, td.shape, td.nbytes), td,
             _float32_head(3, priorities.shape, priorities.nbytes), priorities,
             _double_field(b"\x21", result.q_taken_mean),
             _double_field(b"\x29", result.grad_norm),
             b"\x30" + step + b"\x38" + step if result.step else b""]
    if result.entropy is not None:   # optional: present even when 0
        parts.append(b"\x41" + _DOUBLE.pack(result.entropy))
    parts += (b"\x4a", varint(len(key)), key)   # the key is always set
    return EncodedTrainResponse(b"".join(parts), result.step, result.loss, td.shape[0])


@functools.lru_cache(maxsize=64)
def _float32_head(number: int, shape: tuple[int, ...], nbytes: int) -> bytes:
    """:func:`tensor_head` of a float32 field, the same for every step of one batch size."""
    return tensor_head(number, pb.DTYPE_FLOAT32, shape, nbytes)


def _double_field(tag: bytes, value: float) -> bytes:
    """A proto3 double field: left out when its bits are all zero (-0.0 is written)."""
    packed = _DOUBLE.pack(value)
    return b"" if packed == _ZERO_DOUBLE else tag + packed


@dataclass
class Job:
    """A request checked and on its way to the device, waiting for the apply lock; a
    context manager: closing it gives an unused upload back.

    Read-only by convention; not frozen, being built per request (docs/benchmarks.md)."""

    key: pb.RequestKey
    prepared: Prepared | PreparedInsert

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.prepared.__exit__()


@dataclass
class TrainJob(Job):
    """A train request's job: a batch for the learner's step."""

    key_bytes: bytes | None = None   # the key's wire bytes, where the request gave them


@dataclass
class InsertJob(Job):
    """An insert's job: rows for the replay buffer."""


class _Release:
    """Leaving a ``with`` block releases the service's apply lock, which the block's owner
    took (a plain object: a generator-based context manager costs more, on every step)."""

    def __init__(self, service: "LearnerService"):
        self._service = service

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc) -> None:
        self._service._apply_lock.release()


@dataclass(frozen=True)
class Limits:
    """What the server enforces besides the learner's own checks (ServerOptions.limits)."""

    max_message_bytes: int
    max_batch_size: int
    max_streams: int
    max_queue: int
    receive_timeout_s: float


class LearnerService(pb_grpc.LearnerServicer):
    """``duelq.v1.Learner`` over a :class:`Learner` that is attached once it is ready."""

    def __init__(self, limits: Limits, *, keys: KeyGuard | None = None):
        self.limits = limits
        self._keys = keys if keys is not None else KeyGuard()
        self.checkpoints: CheckpointWriter | None = None
        """Saves checkpoints (SaveCheckpoint, periodic); None: checkpoints are off."""
        self._learner: Learner | None = None
        self._apply_lock = threading.Lock()
        self._release = _Release(self)   # what _admit returns
        self._queue_lock = threading.Lock()  # guards _queued and _draining
        self._queued = 0                     # requests admitted, waiting for _apply_lock
        self._draining = False
        self._streams = threading.BoundedSemaphore(limits.max_streams)
        self._answers = Watchdog(limits.receive_timeout_s)   # streams' unread answers
        self.checkpoint_replay = False
        """Checkpoints carry the replay buffer (``--checkpoint-replay``)."""
        self.on_insert: Callable[[], None] | None = None
        """Told after each new insert (the replay loop's wake-up), outside the apply lock."""

    def attach(self, learner: Learner, *, keys: KeyGuard | None = None) -> None:
        """Start serving ``learner`` (with ``keys``' records, when resumed)."""
        if keys is not None:
            self._keys = keys
        self._learner = learner

    def snapshot(self) -> tuple[LearnerState, dict[str, bytes]]:
        """A consistent (state, extras) pair for a checkpoint: the idempotency records
        (:data:`KEY_RECORDS_EXTRA`) and, with ``checkpoint_replay``, the replay buffer
        (:data:`REPLAY_BUFFER_EXTRA`)."""
        learner = self.learner
        with self._apply_lock:
            state, keys = learner.snapshot(), self._keys.copy()
            buffer = (learner.replay_snapshot()
                      if self.checkpoint_replay and learner.replay is not None else None)
        extras = {KEY_RECORDS_EXTRA: keys.to_bytes()}
        if buffer is not None:
            extras[REPLAY_BUFFER_EXTRA] = buffer.to_bytes()
        return state, extras

    def close(self) -> None:
        """Stop the watch over streams' answers (the server has stopped)."""
        self._answers.close()

    def drain(self) -> None:
        """Refuse new state changes (UNAVAILABLE); return once the admitted ones are done."""
        with self._queue_lock:
            self._draining = True
        while True:
            with self._apply_lock, self._queue_lock:
                if self._queued == 0:
                    return
            time.sleep(0.001)

    def _admit(self, context: grpc.ServicerContext | None, *,
               change: pb.RequestKey | None = None) -> "_Release":
        """Take the apply lock for one request (bounded queue, deadline, drain); returns
        what gives it back at the end of a ``with`` block.  ``change``: the key of a state
        change, which draining refuses (None: a read)."""
        with self._queue_lock:
            if change is not None:
                self._refuse_if_draining(change)
            if self._queued >= self.limits.max_queue:
                raise ResourceExhausted(queue_full(self.limits.max_queue))
            # A free lock is taken here, before a drain can start: nothing to wait for.
            got = self._apply_lock.acquire(blocking=False)
            if not got:
                self._queued += 1
        if not got:
            try:
                left = context.time_remaining() if context is not None else None
                # No deadline: grpc reports one far in the future.
                got = self._apply_lock.acquire(timeout=-1 if left is None or left > 1e6
                                               else max(left, 0.0))
            finally:
                with self._queue_lock:
                    self._queued -= 1
        if not got:
            raise Expired("the deadline passed while the request waited for the learner; "
                          "it was not applied")
        if context is not None and not context.is_active():
            self._apply_lock.release()
            raise Expired("the call ended (deadline or cancellation) while the request "
                          "waited for the learner; it was not applied")
        return self._release

    def _refuse_if_draining(self, key: pb.RequestKey) -> None:
        """NotServing while draining, its advice fit for a request with ``key`` or none."""
        if self._draining:
            raise NotServing("the server is shutting down; the request was not applied: "
                             + ("retry it with the same key" if key.actor_id else "retry it"))

    def _check_key(self, key: pb.RequestKey) -> None:
        """Refuse a state change's malformed key (a train, insert or TrainReplay request's),
        or any while draining: early, before the request's own work (_admit decides again)."""
        KeyGuard.check_key(key.actor_id, key.seq)
        self._refuse_if_draining(key)

    @property
    def learner(self) -> Learner:
        if self._learner is None:
            raise NotServing("the learner's backend is still starting; retry shortly")
        return self._learner

    def _keyed(self, key: pb.RequestKey, kind: type, apply: Callable[[], Any],
               context: grpc.ServicerContext | None) -> Any:
        """Run a state change once per key (already checked by the caller, before its own
        work): a repeat gets the recorded response, marked ``replayed``."""
        actor_id = key.actor_id
        with self._admit(context, change=key):
            if actor_id:
                recorded = self._keys.lookup(actor_id, key.seq, kind)
                if recorded is not None:   # a message, or an EncodedTrainResponse
                    again = kind.FromString(recorded.SerializeToString())
                    again.replayed = True
                    return again
            response = apply()
            if actor_id:
                self._keys.record(actor_id, key.seq, response)
            return response

    def _train(self, request: pb.TrainRequest, context: grpc.ServicerContext | None
               ) -> EncodedTrainResponse | pb.TrainResponse:
        with self.prepare_train(request) as job:
            return self.apply_train(job, context)

    def prepare_train(self, request: pb.TrainRequest) -> TrainJob:
        """A train request's checks and its copy towards the device, which run before the
        apply lock, beside the step that holds it."""
        learner = self.learner   # NotServing before attach
        self._check_key(request.key)
        batch = decode_batch(request, keep_16bit=bool(learner.backend.feature_dtypes))
        return TrainJob(request.key, learner.prepare(batch))

    def apply_train(self, job: TrainJob, context: grpc.ServicerContext | None
                    ) -> EncodedTrainResponse | pb.TrainResponse:
        """Step a prepared request once under the apply lock: a new step's answer in its wire
        bytes (:class:`EncodedTrainResponse`), a replayed key's as the recorded message (its
        upload is simply given back when the job closes)."""
        learner = self.learner

        def apply() -> EncodedTrainResponse:
            result = learner.step(job.prepared)
            key = job.key_bytes
            response = train_response(result, key if key is not None
                                      else job.key.SerializeToString())
            if self.checkpoints is not None:
                self.checkpoints.notify(response.step)
            return response
        return self._keyed(job.key, pb.TrainResponse, apply, context)

    def relay_prepare(self, data: memoryview, method: str) -> TrainJob | InsertJob:
        """:meth:`prepare_train` (or :meth:`prepare_insert`) of a relayed request's bytes,
        ``method``'s.  Bytes that do not parse are refused as DecodeGuard refuses them on a
        gRPC server."""
        insert = method == "InsertStream"
        try:
            request = (insert_request_deserializer if insert
                       else train_request_deserializer)(data)
        except Exception as exc:  # noqa: BLE001 — protobuf's DecodeError and kin
            raise InvalidArgument("request", undecodable(method, exc)) from None
        return self.prepare_insert(request) if insert else self.prepare_train(request)

    def relay_prepare_packed(self, packed: PackedBatch, key_bytes: bytes,
                             method: str) -> TrainJob | InsertJob:
        """:meth:`prepare_train` (or :meth:`prepare_insert`) of a relayed request of
        ``method`` that a front process packed: its arrays in the packed layout (an
        insert's priorities in the weights' place), and its key's wire bytes."""
        learner = self.learner   # NotServing before attach
        key = pb.RequestKey.FromString(key_bytes)   # the front parsed it
        self._check_key(key)
        if method == "InsertStream":
            return InsertJob(key, learner.prepare_insert(packed))
        return TrainJob(key, learner.prepare_packed(packed), key_bytes)

    def call_relayed(self, name: str, request: bytes, context) -> bytes:
        """A small rpc (one of :data:`RELAYED_CALLS`) that a front process relayed whole
        (server/fronts/relay.py): its response's bytes.  Raises what the rpc refuses with; bytes
        that do not parse, InvalidArgument in DecodeGuard's words."""
        try:
            message = _REQUESTS[name].FromString(request)
        except Exception as exc:  # noqa: BLE001 — protobuf's DecodeError and kin
            raise InvalidArgument("request", undecodable(name, exc)) from None
        # The handler itself, not _rpc's wrapper, which would abort a grpc context.
        return getattr(type(self), name).__wrapped__(self, message, context).SerializeToString()

    def train_due(self, limit: int) -> ReplayRun | None:
        """The replay steps replay_ratio asks for now, at most ``limit`` (the replay loop's
        turn); None when none are due.  NotServing once draining.  They start under the
        apply lock and run on without it: inserts go on meanwhile, behind them on the
        device (the learner makes anything else wait for them).  The loop waits for the
        lock without taking one of the clients' ``max_queue`` places."""
        learner = self.learner
        with self._apply_lock:
            with self._queue_lock:   # under the lock: no run starts once a drain has begun
                self._refuse_if_draining(pb.RequestKey())   # the loop's steps have no key
            due = min(learner.replay_due(), limit)
            if due == 0:
                return None
            running = learner.start_replay(due)
        run = learner.finish_replay(running)
        if self.checkpoints is not None:
            self.checkpoints.notify(learner.step_count)
        return run

    def _insert(self, request: pb.InsertStreamRequest,
                context: grpc.ServicerContext | None) -> pb.InsertStreamResponse:
        with self.prepare_insert(request) as job:
            return self.apply_insert(job, context)

    def prepare_insert(self, request: pb.InsertStreamRequest) -> InsertJob:
        """An insert's checks and its copy towards the device, which run before the apply
        lock, beside the steps that hold it."""
        learner = self.learner   # NotServing before attach
        self._check_key(request.key)
        return InsertJob(request.key, learner.prepare_insert(decode_transitions(request)))

    def apply_insert(self, job: InsertJob, context: grpc.ServicerContext | None
                     ) -> pb.InsertStreamResponse:
        """Insert a prepared request's rows once under the apply lock; wake the replay loop."""
        learner = self.learner

        def apply() -> pb.InsertStreamResponse:
            result = learner.insert(job.prepared)
            return pb.InsertStreamResponse(rows=result.rows, size=result.size,
                                           inserted=result.inserted, version=result.step,
                                           step=result.step, key=job.key)
        response = self._keyed(job.key, pb.InsertStreamResponse, apply, context)
        if self.on_insert is not None and not response.replayed:
            self.on_insert()
        return response

    @_rpc
    def InsertStream(self, request_iterator, context) -> Iterator[pb.InsertStreamResponse]:
        self.learner  # noqa: B018 — UNAVAILABLE until a learner is attached
        yield from self._stream(request_iterator, context, self._insert, "InsertStream")

    @_rpc
    def TrainReplay(self, request, context):
        learner = self.learner
        self._check_key(request.key)
        if not 1 <= request.steps <= MAX_REPLAY_STEPS:
            raise InvalidArgument("steps", f"must be in [1, {MAX_REPLAY_STEPS}], "
                                           f"got {request.steps}")

        def apply() -> pb.TrainReplayResponse:
            run = learner.train_replay(request.steps)
            step = learner.step_count
            if self.checkpoints is not None:
                self.checkpoints.notify(step)
            return replay_response(run, step, request.key)
        return self._keyed(request.key, pb.TrainReplayResponse, apply, context)

    @_rpc
    def GetReplayInfo(self, request, context):
        return pb.GetReplayInfoResponse(**dataclasses.asdict(self.learner.replay_info()))

    @_rpc
    def TrainStep(self, request, context):
        return self._train(request, context)

    @_rpc
    def TrainStream(self, request_iterator, context) -> Iterator[pb.TrainResponse]:
        yield from self._stream(request_iterator, context, self._train, "TrainStream")

    def _stream(self, requests: Iterator, context: grpc.ServicerContext,
                answer: Callable[[Any, grpc.ServicerContext], Any], method: str) -> Iterator:
        """Stream ``method``'s requests answered in order by ``answer``, holding one of
        ``max_streams`` places; with no request for ``receive_timeout_s`` and none being
        answered, the stream ends UNAVAILABLE (StreamIdle); with an answer left unread as
        long, it is cancelled."""
        if not self._streams.acquire(blocking=False):
            raise ResourceExhausted(too_many_streams(self.limits.max_streams))
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        reader = StreamReader(requests, inbox, ahead=1)
        try:
            while True:
                try:
                    kind, item = inbox.get(timeout=self.limits.receive_timeout_s)
                except queue.Empty:
                    raise StreamIdle(stream_idle(self.limits.receive_timeout_s)) from None
                if kind == END:
                    return
                if kind == FAILED:
                    raise item
                reader.done()   # the next request is read and parsed while this one is applied
                yield from self._answers.send(answer(item, context), context, method)
        finally:
            reader.close()
            self._streams.release()

    @_rpc
    def ComputeEntropy(self, request, context):
        learner = self.learner
        actions = _required(request, "actions")
        slot = slot_of(request.slot)

        def apply() -> pb.ComputeEntropyResponse:
            result = learner.compute_entropy(actions, slot, request.alpha)
            return pb.ComputeEntropyResponse(entropy=result.entropy, ema=result.ema,
                                             slot=result.slot, key=request.key)
        KeyGuard.check_key(request.key.actor_id, request.key.seq)
        return self._keyed(request.key, pb.ComputeEntropyResponse, apply, context)

    @_rpc
    def Act(self, request, context):
        learner = self.learner
        h = _required(request, "h")
        with self._admit(context):
            q = learner.q_values(h, request.target)   # [B, N]
            version = learner.step_count
        return pb.ActResponse(q_values=encode(q, "q_values"),
                              actions=encode(q.argmax(axis=1).astype(np.int32), "actions"),
                              version=version)

    @_rpc
    def GetWeights(self, request, context):
        params, version = self.learner.weights(request.target)
        return pb.GetWeightsResponse(**{name: encode(np.asarray(a, np.float32), name)
                                        for name, a in zip(PARAM_NAMES, params.arrays())},
                                     version=version, step=version, target=request.target)

    @_rpc
    def ReadISV(self, request, context):
        slots = [slot_of(ref, f"slots[{i}]") for i, ref in enumerate(request.slots)]
        return pb.ReadISVResponse(values=[
            pb.ISVValue(slot=v.slot, name=v.name, value=v.value, observed=v.observed)
            for v in self.learner.read_isv(slots)])

    @_rpc
    def SaveCheckpoint(self, request, context):
        self.learner  # noqa: B018 — UNAVAILABLE until a learner is attached
        if self.checkpoints is None:
            raise CheckpointsOff("checkpoints are off: the server was started without "
                                 "--checkpoint-dir")
        path, step = self.checkpoints.save()
        return pb.SaveCheckpointResponse(path=str(path), step=step)

    @_rpc
    def GetInfo(self, request, context):
        learner = self.learner
        step = learner.step_count
        config = learner.config.to_dict()
        return pb.GetInfoResponse(
            backend=learner.backend.name, device=learner.backend.device,
            config_json=json.dumps(config), config=pb.LearnerConfig(**config), step=step,
            version=step, max_message_bytes=self.limits.max_message_bytes,
            max_batch_size=self.limits.max_batch_size, max_streams=self.limits.max_streams,
            max_queue=self.limits.max_queue, server_version=SERVER_VERSION)
