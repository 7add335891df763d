"""LearnerClient: what a remote actor uses to train, act and read a duelq learner.

Numpy in, numpy out.  Batches are checked locally (dtypes, shapes, lengths)
before anything is sent; values (ranges, NaN) are the server's to check.  The dtype
contract is the server's (learner.proto, ``duelq.wire.types.FIELD_DTYPES``): an array in
a wire dtype goes as it is, and one its field does not take is refused here in the
server's words; NumPy's other dtypes (float64, int64, …) are narrowed to the field's
first wire dtype of their kind (float32, int32) where the field takes that kind.
Every state-changing request carries an idempotency key (``actor_id``, seq):
on UNAVAILABLE the client backs off and resends with the same key, so a step
that did reach the server is not applied twice.  Every ``grpc.RpcError`` is
raised as a :mod:`duelq.client.errors` exception.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os
import queue
import random
import secrets
import socket
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from duelq.v1 import learner_pb2 as pb
from duelq.v1 import learner_pb2_grpc as pb_grpc

from duelq.client import errors
from duelq.wire import tensors
from duelq.wire.tensors import (INSERT_FIELDS, KEY_FIELD, TRAIN_FIELDS, WIRE_DTYPES, floating,
                                varint)
from duelq.wire.types import (FIELD_DTYPES, PARAM_NAMES, Batch, Params, ReplayInfo, Transitions,
                              spell, wrong_dtype)

FEATURE_WIRE_DTYPES = FIELD_DTYPES["h"]
#: What a keyed stream resends its unanswered requests after: the server going away or
#: draining, and its end of a stream whose answer went unread for its receive timeout.
STREAM_RETRIED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


@dataclass(frozen=True)
class TrainResult:
    """The outcome of one applied step (see TrainResponse in learner.proto)."""

    loss: float
    td_errors: np.ndarray    # [B] float32, before the update
    priorities: np.ndarray   # [B] float32, |δ| + ε
    q_taken_mean: float
    grad_norm: float
    step: int                # position in the server's global order of steps
    version: int
    entropy: float | None
    seq: int                 # this client's sequence number of the batch
    replayed: bool           # the server returned a recorded result of a retry


@dataclass(frozen=True)
class InsertResult:
    """The acknowledgement of one insert into the server's replay buffer (InsertStreamResponse)."""

    rows: int        # rows this insert stored
    size: int        # rows in the buffer after it
    inserted: int    # rows inserted into the buffer by every actor so far
    version: int     # the server's weights version: pull new weights when it grows
    step: int
    seq: int         # this client's sequence number of the insert
    replayed: bool   # the server returned a recorded result of a retry


@dataclass(frozen=True)
class ReplayTrainResult:
    """What TrainReplay's steps did (TrainReplayResponse)."""

    steps: int           # steps applied
    refused: bool        # a step would have been non-finite: refused, the rest not run
    loss: float          # means over the applied steps
    q_taken_mean: float
    grad_norm: float
    step: int
    version: int
    replayed: bool


@dataclass(frozen=True)
class EntropyResult:
    entropy: float   # nats
    ema: float       # the slot's value after the update
    slot: int
    replayed: bool


@dataclass(frozen=True)
class ActResult:
    q_values: np.ndarray  # [B, N] float32
    actions: np.ndarray   # [B] int32 greedy actions
    version: int


@dataclass(frozen=True)
class Weights:
    params: Params   # float32 w_v [H], b_v [1], w_a [H, N], b_a [N]
    version: int
    step: int
    target: bool


@dataclass(frozen=True)
class ISVValue:
    slot: int
    name: str
    value: float
    observed: bool


@dataclass(frozen=True)
class ServerInfo:
    backend: str
    device: str
    hidden_dim: int   # H of the head the server trains
    n_actions: int    # N
    config: dict      # the server's whole learner configuration (GetInfo's config_json)
    step: int
    version: int
    max_message_bytes: int
    max_batch_size: int
    max_streams: int
    server_version: str
    max_queue: int


_bad = errors.InvalidArgument.of


def _local(codec):
    """``codec`` with its TensorError raised as errors.InvalidArgument (a local refusal)."""
    @functools.wraps(codec)
    def call(*args, **kwargs):
        try:
            return codec(*args, **kwargs)
        except tensors.TensorError as exc:
            raise _bad(exc.field, exc.problem) from None
    return call


decode, encode, tensor_fields, tensor_wire = map(_local, (
    tensors.decode, tensors.encode, tensors.tensor_fields, tensors.tensor_wire))


_FEATURE_DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16)}


def _vector(name: str, value, rows: int) -> np.ndarray:
    """A [rows] vector in a wire dtype its field takes (:data:`FIELD_DTYPES`): as it is when
    it is in one; float64 → float32 and wide integers → int32 where the field takes those;
    any other dtype refused in the server's words."""
    if not isinstance(value, np.ndarray):
        raise _bad(name, f"must be a numpy array, got {type(value).__name__}")
    if value.shape != (rows,):
        raise _bad(name, f"shape must be [{rows}], got {list(value.shape)}")
    wanted, dtype = FIELD_DTYPES[name], value.dtype
    if dtype.name in wanted:
        return value
    narrow = ("float32" if dtype.kind == "f" else "int32" if dtype.kind in "iu" else None)
    if dtype.name in WIRE_DTYPES or narrow not in wanted:
        raise _bad(name, wrong_dtype(wanted, dtype.name))
    if narrow == "int32" and value.size and (value.min() < np.iinfo(np.int32).min
                                             or value.max() > np.iinfo(np.int32).max):
        raise _bad(name, "values do not fit in int32")
    return value.astype(narrow)


def _feature_dtype(wire) -> str:
    """``wire`` as one of :data:`FEATURE_WIRE_DTYPES` (a numpy dtype is taken by its name)."""
    name = wire
    if not isinstance(wire, str) and wire is not None:
        try:
            name = np.dtype(wire).name
        except (TypeError, ValueError):
            pass
    if not isinstance(name, str) or name not in FEATURE_WIRE_DTYPES:
        raise _bad("feature_dtype", f"must be {spell(FEATURE_WIRE_DTYPES)}, got {wire!r}")
    return name


def _features(name: str, value, wire: str, like: np.ndarray | None = None) -> dict:
    return tensor_fields(_feature_array(name, value, wire, like), name, wire=wire)


def _feature_array(name: str, value, wire: str, like: np.ndarray | None = None) -> np.ndarray:
    if not isinstance(value, np.ndarray):
        raise _bad(name, f"must be a numpy array, got {type(value).__name__}")
    if value.ndim != 2 or value.shape[0] == 0:
        raise _bad(name, f"must be [B, H] with B ≥ 1, got shape {list(value.shape)}")
    if like is not None and value.shape != like.shape:
        raise _bad(name, f"shape {list(value.shape)} differs from h_t's {list(like.shape)}")
    if not floating(value.dtype):
        raise _bad(name, wrong_dtype(FEATURE_WIRE_DTYPES, value.dtype.name))
    if wire != "bfloat16" and value.dtype != _FEATURE_DTYPES[wire]:
        value = value.astype(wire)   # bfloat16 too, through ml_dtypes (exact to float32)
    return value


def _row_arrays(rows: Batch | Transitions, optional: str,
                feature_dtype: str) -> list[tuple[str, np.ndarray, str | None]]:
    """The checked arrays of a batch or of transitions in field order, each with its wire
    dtype; ``optional`` names the last vector, sent when it is not None."""
    feature_dtype = _feature_dtype(feature_dtype)
    arrays = [("h_t", _feature_array("h_t", rows.h_t, feature_dtype), feature_dtype)]
    count = rows.h_t.shape[0]
    arrays.append(("h_tp1", _feature_array("h_tp1", rows.h_tp1, feature_dtype, like=rows.h_t),
                   feature_dtype))
    vectors = ("actions", "rewards", "dones", "discounts") + (
        (optional,) if getattr(rows, optional) is not None else ())
    return arrays + [(name, _vector(name, getattr(rows, name), count), None)
                     for name in vectors]


def _batch_arrays(batch: Batch, feature_dtype: str) -> list[tuple[str, np.ndarray, str | None]]:
    """The checked arrays of ``batch`` in field order, each with its wire dtype."""
    if not isinstance(batch, Batch):
        raise _bad("batch", f"must be a duelq.client.Batch, got {type(batch).__name__}")
    return _row_arrays(batch, "weights", feature_dtype)


def _transition_arrays(rows: Transitions,
                       feature_dtype: str) -> list[tuple[str, np.ndarray, str | None]]:
    """The checked arrays of ``rows`` in field order, each with its wire dtype."""
    if not isinstance(rows, Transitions):
        raise _bad("transitions", f"must be duelq.client.Transitions, got "
                                  f"{type(rows).__name__}")
    return _row_arrays(rows, "priorities", feature_dtype)


def encode_batch(batch: Batch, *, feature_dtype: str = "float32") -> pb.TrainRequest:
    """A TrainRequest (without key) for ``batch``; raises errors.InvalidArgument."""
    # Fields as dicts, so each tensor's bytes are copied into the message once.
    return pb.TrainRequest(**{name: tensor_fields(a, name, wire=wire)
                              for name, a, wire in _batch_arrays(batch, feature_dtype)})


def _wire_request(arrays: list[tuple[str, np.ndarray, str | None]], actor_id: str,
                  seq: int, numbers: dict[str, int] = TRAIN_FIELDS) -> bytes:
    """The serialised TrainRequest (InsertStreamRequest with ``numbers`` = INSERT_FIELDS) of checked
    ``arrays`` with key (actor_id, seq).

    Built in protobuf's wire format directly: each array's buffer is copied once,
    into the joined bytes, where ``encode_batch(...).SerializeToString()`` copies
    it three times (tobytes, into the message, out of it).  It parses to the same
    message.
    """
    parts: list = []
    for name, array, wire in arrays:
        parts += tensor_wire(numbers[name], array, name, wire=wire)
    actor = actor_id.encode()
    key = (b"\x0a" + varint(len(actor)) + actor if actor else b"") + (
        b"\x10" + varint(seq) if seq else b"")
    if key:
        parts.append(varint(KEY_FIELD << 3 | 2) + varint(len(key)) + key)
    return b"".join(parts)


def encode_batch_wire(batch: Batch, *, feature_dtype: str = "float32", actor_id: str = "",
                      seq: int = 0) -> bytes:
    """``encode_batch`` with key (actor_id, seq), serialised with one copy of the data."""
    return _wire_request(_batch_arrays(batch, feature_dtype), actor_id, seq)


def _train_result(response: pb.TrainResponse) -> TrainResult:
    return TrainResult(
        loss=response.loss, td_errors=decode(response.td_errors, "td_errors"),
        priorities=decode(response.priorities, "priorities"),
        q_taken_mean=response.q_taken_mean, grad_norm=response.grad_norm, step=response.step,
        version=response.version,
        entropy=response.entropy if response.HasField("entropy") else None,
        seq=response.key.seq, replayed=response.replayed)


def _slot_ref(slot: str | int) -> pb.SlotRef:
    if isinstance(slot, str):
        return pb.SlotRef(name=slot)
    if isinstance(slot, (int, np.integer)) and not isinstance(slot, bool) and slot >= 0:
        return pb.SlotRef(index=int(slot))
    raise _bad("slot", f"must be a slot name or an index ≥ 0, got {slot!r}")


def tls_credentials(ca: str | Path | None = None, cert: str | Path | None = None,
                    key: str | Path | None = None) -> grpc.ChannelCredentials:
    """TLS channel credentials from PEM files.

    ``ca`` verifies the server's certificate (None: the system's CA roots); ``cert`` and
    ``key`` are a client certificate chain and its private key, for a server that asks
    for one (mutual TLS, ``duelq serve --tls-client-ca``).
    """
    if (cert is None) != (key is None):
        raise _bad("cert" if cert is None else "key", "a client certificate needs both "
                                                      "cert and key")

    def read(name: str, path) -> bytes | None:
        if path is None:
            return None
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise _bad(name, f"cannot read {path}: {exc.strerror}") from None
    return grpc.ssl_channel_credentials(root_certificates=read("ca", ca),
                                        private_key=read("key", key),
                                        certificate_chain=read("cert", cert))


def _credentials(tls) -> grpc.ChannelCredentials | None:
    if tls is None or tls is False:
        return None
    if tls is True:
        return tls_credentials()
    if isinstance(tls, (str, Path)):
        return tls_credentials(tls)
    if isinstance(tls, grpc.ChannelCredentials):
        return tls
    raise _bad("tls", "must be None, True, a CA bundle path or grpc.ChannelCredentials "
                      "(tls_credentials)")


class LearnerClient:
    """A connection to one duelq learner.

    ``target`` is host:port.  ``token`` is sent as ``authorization: Bearer``
    metadata.  ``tls``: None for plaintext, True for TLS with the system's CA
    roots, a path to a PEM CA bundle, or ready ``grpc.ChannelCredentials``
    (:func:`tls_credentials` makes them, a client certificate for mutual TLS included).
    ``timeout`` bounds each unary call in seconds.  On UNAVAILABLE a call is retried up
    to ``retries`` times, sleeping
    ``backoff`` × 2^attempt seconds (jittered, at most ``max_backoff``).
    ``actor_id`` names this client in idempotency keys (default
    host-pid-random).  ``feature_dtype`` is the wire dtype of h_t and h_tp1
    (float32, float16 or bfloat16; the server widens to float32).
    ``channel_options`` are extra gRPC channel arguments, e.g. HTTP/2 window sizes.
    """

    def __init__(self, target: str, *, token: str | None = None, tls=None,
                 timeout: float = 30.0, retries: int = 4, backoff: float = 0.1,
                 max_backoff: float = 2.0, actor_id: str | None = None,
                 feature_dtype: str = "float32", max_message_bytes: int = 64 << 20,
                 channel_options: Sequence[tuple[str, int | str]] = ()):
        feature_dtype = _feature_dtype(feature_dtype)
        if retries < 0 or backoff < 0 or timeout <= 0:
            raise _bad("retries", "retries and backoff must be ≥ 0, timeout > 0")
        self.target = target
        self.timeout = timeout
        self.retries, self.backoff, self.max_backoff = retries, backoff, max_backoff
        self.actor_id = actor_id or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self.feature_dtype = feature_dtype
        self._seq = itertools.count(1)
        self._issued = 0  # highest seq handed out
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        options = [("grpc.max_receive_message_length", max_message_bytes),
                   ("grpc.max_send_message_length", max_message_bytes), *channel_options]
        # Redial at the pace of our own retries rather than grpc's default (1 s growing
        # to 120 s), so that a restarted server is found within about ``max_backoff``.
        options = [("grpc.initial_reconnect_backoff_ms", max(int(backoff * 1000), 10)),
                   ("grpc.max_reconnect_backoff_ms", max(int(max_backoff * 1000), 10)),
                   *options]
        credentials = _credentials(tls)
        self._channel = (grpc.secure_channel(target, credentials, options) if credentials
                         else grpc.insecure_channel(target, options))
        self._closed = False
        self._stub = pb_grpc.LearnerStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        # Train requests go out already serialised (see _wire_request): no serializer.
        service = pb.DESCRIPTOR.services_by_name["Learner"].full_name
        self._train_step = self._channel.unary_unary(
            f"/{service}/TrainStep", request_serializer=None,
            response_deserializer=pb.TrainResponse.FromString)
        self._train_stream = self._channel.stream_stream(
            f"/{service}/TrainStream", request_serializer=None,
            response_deserializer=pb.TrainResponse.FromString)
        self._insert_stream = self._channel.stream_stream(
            f"/{service}/InsertStream", request_serializer=None,
            response_deserializer=pb.InsertStreamResponse.FromString)

    # -- plumbing -------------------------------------------------------------------------

    def close(self) -> None:
        self._closed = True   # a stream it cancels is not resumed
        self._channel.close()

    def __enter__(self) -> "LearnerClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _key(self) -> pb.RequestKey:
        seq = next(self._seq)
        self._issued = max(self._issued, seq)
        return pb.RequestKey(actor_id=self.actor_id, seq=seq)

    def _sleep(self, attempt: int) -> None:
        delay = min(self.max_backoff, self.backoff * 2 ** attempt)
        time.sleep(delay * random.uniform(0.5, 1.0))

    def _error(self, error: grpc.RpcError, attempts: int) -> errors.DuelqError:
        translated = errors.from_rpc_error(error)
        if isinstance(translated, errors.Unavailable):
            return errors.Unavailable(f"duelq learner at {self.target} unavailable after "
                                      f"{attempts} attempt(s): {translated.details}")
        return translated

    def _call(self, method: Callable, request):
        """A unary call with retries on UNAVAILABLE; errors translated."""
        attempts = 0
        while True:
            try:
                return method(request, timeout=self.timeout, metadata=self._metadata)
            except grpc.RpcError as error:
                attempts += 1
                if error.code() != grpc.StatusCode.UNAVAILABLE or attempts > self.retries:
                    raise self._error(error, attempts) from None
            self._sleep(attempts - 1)

    # -- rpcs -----------------------------------------------------------------------------

    def train_step(self, batch: Batch, *, seq: int | None = None) -> TrainResult:
        """Apply one batch as one learner step.

        A server error carries the request's ``seq``.  To resend a batch whose
        call failed without an answer (DeadlineExceeded, Unavailable after the
        retries), pass that ``seq``: the server applies the batch at most once
        and answers ``replayed`` if it already had.  Leave ``seq`` None for new
        batches.
        """
        if seq is not None and not (isinstance(seq, int) and 1 <= seq <= self._issued):
            raise _bad("seq", f"must be a sequence number this client has used "
                              f"(1..{self._issued}), got {seq!r}")
        arrays = _batch_arrays(batch, self.feature_dtype)
        seq = self._key().seq if seq is None else seq
        try:
            return _train_result(self._call(self._train_step,
                                            _wire_request(arrays, self.actor_id, seq)))
        except errors.DuelqError as exc:
            exc.seq = seq
            raise

    def train_stream(self, batches: Iterable[Batch], *, window: int = 8) -> Iterator[TrainResult]:
        """Stream batches; yield their results in order, at most ``window`` unanswered.

        Batches are pulled from ``batches`` lazily as the window frees up.  If
        the stream breaks with UNAVAILABLE (or the server cancels it, its answers unread
        for its receive timeout), a new one resends the unanswered requests with their
        keys (already applied ones come back ``replayed``).
        A batch failing the local checks, or a server error, is raised where
        that batch's result would have been yielded; later batches are not sent.
        """
        for response in self._keyed_stream(
                self._train_stream, batches, window, "TrainStream",
                lambda batch: _batch_arrays(batch, self.feature_dtype), TRAIN_FIELDS):
            yield _train_result(response)

    def insert_stream(self, transitions: Iterable[Transitions], *,
                      window: int = 8) -> Iterator[InsertResult]:
        """Insert transitions into the server's replay buffer: yield each insert's
        acknowledgement in order, at most ``window`` unanswered.  As :meth:`train_stream`:
        lazy, resent with the same keys after UNAVAILABLE (each insert is stored once),
        a local or server error raised in its insert's place.  Features go in
        ``feature_dtype`` (a 16-bit buffer takes its own dtype only)."""
        for response in self._keyed_stream(
                self._insert_stream, transitions, window, "InsertStream",
                lambda rows: _transition_arrays(rows, self.feature_dtype), INSERT_FIELDS):
            yield InsertResult(response.rows, response.size, response.inserted,
                               response.version, response.step, response.key.seq,
                               response.replayed)

    def insert(self, transitions: Transitions) -> InsertResult:
        """Insert one set of transitions (a one-request InsertStream)."""
        return next(iter(self.insert_stream([transitions], window=1)))

    def _keyed_stream(self, method: Callable, items: Iterable, window: int, name: str,
                      check: Callable, numbers: dict[str, int]) -> Iterator:
        """The responses of a keyed request stream ``method`` fed with ``items`` (each checked
        into arrays by ``check``, then numbered), in order, at most ``window`` unanswered;
        after UNAVAILABLE, or CANCELLED (the server ends a stream whose answer went unread
        for its receive timeout), a new stream resends the unanswered requests with their
        keys."""
        if window < 1:
            raise _bad("window", f"must be ≥ 1, got {window}")
        source = iter(items)
        pending: deque[tuple[int, bytes]] = deque()  # (seq, request) sent, not answered
        local_error: errors.DuelqError | None = None
        failures = 0
        while True:
            feed: queue.SimpleQueue = queue.SimpleQueue()
            call = method(iter(feed.get, None), metadata=self._metadata)
            try:
                for _, request in pending:
                    feed.put(request)
                while True:
                    while local_error is None and len(pending) < window:
                        item = next(source, None)
                        if item is None:
                            break
                        try:
                            arrays = check(item)
                        except errors.InvalidArgument as exc:
                            local_error = exc
                            break
                        seq = self._key().seq
                        request = _wire_request(arrays, self.actor_id, seq, numbers)
                        pending.append((seq, request))
                        feed.put(request)
                    if not pending:
                        feed.put(None)  # half-close; the server ends the stream
                        for _ in call:
                            raise errors.ServerError(f"{name}: a response without a request")
                        if local_error is not None:
                            raise local_error
                        return
                    response = next(call, None)
                    if response is None:
                        raise errors.ServerError(f"{name} ended with requests unanswered")
                    seq, _ = pending.popleft()
                    if response.key.seq != seq:
                        raise errors.ServerError(f"{name} answered seq {response.key.seq} "
                                                 f"for seq {seq}")
                    failures = 0
                    yield response
            except grpc.RpcError as error:
                if (error.code() not in STREAM_RETRIED or failures == self.retries
                        or self._closed):
                    raise self._error(error, failures + 1) from None
            finally:
                feed.put(None)
                call.cancel()
            self._sleep(failures)
            failures += 1

    def train_replay(self, steps: int = 1) -> ReplayTrainResult:
        """Run ``steps`` learner steps drawn from the server's replay buffer (applied once
        per key, retried on UNAVAILABLE)."""
        response = self._call(self._stub.TrainReplay,
                              pb.TrainReplayRequest(steps=steps, key=self._key()))
        return ReplayTrainResult(response.steps, response.refused, response.loss,
                                 response.q_taken_mean, response.grad_norm, response.step,
                                 response.version, response.replayed)

    def replay_info(self) -> ReplayInfo:
        """The server's replay buffer figures."""
        r = self._call(self._stub.GetReplayInfo, pb.GetReplayInfoRequest())
        return ReplayInfo(**{f.name: getattr(r, f.name) for f in dataclasses.fields(ReplayInfo)})

    def compute_entropy(self, actions: np.ndarray, slot: str | int,
                        alpha: float) -> EntropyResult:
        """Fold the entropy of ``actions`` [M] into ISV ``slot`` as an EMA with rate α."""
        if not isinstance(actions, np.ndarray) or actions.ndim != 1:
            raise _bad("actions", "must be a 1-D numpy array")
        actions = _vector("actions", actions, actions.shape[0])
        request = pb.ComputeEntropyRequest(actions=encode(actions, "actions"),
                                           slot=_slot_ref(slot), alpha=float(alpha),
                                           key=self._key())
        response = self._call(self._stub.ComputeEntropy, request)
        return EntropyResult(response.entropy, response.ema, response.slot, response.replayed)

    def act(self, h: np.ndarray, *, target: bool = False) -> ActResult:
        """Q-values [B, N] and greedy actions [B] for feature rows ``h`` [B, H]."""
        request = pb.ActRequest(h=_features("h", h, self.feature_dtype), target=target)
        response = self._call(self._stub.Act, request)
        return ActResult(decode(response.q_values, "q_values"),
                         decode(response.actions, "actions"), response.version)

    def get_weights(self, target: bool = False) -> Weights:
        """θ (or θ⁻ with ``target=True``), its version and the step count."""
        response = self._call(self._stub.GetWeights, pb.GetWeightsRequest(target=target))
        params = Params(*(decode(getattr(response, name), name) for name in PARAM_NAMES))
        return Weights(params, response.version, response.step, response.target)

    def read_isv(self, names_or_indices: Sequence[str | int] = ()) -> list[ISVValue]:
        """ISV slots by name or index, in the order given (empty: every named slot)."""
        if isinstance(names_or_indices, (str, int)):
            names_or_indices = [names_or_indices]
        request = pb.ReadISVRequest(slots=[_slot_ref(s) for s in names_or_indices])
        response = self._call(self._stub.ReadISV, request)
        return [ISVValue(v.slot, v.name, v.value, v.observed) for v in response.values]

    def save_checkpoint(self) -> tuple[str, int]:
        """Ask the server to write a checkpoint now; (path on the server, step)."""
        response = self._call(self._stub.SaveCheckpoint, pb.SaveCheckpointRequest())
        return response.path, response.step

    def info(self) -> ServerInfo:
        """Backend, device, config, step, version and limits of the server."""
        r = self._call(self._stub.GetInfo, pb.GetInfoRequest())
        return ServerInfo(r.backend, r.device, r.config.hidden_dim, r.config.n_actions,
                          json.loads(r.config_json), r.step, r.version, r.max_message_bytes,
                          r.max_batch_size, r.max_streams, r.server_version, r.max_queue)

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Block until the server's health says SERVING; errors.Unavailable after ``timeout``."""
        deadline = time.monotonic() + timeout
        request = health_pb2.HealthCheckRequest(service=pb.DESCRIPTOR.services_by_name[
            "Learner"].full_name)
        last = "no answer"
        while True:
            left = deadline - time.monotonic()
            try:
                status = self._health.Check(request, timeout=max(left, 0.01),
                                            wait_for_ready=True).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
            except grpc.RpcError as error:
                last = f"{error.code().name}: {error.details()}"
            if time.monotonic() + 0.05 >= deadline:
                raise errors.Unavailable(f"duelq learner at {self.target} not SERVING after "
                                         f"{timeout:g} s (last: {last})")
            time.sleep(0.05)
