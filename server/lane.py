"""The relay's fast lane: the learner process's relay loop in C for the common request.

With ``--front-process`` the learner process's one relay thread (server/relay.py) reads
every front's frames, prepares, steps and answers each train request: ≈ 100 µs of host
work a request with 8 fronts, most of it Python spread thin over the relay, the service,
the learner and the backend (docs/benchmarks.md, rounds 12 to 16).  When that thread has
nothing of its own queued, it hands the loop to server/lane.c (:meth:`Lane.pump`), which
takes the requests every actor sends in steady state: PACKED requests of open streams,
of a batch shape the engine has taken before, with a key new to its actor (or none).  Any
other frame or request, and any step that is not plainly good (an expired deadline, a
non-finite step, a device error), makes the lane stop and hand back, in order, what it
holds: the relay then takes those requests and bytes as if it had read them itself, so
every refusal is still the Python path's, in its words.

The lane holds the service's apply lock and the learner's lock for the length of a pump
(≈ :data:`BUDGET_S`), as one long step; when it returns, its answers are recorded as the
Python path records them: keys and responses in the replay guard, the checkpoint writer
told the step, metrics given each answer's latency.  Keys the Python path applies meanwhile
reach the lane through the replay guard's journal, so the lane only ever takes a key that
the guard would take as new.

Engines: the CUDA backend's, in C (``CudaBackend.lane_enter``), used by the server; or any
backend through Python callbacks (:class:`_PythonEngine`), which has no speed to offer
and lets the CPU tests run the C loop against the reference backend.
"""

from __future__ import annotations

import ctypes
import logging
import struct
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from . import native
from .batch import FEATURE_DTYPES, PackedBatch, validate_batch
from .service import EncodedTrainResponse, LearnerService

log = logging.getLogger(__name__)

#: Seconds a pump runs before it returns (its answers are then recorded, and other threads
#: may take the apply lock): a checkpoint or a small rpc waits at most this long for it.
BUDGET_S = 0.005
#: Requests the lane may hold, streams and actors it tracks before it starts afresh.
ITEMS, STREAMS, ACTORS = 4096, 4096, 8192
EXIT_DRAINED, EXIT_HANDOVER, EXIT_WOKEN = 0, 1, 2
RECORD = struct.Struct("<BBHIQQdddII")   # server/lane.c's struct record
HANDED = struct.Struct("<IIiIdd")        # and struct handed
_ANSWER, _ENDED = 1, 2
UPLOADS = 3   # the Python engine's upload slots (it copies nothing)


class LaneBatch(ctypes.Structure):
    """Mirror of ``struct lane_batch`` in server/lane.c."""

    _fields_ = [(name, ctypes.c_uint) for name in ("rows", "hidden", "kind", "weights")] + [
        ("words", ctypes.c_size_t), ("shape", ctypes.c_int)]


class LaneOutcome(ctypes.Structure):
    """Mirror of ``struct lane_outcome`` in server/lane.c."""

    _fields_ = [(name, ctypes.c_double) for name in ("loss", "q_mean", "grad_norm",
                                                     "entropy")] + [
        (name, ctypes.c_int) for name in ("has_entropy", "finite", "valid")] + [
        ("td", ctypes.c_void_p), ("priorities", ctypes.c_void_p)]


_SHAPE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(LaneBatch))
_COPY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                         ctypes.c_size_t)
_STEP = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                         ctypes.POINTER(LaneBatch), ctypes.POINTER(LaneOutcome))
_COMMIT = ctypes.CFUNCTYPE(ctypes.c_uint64, ctypes.c_void_p)
_RELEASE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int, ctypes.c_int)


class _Engine(ctypes.Structure):
    """Mirror of ``struct lane_engine`` in server/lane.c."""

    _fields_ = [("ctx", ctypes.c_void_p), ("shape", _SHAPE), ("copy", _COPY), ("step", _STEP),
                ("commit", _COMMIT), ("release", _RELEASE), ("uploads", ctypes.c_int)]


class _PythonEngine:
    """The lane's engine over any backend, through Python callbacks: a step is the
    learner's (validate unless the backend checks values, propose; commit on the lane's
    word), on the packed batch where it lies."""

    def __init__(self, learner):
        self._learner, self._backend = learner, learner.backend
        self._outputs: tuple = ()   # the last step's td errors and priorities, kept alive
        self.struct = _Engine(None, _SHAPE(self._shape), _COPY(lambda *a: 0),
                              _STEP(self._step), _COMMIT(self._commit),
                              _RELEASE(lambda *a: None), UPLOADS)

    def _shape(self, ctx, batch) -> int:
        b, backend = batch.contents, self._backend
        dtype = FEATURE_DTYPES[b.kind]
        takes = (b.hidden == self._learner.config.hidden_dim
                 and b.rows <= self._learner.max_batch_size
                 and (b.kind == 0 or dtype in backend.feature_dtypes))
        return 0 if takes else -1

    def _step(self, ctx, upload, src, batch, outcome) -> int:
        try:
            b, backend, learner = batch.contents, self._backend, self._learner
            data = (ctypes.c_ubyte * (4 * b.words)).from_address(src)
            packed = PackedBatch(b.rows, b.hidden, FEATURE_DTYPES[b.kind], bool(b.weights),
                                 b.words, memoryview(data).cast("B"), src)
            if not backend.takes_packed:
                packed = validate_batch(packed.batch(), learner.config, learner.max_batch_size,
                                        check_values=not backend.checks_values,
                                        keep=backend.feature_dtypes)
            out = backend.propose(packed)
            o = outcome.contents
            o.finite, o.valid = out.finite, out.inputs_valid
            if not (out.finite and out.inputs_valid):
                backend.discard()   # the relay steps it again and words the refusal
                return 0
            td = np.ascontiguousarray(out.td_errors, np.float32)
            priorities = np.ascontiguousarray(out.priorities, np.float32)
            self._outputs = (td, priorities)
            o.loss, o.q_mean, o.grad_norm = out.loss, out.q_taken_mean, out.grad_norm
            o.has_entropy = out.entropy is not None
            o.entropy = out.entropy if out.entropy is not None else 0.0
            o.td, o.priorities = td.ctypes.data, priorities.ctypes.data
            return 0
        except Exception:  # noqa: BLE001 — handed back: the relay meets it and words it
            log.debug("the lane's Python engine handed a step back", exc_info=True)
            return 1

    def _commit(self, ctx) -> int:
        self._backend.commit()
        return self._backend.step


@dataclass
class Handover:
    """What a pump leaves for the relay: requests answered per front, streams ENDed, and
    after a handover, the requests given back, every front's bytes not yet framed and the
    front whose connection closed, if one did."""

    answered: dict[int, int] = field(default_factory=dict)      # front → requests
    ended: list[tuple[int, int]] = field(default_factory=list)  # (front, stream), in order
    #: (front, stream, slot, deadline, arrived, payload) of each request given back, in order
    requests: list[tuple[int, int, int, float, float, bytes]] = field(default_factory=list)
    unread: dict[int, bytes] = field(default_factory=dict)      # front → bytes
    closed: int | None = None   # a front whose connection closed, after its unread bytes
    stopped_at: int | None = None   # the front whose first unread frame is why it handed back
    ran: bool = True   # False: it could not run, or handed back with no cause to show


def cuda_engine(backend) -> bool:
    """Whether ``backend`` has the lane's C engine (CUDA with its host calls in C)."""
    return getattr(backend, "host_path", None) == "native"


#: Told of each answer the lane gave: (the response, its request's arrival, the answer's
#: time), both ``time.perf_counter()`` clocks (the server's metrics).
Answered = Callable[[EncodedTrainResponse, float, float], None]


class Lane:
    """The relay's fast lane over ``service``'s learner (see the module's doc).  ``engine``:
    "cuda" (the CUDA backend's C engine: :func:`cuda_engine` says whether a backend has it)
    or "python" (any backend, through callbacks)."""

    def __init__(self, service: LearnerService, *, engine: str = "cuda",
                 answered: Answered | None = None, budget_s: float = BUDGET_S):
        if engine not in ("cuda", "python"):
            raise ValueError(f"engine must be cuda or python, got {engine!r}")
        self._service, self._engine_kind, self._answered = service, engine, answered
        self.budget_s = budget_s
        self._c = native.load(cuda=False).lane
        self._lane = self._c.new(ITEMS, STREAMS, ACTORS)
        if not self._lane:
            raise MemoryError("the relay's fast lane could not allocate its tables")
        self._learner = None          # the learner the engine was set up for
        self._engine = None           # LaneEngine (cuda) or _PythonEngine
        self._guard = None            # the replay guard whose keys the lane knows
        self._fronts: dict[int, tuple] = {}   # front → what the lane was told of it
        self._miss: tuple | None = None   # (rows, hidden, kind) the engine last did not take
        self._size = ctypes.c_size_t()
        self.pumps = self.handovers = self.answers = 0   # for tests and benchmarks

    def close(self) -> None:
        if self._lane:
            self._c.free(self._lane)
            self._lane = None

    def open(self, front: int, sid: int) -> bool:
        """Stream ``sid`` of ``front`` is open and may go by the lane; False when its table
        is full (the stream's requests then go by the relay)."""
        return self._c.stream(self._lane, front, sid, 1) == 0

    def forget(self, front: int, sid: int) -> None:
        """Stream ``sid`` of ``front`` is the relay's alone (ended, failed, finished)."""
        self._c.stream(self._lane, front, sid, 0)

    def pump(self, fronts: list[tuple[int, int, object]], unread: dict[int, bytes],
             poll_fd: int, wake_fd: int) -> Handover:
        """Run the lane for up to :attr:`budget_s` over ``fronts`` ((index, socket fd, slot
        pool) of each front the relay reads), framing first the bytes the relay read and
        did not frame (``unread``, by front), waiting on the relay's epoll ``poll_fd`` and
        its wake socket.  When it cannot run (no learner yet, draining, an upload slot in
        use), it gives back those bytes and the ones it kept, and says it did not run."""
        with self._service.lane_turn() as turn:
            if turn is None:
                return self._idle(fronts, unread)
            learner, guard, checkpoints = turn
            backend = learner.backend
            self._ready(learner, guard)
            cuda = self._engine_kind == "cuda"
            if cuda and not backend.lane_enter(self._engine):
                return self._idle(fronts, unread)
            try:
                self._set_fronts(fronts)
                for index, data in unread.items():
                    if self._c.feed(self._lane, index, data, len(data)):
                        raise MemoryError("the relay's fast lane could not take a front's bytes")
                if cuda and self._miss is not None:
                    self._take_shape(learner, *self._miss)
                self._miss = None
                why = self._c.pump(self._lane, poll_fd, wake_fd, self.budget_s)
            finally:
                if cuda:
                    backend.lane_exit(self._engine)
            try:
                return self._settle(why, fronts, guard, checkpoints)
            finally:
                self._c.settle(self._lane, why == EXIT_HANDOVER)

    def _idle(self, fronts, unread: dict[int, bytes]) -> Handover:
        """The lane did not run: the bytes it kept from its last pump, then ``unread``, go
        back to the relay."""
        out = Handover(ran=False)
        self._take_unread(fronts, out)
        self._c.settle(self._lane, 1)
        for index, data in unread.items():
            out.unread[index] = out.unread.get(index, b"") + data
        return out

    def _take_shape(self, learner, rows: int, hidden: int, kind: int) -> None:
        """Let the engine take batches of a shape it handed back, if the learner takes them
        (growing the backend's buffers for it: a failure there leaves the shape to the
        relay)."""
        if hidden != learner.config.hidden_dim or rows > learner.max_batch_size:
            return
        try:
            learner.backend.lane_shape(self._engine, rows, kind)
        except Exception:  # noqa: BLE001 — e.g. out of device memory: the relay steps those
            log.exception("the relay's fast lane cannot take batches of %d rows", rows)

    def _take_unread(self, fronts, out: Handover) -> None:
        for index, _, _ in fronts:
            address = self._c.unread(self._lane, index, ctypes.byref(self._size))
            if self._size.value:
                out.unread[index] = ctypes.string_at(address, self._size.value)

    def _ready(self, learner, guard) -> None:
        """Set the engine up for ``learner`` (once) and tell the lane the actors whose keys
        were applied elsewhere since the last pump."""
        if learner is not self._learner:
            if self._engine_kind == "python":
                engine = _PythonEngine(learner)
                self._c.set_engine(self._lane, ctypes.addressof(engine.struct))
            else:
                engine = learner.backend.lane_engine()
                self._c.use_cuda(self._lane, ctypes.addressof(engine),
                                 learner.backend.lane_uploads)
            self._learner, self._engine = learner, engine
        if guard is not self._guard:   # a new guard (a resumed checkpoint's): start afresh
            self._c.forget_actors(self._lane)
            if self._guard is not None:
                self._guard.journal = None
            self._guard, guard.journal = guard, set()
        for actor in guard.journal:
            encoded = actor.encode()
            self._c.actor(self._lane, encoded, len(encoded), guard.high(actor))
        guard.journal.clear()

    def _set_fronts(self, fronts: list[tuple[int, int, object]]) -> None:
        seen = set()
        for index, fd, slots in fronts:
            told = (fd, slots.address(0), slots.size, slots.count)
            seen.add(index)
            if self._fronts.get(index) != told:
                self._fronts[index] = told
                self._c.front(self._lane, index, *told)
        for index in [i for i in self._fronts if i not in seen]:   # no longer read
            del self._fronts[index]
            self._c.front(self._lane, index, -1, None, 0, 0)

    def _settle(self, why: int, fronts, guard, checkpoints) -> Handover:
        """Record the pump's answers (keys, checkpoints, metrics) and gather the rest."""
        if why < 0:
            raise RuntimeError(f"the relay's fast lane failed ({why})")
        self.pumps += 1
        out = Handover()
        log_address = self._c.log(self._lane, ctypes.byref(self._size))
        data = ctypes.string_at(log_address, self._size.value) if self._size.value else b""
        at, step, answered = 0, None, self._answered
        while at < len(data):
            (kind, keyed, actor_len, front, seq, step_now, loss, arrived, when, rows,
             size) = RECORD.unpack_from(data, at)
            at += RECORD.size
            if kind == _ENDED:
                out.ended.append((front, seq))
                continue
            actor = data[at:at + actor_len].decode()
            response = EncodedTrainResponse(data[at + actor_len:at + actor_len + size],
                                            step_now, loss, rows)
            at += actor_len + size
            step = step_now
            if keyed:
                guard.record(actor, seq, response)
            self.answers += 1
            if answered is not None:
                answered(response, arrived, when)
        guard.journal.clear()   # the lane knows the keys it applied
        if step is not None and checkpoints is not None:
            checkpoints.notify(step)
        for index, _, _ in fronts:
            n = self._c.answered(self._lane, index)
            if n:
                out.answered[index] = n
        miss = (ctypes.c_uint * 4)()
        self._miss = tuple(miss[:3]) if self._c.miss(self._lane, miss) else None
        if why == EXIT_HANDOVER:
            self.handovers += 1
            closed, stopped = self._c.closed(self._lane), self._c.stopped_at(self._lane)
            out.closed = closed if closed >= 0 else None
            out.stopped_at = stopped if stopped >= 0 else None
            address = self._c.handed(self._lane, ctypes.byref(self._size))
            handed = ctypes.string_at(address, self._size.value) if self._size.value else b""
            at = 0
            while at < len(handed):
                front, sid, slot, size, deadline, arrived = HANDED.unpack_from(handed, at)
                at += HANDED.size
                out.requests.append((front, sid, slot, deadline, arrived,
                                     handed[at:at + size]))
                at += size
            self._take_unread(fronts, out)
            # No request, frame or close to show for it (an fd it did not know, memory):
            # the relay reads for itself this once, as when the lane does not run.
            out.ran = bool(out.requests) or out.closed is not None or out.stopped_at is not None
        return out
