"""The hand-over of rpcs from the front processes to the learner process.

With ``--front-processes`` the gRPC server runs in front processes and the learner in
another, so gRPC's per-message Python work and the learner's (checks, copy, launch,
encode) no longer share one GIL.  Request bytes travel through a pool of shared-memory
buffers (a memfd, so Docker's 64 MiB /dev/shm is no limit); a Unix socket pair per front
carries fixed-size frames:

    front → learner   OPEN  stream, method (an index into STREAMED)
                      PACKED  stream, buffer, size, deadline, then the descriptor (size
                            bytes): the buffer holds the request's arrays, packed by the
                            front (server/fronts/packing.py)
                      REQ   stream, buffer (INLINE − buffer: the bytes follow the frame),
                            size, deadline: a request as it came, which the learner parses
                      END   stream: the rpc is over; requests not started are not applied
                      REFUSED  size, then "method code count" (UTF-8): rpcs the front
                            itself refused (token, limits) since its last REFUSED, for the
                            learner's metrics
                      CALL  call id, method, size, deadline, then the request's bytes: a
                            small rpc (Act, GetWeights …), relayed whole
    learner → front   REPLY stream (or call id), buffer (NO_BUFFER for a CALL), status code,
                      size, then the payload (the response's bytes, or the error details
                      as UTF-8)

PACKED is the usual train or insert request.  REQ stays for the requests a front cannot
pack, which the learner process must see as they came: those it will refuse (so the one
service code words the refusal, in its order of checks: drain and key before the arrays),
those in a wire form that needs converting (non-canonical framing, uint8 actions, bool
dones, float16 rewards …: the learner's own decode does that, not a second copy of it in
the front), and those larger than a buffer (sent inline: buffers are sized for the common
batch, max_message_bytes / 8, since each front has 2 · max_queue / fronts of them).

Every request gets exactly one REPLY, in order within its stream; the front gives a
buffer back only on its REPLY, so the learner reads the bytes in place.  Every CALL gets
one REPLY too, between two steps (not behind the train requests queued before it).  Each
front has its own socket and buffer pool, and stream ids are each front's own.  The
learner takes requests in arrival order on one thread, which reads every front's frames,
checks each request and starts its copy to the device before it steps the one before
(:class:`RelayLearner`).

A front counts, per stream, the requests at the learner: a stream with any there holds
one of the server's ``max_queue`` places (shared by the fronts), as a call waiting for the
learner does in one process.
"""

from __future__ import annotations

import logging
import mmap
import os
import queue
import select
import socket
import struct
import threading
import time
from collections import Counter, deque
from typing import Callable, Protocol

import grpc
import numpy as np

from duelq.server.core.batch import PackedBatch
from duelq.server.fronts.packing import read_packed
from duelq.server.gate import Tally

log = logging.getLogger(__name__)

OPEN, REQ, END, REFUSED, PACKED, CALL = 1, 2, 3, 4, 5, 6
#: The rpcs whose requests go through the relay as a stream's (OPEN names one by index).
#: Only train requests count in the train metrics (queue depth, open TrainStreams, each
#: front's relayed requests), as with one process.
STREAMED = ("TrainStream", "TrainStep", "InsertStream")
TRAIN = ("TrainStream", "TrainStep")
_FRAME = struct.Struct("<BxxxIiId")     # op, stream, buffer, size, deadline (0: none)
_REPLY = struct.Struct("<IiII")         # stream, buffer, status code value, size
_CODES = {code.value[0]: code for code in grpc.StatusCode}
INLINE = -1
NO_BUFFER = -(1 << 31)   # a CALL's REPLY: no buffer to give back
_GONE = b"the learner process went away; retry (a keyed request with the same key)"
_STOPPING = b"the learner process is stopping; retry with the same key"
MAX_STREAM_ID = (1 << 32) - 1


class RelayClosed(Exception):
    """The other process went away."""


class BufferPool:
    """``count`` buffers of ``size`` bytes in one shared mapping (a memfd)."""

    def __init__(self, count: int, size: int, fd: int | None = None):
        self.count, self.size = count, size
        if fd is None:
            fd = os.memfd_create("duelq-relay", os.MFD_CLOEXEC)
            os.ftruncate(fd, count * size)
        self.fd = fd
        self._map = mmap.mmap(fd, count * size)
        self.bytes = np.frombuffer(self._map, np.uint8)   # [count * size]
        self._base = self.bytes.ctypes.data
        self.view = memoryview(self._map)

    def buffer(self, index: int, n: int) -> memoryview:
        """The first ``n`` bytes of buffer ``index``."""
        return self.view[index * self.size: index * self.size + n]

    def array(self, index: int) -> np.ndarray:
        """Buffer ``index``'s bytes, uint8."""
        return self.bytes[index * self.size:(index + 1) * self.size]

    def address(self, index: int) -> int:
        """Host address of buffer ``index``'s first byte."""
        return self._base + index * self.size

    def write(self, index: int, data: bytes) -> None:
        if not 0 <= index < self.count or len(data) > self.size:
            raise ValueError(f"{len(data)} bytes into buffer {index}: the pool has "
                             f"{self.count} buffers of {self.size} bytes")
        start = index * self.size
        # Holding the GIL, as the Packer copies (server/fronts/packing.py): a copy that let
        # it go would wait for the front's busy threads to give it back.
        self.view[start:start + len(data)] = data

    def close(self) -> None:
        self.view.release()
        self.bytes = None
        try:
            self._map.close()
        except BufferError:   # a request still holds a view: the mapping goes with the process
            pass
        os.close(self.fd)


def _send_whole(sock: socket.socket, frame: bytes, payload: bytes) -> None:
    """``frame`` then ``payload`` in one system call where the socket takes them whole (the
    reader then gets them together), the rest (after a signal, say) after it."""
    sent = sock.sendmsg((frame, payload)) if payload else 0
    if sent < len(frame):
        sock.sendall(frame[sent:])
        sent = len(frame)
    if sent - len(frame) < len(payload):
        sock.sendall(memoryview(payload)[sent - len(frame):])


def _recv_exact(rfile, n: int) -> bytes:
    data = rfile.read(n)
    if len(data) != n:
        raise RelayClosed("the relay socket closed")
    return data


# ── front side ───────────────────────────────────────────────────────────────────────

#: What a :class:`FrontStream` puts in its inbox: ``(REPLY, (code, payload))`` for each
#: request (UNAVAILABLE for all left once the learner process is gone), and
#: ``(CLOSED, None)`` once the stream is closed (the rpc is over).
REPLY, CLOSED = "reply", "closed"
#: Why :meth:`FrontStream.submit` did not send a request.
QUEUE_FULL, STREAM_CLOSED, LEARNER_GONE = "queue full", "stream closed", "learner gone"


class FrontStream:
    """One rpc's requests towards the learner; their replies arrive in :attr:`inbox`, in
    order (the handler may put its own items there too, gate.StreamReader's)."""

    def __init__(self, relay: "RelayFront", sid: int, deadline: float | None,
                 queue_places: Tally | None):
        self._relay, self.sid = relay, sid
        self._deadline = deadline or 0.0
        self._queue = queue_places   # None: not counted
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._at_learner = 0             # requests sent, not answered
        self._lock = threading.Lock()    # guards _at_learner
        self._order = threading.Lock()   # no request frame after this stream's END
        self.closed = False

    def submit(self, data: bytes) -> str | None:
        """Send one request towards the learner; None, or why it was not sent:
        QUEUE_FULL (no request of this stream is at the learner and ``max_queue`` other
        calls' are), STREAM_CLOSED or LEARNER_GONE.  Waits while every buffer is in use."""
        with self._lock:
            if self.closed:
                return STREAM_CLOSED
            if self._at_learner == 0 and self._queue is not None and not self._queue.take():
                return QUEUE_FULL
            self._at_learner += 1
        buffer = self._relay.take_buffer(self)
        if buffer is None:
            self._answered()
            return STREAM_CLOSED if self.closed else LEARNER_GONE
        with self._order:
            if self.closed:
                self._relay.give_back(buffer)
                self._answered()
                return STREAM_CLOSED
            try:
                self._relay.send_request(self.sid, buffer, data, self._deadline)
            except RelayClosed:
                self._answered()
                return LEARNER_GONE
        return None

    def _answered(self) -> None:
        """One request less at the learner: the stream's queue place goes back with its
        last."""
        with self._lock:
            if self._at_learner == 0:   # closed meanwhile: the place is back already
                return
            self._at_learner -= 1
            if self._at_learner == 0 and self._queue is not None:
                self._queue.give_back()

    def deliver(self, code: grpc.StatusCode, payload: bytes) -> None:
        """A reply came (the relay's reader thread)."""
        self._answered()
        self.inbox.put((REPLY, (code, payload)))

    def lost(self) -> None:
        """The learner process went away: its requests will never be answered."""
        self._release_queue()
        self.inbox.put((REPLY, (grpc.StatusCode.UNAVAILABLE, _GONE)))

    def _release_queue(self) -> None:
        with self._lock:
            if self._at_learner and self._queue is not None:
                self._queue.give_back()
            self._at_learner = 0

    def close(self) -> None:
        """End the stream (idempotent; also the rpc's termination callback): requests not
        yet started are not applied, and the stream's queue place goes back at once."""
        with self._order:
            if self.closed:
                return
            self.closed = True
        self._release_queue()
        self.inbox.put((CLOSED, None))
        self._relay.end(self)


#: Writes a request's arrays into a buffer (uint8, at the given host address) in the packed
#: layout and returns the descriptor to send, or None (or a raise) to send the request as it
#: came (server/fronts/packing.py's Packer).
Pack = Callable[[bytes, np.ndarray, int], "bytes | None"]


class _Answer:
    """The one reply to a CALL."""

    def __init__(self):
        self._replies: queue.SimpleQueue = queue.SimpleQueue()

    def deliver(self, code: grpc.StatusCode, payload: bytes) -> None:
        self._replies.put((code, payload))

    def lost(self) -> None:
        self.deliver(grpc.StatusCode.UNAVAILABLE, _GONE)

    def get(self, timeout: float | None) -> tuple[grpc.StatusCode, bytes] | None:
        """The reply; None if none came within ``timeout`` seconds (None: no limit)."""
        try:
            return self._replies.get(timeout=None if timeout is None else max(timeout, 0.0))
        except queue.Empty:
            return None


class RelayFront:
    """A front process's end: submits requests (packed by ``pack`` where it can) and
    routes the learner's replies."""

    def __init__(self, sock: socket.socket, buffers: BufferPool, pack: Pack | None = None):
        self._sock, self.buffers, self._pack = sock, buffers, pack
        self._pack_failed = False
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(buffers.count):
            self._free.put(i)
        self._send_lock = threading.Lock()
        self._streams: dict[int, FrontStream | _Answer] = {}   # by stream or call id
        self._last_id = 0              # stream ids: 1 … 2**32 − 1 (a frame's 32 bits), again
        self._ids_lock = threading.Lock()
        self.alive = True
        self.closed = threading.Event()   # set with alive = False, once every stream is told
        self.on_close: Callable[[], None] = lambda: None
        self._refused: Counter[tuple[str, str]] = Counter()   # not yet told the learner
        self._refused_lock, self._refusals_pending = threading.Lock(), threading.Event()
        self._reader = threading.Thread(target=self._read_replies, name="duelq-relay-front",
                                        daemon=True)
        self._reader.start()
        threading.Thread(target=self._tell_refusals, name="duelq-relay-refusals",
                         daemon=True).start()

    def open(self, *, method: str, deadline: float | None,
             queue_places: Tally | None = None) -> FrontStream:
        """A new stream of ``method``'s requests (one of :data:`STREAMED`; TrainStep's holds
        its one request); ``queue_places``: the server's ``max_queue`` places, one held while
        any of its requests is at the learner (None: not counted)."""
        with self._ids_lock:
            sid = self._new_id()
            stream = self._streams[sid] = FrontStream(self, sid, deadline, queue_places)
        try:
            self._send(_FRAME.pack(OPEN, sid, STREAMED.index(method), 0, 0.0))
        except RelayClosed:
            self._streams.pop(sid, None)
            raise
        return stream

    def _new_id(self) -> int:
        """The next stream (or call) id: 1 … 2**32 − 1 (a frame's 32 bits), again; under
        ``_ids_lock``."""
        sid = self._last_id % MAX_STREAM_ID + 1
        while sid in self._streams:   # after 2**32 calls: skip the ones still open
            sid = sid % MAX_STREAM_ID + 1
        self._last_id = sid
        return sid

    def call(self, method: int, request: bytes, deadline: float | None,
             on_end: Callable[[Callable[[], None]], object] = lambda cancel: None
             ) -> tuple[grpc.StatusCode, bytes]:
        """Relay a small rpc whole (``method``: its index in the learner's table) and
        wait for its (code, payload), until ``deadline`` at most (then DEADLINE_EXCEEDED);
        UNAVAILABLE once the learner process is gone.  ``on_end`` is given the call's
        cancel (grpc's ``context.add_callback``): run while the call waits, it asks the
        learner not to run it."""
        answer = _Answer()
        with self._ids_lock:
            sid = self._new_id()
            self._streams[sid] = answer
        try:
            if self.alive:   # else the reader, gone, answers no more
                self._send(_FRAME.pack(CALL, sid, method, len(request), deadline or 0.0),
                           request)
                on_end(lambda: self._cancel(sid, answer))
                got = answer.get(None if deadline is None else deadline - time.monotonic())
                if got is not None:
                    return got
                self._cancel(sid, answer)
                return (grpc.StatusCode.DEADLINE_EXCEEDED,
                        b"the deadline passed while the call waited for the learner")
        except RelayClosed:
            pass
        finally:
            self._streams.pop(sid, None)
        return grpc.StatusCode.UNAVAILABLE, _GONE

    def _cancel(self, sid: int, answer: _Answer) -> None:
        """End call ``sid`` on the learner's side (not run if not yet), unless answered."""
        if self._streams.get(sid) is answer and self.alive:
            try:
                self._send(_FRAME.pack(END, sid, 0, 0, 0.0))
            except RelayClosed:
                pass

    def take_buffer(self, stream: FrontStream) -> int | None:
        """A free buffer (waits while all are in use); None if the stream or relay closed."""
        while not stream.closed and self.alive:
            try:
                return self._free.get(timeout=0.1)
            except queue.Empty:
                continue
        return None

    def give_back(self, buffer: int) -> None:
        self._free.put(buffer)

    def send_request(self, sid: int, buffer: int, data: bytes, deadline: float) -> None:
        descriptor = None
        if self._pack is not None:
            try:
                descriptor = self._pack(data, self.buffers.array(buffer),
                                        self.buffers.address(buffer))
            except Exception:  # noqa: BLE001 — a packing fault: the bytes go as they came
                if not self._pack_failed:   # once: it may fail for every request
                    self._pack_failed = True
                    log.exception("packing a request of stream %d failed; it and any "
                                  "other that fails so go unpacked", sid)
        if descriptor is not None:
            self._send(_FRAME.pack(PACKED, sid, buffer, len(descriptor), deadline), descriptor)
        elif len(data) <= self.buffers.size:
            self.buffers.write(buffer, data)
            self._send(_FRAME.pack(REQ, sid, buffer, len(data), deadline))
        else:  # larger than a buffer: inline (the buffer still counts the request in flight)
            self._send(_FRAME.pack(REQ, sid, INLINE - buffer, len(data), deadline), data)

    def report_refusal(self, method: str, code: str) -> None:
        """Count an rpc the front refused (``code``: the status code's name) in the
        learner's metrics.  A thread of its own tells the learner, so that a refusal never
        waits for the learner process to read its socket (dropped once it is gone)."""
        with self._refused_lock:
            self._refused[method, code] += 1
        self._refusals_pending.set()

    def _tell_refusals(self) -> None:
        while True:
            self._refusals_pending.wait()
            self._refusals_pending.clear()
            with self._refused_lock:
                told, self._refused = self._refused, Counter()
            for (method, code), count in told.items():
                payload = f"{method} {code} {count}".encode()
                try:
                    self._send(_FRAME.pack(REFUSED, 0, 0, len(payload), 0.0), payload)
                except RelayClosed:
                    return
            if not self.alive:
                return

    def end(self, stream: FrontStream) -> None:
        self._streams.pop(stream.sid, None)
        if self.alive:
            try:
                self._send(_FRAME.pack(END, stream.sid, 0, 0, 0.0))
            except RelayClosed:
                pass

    def _send(self, frame: bytes, payload: bytes = b"") -> None:
        try:
            with self._send_lock:
                _send_whole(self._sock, frame, payload)
        except OSError as exc:
            raise RelayClosed(f"the learner process went away ({exc})") from None

    def _read_replies(self) -> None:
        rfile = self._sock.makefile("rb", buffering=1 << 16)
        try:
            while True:
                sid, buffer, code, n = _REPLY.unpack(_recv_exact(rfile, _REPLY.size))
                payload = _recv_exact(rfile, n) if n else b""
                if buffer != NO_BUFFER:
                    self._free.put(buffer if buffer >= 0 else INLINE - buffer)
                stream = self._streams.get(sid)
                if stream is not None:
                    stream.deliver(_CODES.get(code, grpc.StatusCode.UNKNOWN), payload)
        except (RelayClosed, OSError, ValueError):
            pass
        finally:
            self.alive = False
            for stream in list(self._streams.values()):
                stream.lost()
            self.closed.set()
            self._refusals_pending.set()   # _tell_refusals ends
            self.on_close()

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._reader.join(5)


# ── learner side ─────────────────────────────────────────────────────────────────────


#: A step that asks whether its call is still active this long after it started has
#: waited (for the apply lock, say): the relay first reads the frames that came meanwhile.
LOOK_AFTER_S = 1e-3


class RelayCall:
    """What the service reads of a grpc context, for a relayed request; used on the relay's
    thread, during the request's step."""

    def __init__(self, deadline: float, stream: "_LearnerStream", arrived: float = 0.0,
                 look: Callable[[], None] = lambda: None):
        self._deadline, self._stream, self._look = deadline, stream, look
        self.arrived = arrived   # time.perf_counter() when the request reached this process
        self._started = time.perf_counter()

    def time_remaining(self) -> float | None:
        return self._deadline - time.monotonic() if self._deadline else None

    def is_active(self) -> bool:
        """False once the call has ended or its deadline has passed.  The relay's thread
        reads no frames while it steps, so after a wait (LOOK_AFTER_S) this reads the ones
        that came meanwhile: an END among them ends the call before its step is applied."""
        if time.perf_counter() - self._started > LOOK_AFTER_S:
            try:
                self._look()
            except Exception:  # noqa: BLE001 — the caller holds the apply lock: never raise
                log.exception("reading the relay's frames during a step failed")
        return not self._stream.ended and (not self._deadline
                                           or time.monotonic() < self._deadline)

    def peer(self) -> str:
        return "relay"


class Job(Protocol):
    def close(self) -> None: ...


class RelayService(Protocol):
    """What the relay asks of the learner process (front.py's ``RelayedService``): the
    service's work on each request, and what the metrics count."""

    def prepare(self, request: memoryview, method: str) -> Job:
        """Check a request of ``method`` (:data:`STREAMED`) sent as it came and start its
        copy to the device; raises to refuse it."""

    def prepare_packed(self, packed: PackedBatch, key: bytes, method: str) -> Job:
        """The same for a request the front packed (its key's wire bytes given)."""

    def apply(self, job: Job, call: RelayCall) -> bytes:
        """Apply a prepared request (step, or insert): the response's bytes; raises to
        refuse it."""

    def refusal(self, exc: Exception, method: str) -> tuple[grpc.StatusCode, str]:
        """The status code and details a refusal is answered with."""

    def call(self, method: int, request: bytes, call: RelayCall
             ) -> tuple[grpc.StatusCode, bytes]:
        """Run a small rpc relayed whole: (code, the response's bytes or the details)."""

    def received(self, front: int) -> None:
        """A train request came from front ``front``."""

    def answered(self) -> None:
        """A train request was answered."""

    def stream_opened(self) -> None:
        """A TrainStream opened."""

    def stream_closed(self) -> None:
        """A TrainStream closed."""

    def front_refused(self, method: str, code: str, count: int = 1) -> None:
        """A front refused ``count`` rpcs itself (its REFUSED frame)."""


class _Front:
    """One front process's connection: its socket and buffer pool."""

    def __init__(self, index: int, sock: socket.socket, buffers: BufferPool):
        self.index, self.sock, self.buffers = index, sock, buffers
        self.fd = -1                # its descriptor, as watched (the socket may close first)
        self.unread = bytearray()   # bytes received and not yet framed


class _LearnerStream:
    __slots__ = ("front", "sid", "method", "outstanding", "ended", "failed")

    def __init__(self, front: _Front, sid: int, method: str):
        self.front, self.sid, self.method = front, sid, method   # a CALL's: ""

        self.outstanding = 0            # requests received, not answered
        self.ended = False              # its front ended it: nothing more of it is applied
        self.failed: tuple[grpc.StatusCode, bytes] | None = None   # every later answer


class _Item:
    """One relayed request on its way through the relay: received, prepared, answered."""

    __slots__ = ("stream", "buffer", "data", "deadline", "packed", "arrived", "job", "error")

    def __init__(self, stream: _LearnerStream, buffer: int, data: memoryview, deadline: float,
                 packed: bytes | None):
        self.stream, self.buffer, self.data, self.deadline = stream, buffer, data, deadline
        self.packed = packed   # a packed request's descriptor (data: its buffer), else None
        self.arrived = time.perf_counter()
        self.job: Job | None = None
        self.error: Exception | None = None


#: Requests prepared ahead of the one being stepped: its copy to the device then overlaps
#: that step.  With the one stepping, within the CUDA backend's upload buffers
#: (cuda.UPLOAD_BUFFERS), so no request's batch is packed at its step.
AHEAD = 1


class RelayLearner:
    """The learner process's end: one thread takes every request in arrival order.  It
    reads every front's frames (one epoll), checks the next request and starts its copy
    to the device, then steps the one before and replies, so each request's copy overlaps
    the step before it.  One thread, not one per stream or per front nor a reader handing
    over to a stepper: a request crosses no thread hand-over, and no second busy thread
    takes the GIL between its parts.  A stream's requests are answered in its order, and
    none after its first refusal is applied.  ``service`` does the work on each request
    (:class:`RelayService`).

    ``sock`` and ``buffers`` are the first front's; :meth:`attach` adds more fronts.  When
    the first front's connection closes, the learner process is stopping: the relay
    answers what it holds (UNAVAILABLE for the other fronts' requests: their clients retry
    elsewhere or later) and ends.  When another front's closes, only its streams end."""

    def __init__(self, sock: socket.socket, buffers: BufferPool, service: RelayService):
        self._service = service
        self._fronts = [_Front(0, sock, buffers)]
        self._joining = list(self._fronts)   # attached, not yet read (under _lock)
        self._lock = threading.Lock()        # attach() runs on other threads
        # The relay thread's alone from here on.
        self._streams: dict[tuple[int, int], _LearnerStream] = {}   # by (front, stream id)
        self._received: deque[_Item] = deque()   # not yet prepared
        self._calls: deque[tuple] = deque()   # CALLs read: (stream, method, bytes, deadline)
        self._prepared: deque[_Item] = deque()   # prepared, not yet stepped (≤ AHEAD + 1)
        self._closing = False         # the first front has gone: drain, then stop
        # A byte on this pair wakes the relay's select: a front attached.
        self._wake_out, self._wake_in = socket.socketpair()
        self._wake_out.setblocking(False)
        # Every front's socket and the wake's, by descriptor (the wake's: None).  epoll itself,
        # not selectors' wrapper of it, which adds work to every look (one a request).
        self._poll = select.epoll()
        self._polled: dict[int, _Front | None] = {}
        self._watch(self._wake_in, None)
        self.closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="duelq-relay", daemon=True)

    @property
    def thread(self) -> threading.Thread:
        """The relay's one thread (for its CPU clock, say)."""
        return self._thread

    def start(self) -> None:
        self._thread.start()

    def attach(self, sock: socket.socket, buffers: BufferPool) -> int:
        """Serve one more front process (after :meth:`start`); returns its index."""
        with self._lock:
            front = _Front(len(self._fronts), sock, buffers)
            self._fronts.append(front)
            self._joining.append(front)
        try:
            self._wake_out.send(b"\0")
        except OSError:   # full (a wake is pending anyway) or closed
            pass
        return front.index

    # ── the loop ────────────────────────────────────────────────────────────────────

    def _serve(self) -> None:
        """Read the fronts' frames, prepare and step their requests in arrival order; ends
        once the first front's connection has closed and every request received is
        answered.  Should it fail, every stream is refused from then on and each request
        left is answered (UNAVAILABLE: nothing more is applied; clients retry)."""
        try:
            self._loop()
        except Exception:  # noqa: BLE001 — logged; the relay ends and answers what it holds
            log.exception("the relay failed: refusing every stream")
            self._refuse_open_streams()
            for item in (*self._prepared, *self._received):
                self._answer(item)
            self._answer_calls()
        finally:
            for stream in list(self._streams.values()):
                self._finish(stream)
            self._poll.close()
            self.closed.set()

    def _loop(self) -> None:
        """:meth:`_serve`'s loop.  Each pass answers the small rpcs read (CALL), prepares
        the next request received (while at most AHEAD wait behind the next to step), reads
        the frames that came meanwhile, then steps and answers the oldest prepared request
        once AHEAD are prepared behind it or none is left to prepare (a CALL read just then
        is answered first).  So a request is stepped only after the frames sent during its
        preparation are read (an END stops it), and the next one's copy to the device is
        under way during its step."""
        prepared, received = self._prepared, self._received
        while True:
            if self._joining:
                self._join()
            if self._calls:   # between steps: a small rpc waits for no queue
                self._answer_calls()
            if received and len(prepared) <= AHEAD:
                prepared.append(self._prepare_next())
            elif not prepared and self._closing:
                return
            # With a request to step, only look (frames are likely there), else wait for a
            # frame or a wake.
            self._look(0 if prepared else None)
            if self._calls:   # read just now: answered before the next step
                continue
            if prepared and (len(prepared) > AHEAD or not received):
                self._answer(prepared.popleft())

    def _look(self, timeout: float | None = 0) -> None:
        """Read what the fronts sent (waiting up to ``timeout``; None: until something
        comes): also from inside a step, through :meth:`RelayCall.is_active`."""
        polled = self._polled
        for fd, _ in self._poll.poll(timeout):
            if fd not in polled:   # unregistered earlier in this look
                continue
            front = polled[fd]
            if front is None:
                self._wake_in.recv(4096)
            elif not self._read(front):
                self._close_front(front)

    # ── the fronts ──────────────────────────────────────────────────────────────────

    def _watch(self, sock: socket.socket, front: _Front | None) -> None:
        """Read ``sock`` (``front``'s, or the wake's) in :meth:`_look` from now on."""
        fd = sock.fileno()
        self._poll.register(fd, select.EPOLLIN)   # a closed socket's -1: ValueError
        self._polled[fd] = front
        if front is not None:
            front.fd = fd

    def _join(self) -> None:
        """Start reading the fronts attached since the last pass."""
        with self._lock:
            joining, self._joining = self._joining, []
        for front in joining:
            try:
                if self._closing:   # the relay only drains what it has
                    raise ValueError("the relay is closing")
                self._watch(front.sock, front)
            except (OSError, ValueError):   # closed before it was read, or too late
                self._close_front(front, registered=False)

    def _close_front(self, front: _Front, *, registered: bool = True) -> None:
        """Stop reading ``front``, whose connection closed; after the first front, stop
        reading every front (the relay only drains what it has)."""
        if registered:
            self._unwatch(front)
        log.info("relay closed (front process %d)", front.index + 1)
        for stream in list(self._streams.values()):
            if stream.front is front:   # nobody reads its answers any more
                self._ended(stream)
        if front.index == 0:
            self._closing = True
            self._refuse_open_streams()
            for other in [f for f in self._polled.values() if f is not None]:
                self._unwatch(other)
            self.closed.set()

    def _refuse_open_streams(self) -> None:
        """The learner process is stopping (or the relay failed): every stream still open
        is refused from now on, UNAVAILABLE, so a live client retries its keys (elsewhere,
        or once the server is back); none is answered CANCELLED, which would tell it that
        its own call was cancelled."""
        for stream in self._streams.values():
            if stream.failed is None and not stream.ended:
                stream.failed = (grpc.StatusCode.UNAVAILABLE, _STOPPING)

    def _unwatch(self, front: _Front) -> None:
        """Stop reading ``front`` in :meth:`_look`."""
        del self._polled[front.fd]
        try:
            self._poll.unregister(front.fd)
        except OSError:   # closed meanwhile (as selectors, which ignores it too)
            pass

    # ── frames ──────────────────────────────────────────────────────────────────────

    def _read(self, front: _Front) -> bool:
        """Take what ``front`` sent and act on its complete frames; False once its
        connection has closed."""
        try:
            chunk = front.sock.recv(1 << 16)
        except OSError:
            return False
        if not chunk:
            return False
        unread = front.unread
        unread += chunk
        if len(chunk) == 1 << 16:   # a large inline frame: take what waits now (≤ 64 MiB)
            while len(unread) < 1 << 26:
                try:
                    chunk = front.sock.recv(1 << 20, socket.MSG_DONTWAIT)
                except OSError:   # nothing waits
                    break
                if not chunk:     # the end: the next look reads it
                    break
                unread += chunk
        return self._parse(front)

    def _parse(self, front: _Front) -> bool:
        """Act on the complete frames in ``front``'s unread bytes; False when one names no
        buffer of the front's (its connection is then shut)."""
        unread = front.unread
        at, size = 0, _FRAME.size
        while len(unread) - at >= size:
            op, sid, buffer, n, deadline = _FRAME.unpack_from(unread, at)
            # its bytes follow the frame
            inline = op in (PACKED, REFUSED, CALL) or (op == REQ and buffer < 0)
            end = at + size + (n if inline else 0)
            if len(unread) < end:
                break
            payload = bytes(unread[at + size:end]) if inline else b""
            at = end
            if (op == REQ or op == PACKED) and not self._in_bounds(front, op, buffer, n):
                return False
            try:
                if op == PACKED:   # the usual request
                    self._enqueue(front, sid, buffer,
                                  front.buffers.buffer(buffer, front.buffers.size),
                                  deadline, payload)
                elif op == OPEN:
                    self._open(front, sid, buffer)
                elif op == REQ:
                    self._enqueue(front, sid, buffer, front.buffers.buffer(buffer, n)
                                  if buffer >= 0 else memoryview(payload), deadline)
                elif op == END:
                    self._end(front, sid)
                elif op == CALL:   # an END (a cancel) may follow: a stream of its own
                    stream = self._streams[front.index, sid] = _LearnerStream(front, sid, "")
                    self._calls.append((stream, buffer, payload, deadline))
                elif op == REFUSED:
                    method, code, count = payload.decode().rsplit(" ", 2)
                    self._service.front_refused(method, code, int(count))
                else:
                    log.warning("relay frame of unknown kind %d (stream %d) ignored", op, sid)
            except Exception:  # noqa: BLE001 — one bad frame must not end the relay
                log.exception("relay frame %d of stream %d failed", op, sid)
        del unread[:at]
        return True

    @staticmethod
    def _in_bounds(front: _Front, op: int, buffer: int, n: int) -> bool:
        """Whether a request frame names one of ``front``'s buffers (inline: the buffer it
        counts) and its bytes fit there; if not (a front bug, with no buffer to answer in),
        shut that front's connection and say False."""
        index = buffer if buffer >= 0 else INLINE - buffer
        pool = front.buffers
        if 0 <= index < pool.count and (
                buffer < 0 and op == REQ or buffer >= 0 and (op == PACKED or n <= pool.size)):
            return True
        log.error("front process %d sent a request of %d bytes in buffer %d of its %d: its "
                  "connection is shut", front.index + 1, n, buffer, pool.count)
        try:
            front.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        return False

    # ── streams ─────────────────────────────────────────────────────────────────────

    def _open(self, front: _Front, sid: int, method: int) -> None:
        if not 0 <= method < len(STREAMED):   # a front bug: its requests are answered so
            log.error("front process %d opened stream %d of unknown method %d",
                      front.index + 1, sid, method)
            return                            # (an unknown stream's)
        if STREAMED[method] == "TrainStream":
            self._service.stream_opened()
        self._streams[front.index, sid] = _LearnerStream(front, sid, STREAMED[method])

    def _enqueue(self, front: _Front, sid: int, buffer: int, data: memoryview,
                 deadline: float, packed: bytes | None = None) -> None:
        stream = self._streams.get((front.index, sid))
        if stream is None:   # not open (a front bug): answer, so its buffer comes back
            self._reply(_LearnerStream(front, sid, ""), buffer, grpc.StatusCode.CANCELLED,
                        b"unknown stream; not applied")
            return
        if stream.method in TRAIN:
            self._service.received(front.index)
        stream.outstanding += 1
        self._received.append(_Item(stream, buffer, data, deadline, packed))

    def _end(self, front: _Front, sid: int) -> None:
        stream = self._streams.get((front.index, sid))
        if stream is not None:
            self._ended(stream)

    def _ended(self, stream: _LearnerStream) -> None:
        """``stream`` ended: none of its requests not yet started will be applied; it is
        forgotten with its last answer."""
        stream.ended = True
        if not stream.outstanding:
            self._finish(stream)

    def _finish(self, stream: _LearnerStream) -> None:
        """Forget ``stream`` (not another that took its id since)."""
        key = (stream.front.index, stream.sid)
        if self._streams.get(key) is stream:
            del self._streams[key]
            if stream.method == "TrainStream":
                self._service.stream_closed()

    # ── requests ────────────────────────────────────────────────────────────────────

    def _prepare_next(self) -> _Item:
        """The next request received, checked and its copy started (a refusal is kept, to
        be answered in order)."""
        item = self._received.popleft()
        stream = item.stream
        if stream.failed is None and not stream.ended:
            try:
                item.job = (self._service.prepare(item.data, stream.method)
                            if item.packed is None else
                            self._service.prepare_packed(*read_packed(
                                item.packed, item.data,
                                stream.front.buffers.address(item.buffer)), stream.method))
            except Exception as exc:  # noqa: BLE001 — answered in order, at its turn
                item.error = exc
        return item

    def _answer_calls(self) -> None:
        """Run and answer the small rpcs read so far: one that ended first (an END: the
        front's cancel; its front gone) is not run, nor one refused (the learner process
        stopping); one that fails is answered INTERNAL."""
        while self._calls:
            stream, method, request, deadline = self._calls.popleft()
            try:
                if stream.failed is not None:
                    code, payload = stream.failed
                elif stream.ended:
                    code, payload = grpc.StatusCode.CANCELLED, b"the call ended before it ran"
                else:
                    code, payload = self._service.call(
                        method, request, RelayCall(deadline, stream, time.perf_counter(),
                                                   self._look))
            except Exception as exc:  # noqa: BLE001 — every call is answered
                log.exception("a relayed call (method %d) failed", method)
                code, payload = grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}".encode()
            self._finish(stream)
            self._reply(stream, NO_BUFFER, code, payload)

    def _answer(self, item: _Item) -> None:
        """Step ``item`` (or refuse it) and reply."""
        code, payload = self._run(item)
        stream = item.stream
        stream.outstanding -= 1
        self._reply(stream, item.buffer, code, payload)
        if stream.method in TRAIN:
            self._service.answered()
        if stream.ended and not stream.outstanding:
            self._finish(stream)

    def _run(self, item: _Item) -> tuple[grpc.StatusCode, bytes]:
        stream = item.stream
        try:
            if stream.failed is not None:
                return stream.failed
            if stream.ended:
                return (grpc.StatusCode.CANCELLED, b"the call ended before this request "
                                                   b"started; it was not applied")
            if item.error is not None:
                raise item.error
            call = RelayCall(item.deadline, stream, item.arrived, self._look)
            return grpc.StatusCode.OK, self._service.apply(item.job, call)
        except Exception as exc:  # noqa: BLE001 — every refusal is answered
            try:
                code, details = self._service.refusal(exc, stream.method)
            except Exception:  # noqa: BLE001 — still answered, so the front's buffer comes back
                log.exception("wording the refusal of a request of stream %d failed",
                              stream.sid)
                code, details = grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"
            stream.failed = (code, details.encode())
            return stream.failed
        finally:
            self._close(item)

    @staticmethod
    def _close(item: _Item) -> None:
        """Give a request's job and bytes back; a failure here (a device fault, say) is logged,
        so the relay thread lives on and every later request is still answered."""
        try:
            if item.job is not None:
                item.job.close()
        except Exception:  # noqa: BLE001 — see above
            log.exception("closing a relayed request of stream %d failed", item.stream.sid)
        try:
            item.data.release()
        except BufferError:   # still viewed by the batch of a refused request
            pass

    @staticmethod
    def _reply(stream: _LearnerStream, buffer: int, code: grpc.StatusCode,
               payload: bytes) -> None:
        frame = _REPLY.pack(stream.sid, buffer, code.value[0], len(payload))
        try:
            _send_whole(stream.front.sock, frame, payload)   # no joined copy
        except OSError:
            pass   # the front is gone; the loop sees it too

    def close(self) -> None:
        with self._lock:
            fronts = list(self._fronts)
        for front in fronts:
            try:
                front.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(5)   # it sees the first front close, drains and ends
        for sock in [front.sock for front in fronts] + [self._wake_out, self._wake_in]:
            sock.close()
