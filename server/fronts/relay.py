"""The hand-over of rpcs from the front process to the learner process.

With ``--front-processes`` the gRPC server runs in one process and the learner in
another, so gRPC's per-message Python work and the learner's (parse, checks,
copy, launch, encode) no longer share one GIL.  Request bytes travel through a
shared-memory slot pool (a memfd, so Docker's 64 MiB /dev/shm is no limit); a
Unix socket pair carries fixed-size frames:

    front → learner   OPEN  stream, unary flag
                      REQ   stream, slot (-1: the bytes follow inline), size, deadline
                      PACKED  stream, slot, size, deadline, then the descriptor (size bytes):
                            the slot holds the request's arrays, packed by the front
                            (server/packing.py)
                      END   stream: the rpc is over; requests not started are not applied
                      REFUSED  size, then "method code" (UTF-8): an rpc the front itself
                            refused (token, max_streams), for the learner's metrics
                      CALL  call id, method, size, deadline, then the request's bytes: a
                            small rpc (Act, GetWeights …), relayed whole
    learner → front   REPLY stream (or call id), slot (NO_SLOT for a CALL), status code,
                      size, then the payload (the response's bytes, or the error details
                      as UTF-8)

Every REQ gets exactly one REPLY, in order within its stream; the front gives a
slot back only on its REPLY, so the learner reads the bytes in place.  Every CALL gets
one REPLY too, between two steps (not behind the train requests queued before it).  With several
front processes (``--front-processes``) each has its own socket and slot pool, and
stream ids are each front's own.  The learner
takes requests in arrival order on one thread, which reads every front's frames, checks
each request and starts its copy to the device before it steps the one before
(:class:`RelayLearner`).
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
from collections import deque
from typing import Callable, Iterator, Protocol

import grpc
import numpy as np

from duelq.server.core.batch import PackedBatch
from duelq.server.fronts.packing import read_packed

log = logging.getLogger(__name__)

OPEN, REQ, END, REFUSED, PACKED, CALL = 1, 2, 3, 4, 5, 6
_FRAME = struct.Struct("<BxxxIiId")     # op, stream, slot, size, deadline (0: none)
_REPLY = struct.Struct("<IiII")         # stream, slot, status code value, size
_CODES = {code.value[0]: code for code in grpc.StatusCode}
INLINE = -1
NO_SLOT = -(1 << 31)   # a CALL's REPLY: no slot to give back
_GONE = b"the learner process went away; retry (a keyed request with the same key)"
MAX_STREAM_ID = (1 << 32) - 1


class RelayClosed(Exception):
    """The other process went away."""


class SlotPool:
    """``count`` slots of ``size`` bytes in one shared mapping (a memfd)."""

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

    def slot(self, index: int, n: int) -> memoryview:
        return self.view[index * self.size: index * self.size + n]

    def array(self, index: int) -> np.ndarray:
        """Slot ``index``'s bytes, uint8."""
        return self.bytes[index * self.size:(index + 1) * self.size]

    def address(self, index: int) -> int:
        """Host address of slot ``index``'s first byte."""
        return self._base + index * self.size

    def write(self, index: int, data: bytes) -> None:
        if not 0 <= index < self.count or len(data) > self.size:
            raise ValueError(f"{len(data)} bytes into slot {index}: the pool has {self.count} "
                             f"slots of {self.size} bytes")
        start = index * self.size
        # Holding the GIL, as the Packer copies (server/packing.py): a copy that let it go
        # would wait for the front's busy threads to give it back.
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


class FrontStream:
    """One rpc's requests towards the learner and their replies, in order."""

    def __init__(self, relay: "RelayFront", sid: int, deadline: float | None):
        self._relay, self.sid = relay, sid
        self._deadline = deadline or 0.0
        self._replies: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = 0          # sent, not answered
        self._sending = True       # more requests may come
        self._lock = threading.Lock()
        self._order = threading.Lock()   # no REQ frame after this stream's END
        self.closed = False

    def submit(self, data: bytes) -> bool:
        """Send one request; False when the stream is closed (the request is dropped)."""
        slot = self._relay.take_slot(self)
        if slot is None:
            return False
        with self._order:
            if self.closed:
                self._relay.give_back(slot)
                return False
            with self._lock:
                self._pending += 1
            try:
                self._relay.send_request(self.sid, slot, data, self._deadline)
            except RelayClosed:
                self._replies.put((grpc.StatusCode.UNAVAILABLE,
                                   b"the learner process went away"))
        return True

    def done_sending(self) -> None:
        with self._lock:
            self._sending = False
        self._replies.put(None)

    def deliver(self, code: grpc.StatusCode, payload: bytes) -> None:
        self._replies.put((code, payload))

    def replies(self) -> Iterator[tuple[grpc.StatusCode, bytes]]:
        """(code, payload) per request, in order; ends when no more can come, or when the
        stream is closed (its replies then only give their slots back)."""
        while True:
            with self._lock:
                if self.closed or (not self._sending and self._pending == 0):
                    return
            item = self._replies.get()
            if item is None:
                continue
            with self._lock:
                self._pending -= 1
            yield item

    def close(self) -> None:
        """End the stream (idempotent; also the rpc's termination callback): requests not
        yet started are not applied."""
        with self._order:
            if self.closed:
                return
            self.closed = True
        self._replies.put(None)   # wakes replies(), which then ends
        self._relay.end(self)


#: Writes a request's arrays into a slot (uint8, at the given host address) in the packed
#: layout and returns the descriptor to send, or None (or a raise) to send the request as it
#: came (server/packing.py's Packer).
Pack = Callable[[bytes, np.ndarray, int], "bytes | None"]


class _Answer:
    """The one reply to a CALL."""

    def __init__(self):
        self._replies: queue.SimpleQueue = queue.SimpleQueue()

    def deliver(self, code: grpc.StatusCode, payload: bytes) -> None:
        self._replies.put((code, payload))

    def get(self, timeout: float | None) -> tuple[grpc.StatusCode, bytes] | None:
        """The reply; None if none came within ``timeout`` seconds (None: no limit)."""
        try:
            return self._replies.get(timeout=None if timeout is None else max(timeout, 0.0))
        except queue.Empty:
            return None


class RelayFront:
    """The front process's end: submits requests (packed by ``pack`` where it can) and
    routes the learner's replies."""

    def __init__(self, sock: socket.socket, slots: SlotPool, pack: Pack | None = None):
        self._sock, self.slots, self._pack = sock, slots, pack
        self._pack_failed = False
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(slots.count):
            self._free.put(i)
        self._send_lock = threading.Lock()
        self._streams: dict[int, FrontStream | _Answer] = {}   # by stream or call id
        self._last_id = 0              # stream ids: 1 … 2**32 − 1 (a frame's 32 bits), again
        self._ids_lock = threading.Lock()
        self.alive = True
        self.closed = threading.Event()   # set with alive = False
        self.on_close: Callable[[], None] = lambda: None
        self._reader = threading.Thread(target=self._read_replies, name="duelq-relay-front",
                                        daemon=True)
        self._reader.start()

    def open(self, *, unary: bool, deadline: float | None) -> FrontStream:
        with self._ids_lock:
            sid = self._new_id()
            stream = self._streams[sid] = FrontStream(self, sid, deadline)
        try:
            self._send(_FRAME.pack(OPEN, sid, int(unary), 0, 0.0))
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

    def _cancel(self, sid: int, answer: "_Answer") -> None:
        """End call ``sid`` on the learner's side (not run if not yet), unless answered."""
        if self._streams.get(sid) is answer and self.alive:
            try:
                self._send(_FRAME.pack(END, sid, 0, 0, 0.0))
            except RelayClosed:
                pass

    def take_slot(self, stream: FrontStream) -> int | None:
        """A free slot (waits while all are in use); None if the stream or relay closed."""
        while not stream.closed and self.alive:
            try:
                return self._free.get(timeout=0.1)
            except queue.Empty:
                continue
        return None

    def give_back(self, slot: int) -> None:
        self._free.put(slot)

    def send_request(self, sid: int, slot: int, data: bytes, deadline: float) -> None:
        descriptor = None
        if self._pack is not None:
            try:
                descriptor = self._pack(data, self.slots.array(slot), self.slots.address(slot))
            except Exception:  # noqa: BLE001 — a packing fault: the bytes go as they came
                if not self._pack_failed:   # once: it may fail for every request
                    self._pack_failed = True
                    log.exception("packing a request of stream %d failed; it and any "
                                  "other that fails so go unpacked", sid)
        if descriptor is not None:
            self._send(_FRAME.pack(PACKED, sid, slot, len(descriptor), deadline), descriptor)
        elif len(data) <= self.slots.size:
            self.slots.write(slot, data)
            self._send(_FRAME.pack(REQ, sid, slot, len(data), deadline))
        else:  # larger than a slot: inline (the slot still counts the request in flight)
            self._send(_FRAME.pack(REQ, sid, INLINE - slot, len(data), deadline), data)

    def report_refusal(self, method: str, code: grpc.StatusCode) -> None:
        """Count an rpc the front refused in the learner's metrics (dropped when the learner
        process is gone)."""
        if self.alive:
            payload = f"{method} {code.name}".encode()
            try:
                self._send(_FRAME.pack(REFUSED, 0, 0, len(payload), 0.0), payload)
            except RelayClosed:
                pass

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
                sid, slot, code, n = _REPLY.unpack(_recv_exact(rfile, _REPLY.size))
                payload = _recv_exact(rfile, n) if n else b""
                if slot != NO_SLOT:
                    self._free.put(slot if slot >= 0 else INLINE - slot)
                stream = self._streams.get(sid)
                if stream is not None:
                    stream.deliver(_CODES.get(code, grpc.StatusCode.UNKNOWN), payload)
        except (RelayClosed, OSError, ValueError):
            pass
        finally:
            self.alive = False
            self.closed.set()
            for stream in list(self._streams.values()):
                stream.deliver(grpc.StatusCode.UNAVAILABLE, _GONE)
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


class _Front:
    """One front process's connection: its socket and slot pool."""

    def __init__(self, index: int, sock: socket.socket, slots: SlotPool):
        self.index, self.sock, self.slots = index, sock, slots
        self.fd = -1                # its descriptor, as watched (the socket may close first)
        self.unread = bytearray()   # bytes received and not yet framed


class _LearnerStream:
    __slots__ = ("front", "sid", "unary", "outstanding", "ended", "failed", "admitted")

    def __init__(self, front: _Front, sid: int, unary: bool):
        self.front, self.sid, self.unary = front, sid, unary
        self.outstanding = 0            # requests received, not answered
        self.ended = self.admitted = False
        self.failed: tuple[grpc.StatusCode, bytes] | None = None


class _Item:
    """One relayed request on its way through the relay: received, prepared, answered."""

    __slots__ = ("stream", "slot", "data", "deadline", "packed", "arrived", "job", "error")

    def __init__(self, stream: _LearnerStream, slot: int, data: memoryview, deadline: float,
                 packed: bytes | None):
        self.stream, self.slot, self.data, self.deadline = stream, slot, data, deadline
        self.packed = packed   # a packed request's descriptor (data: its slot), else None
        self.arrived = time.perf_counter()
        self.job: Job | None = None
        self.error: Exception | None = None


class Job(Protocol):
    def close(self) -> None: ...


class Gauge(Protocol):
    def inc(self) -> None: ...

    def dec(self) -> None: ...


#: Checks a request and starts it towards the device: (request bytes, unary) → a job;
#: raises to refuse the request.
Prepare = Callable[[memoryview, bool], Job]
#: Checks a request that the front packed and starts it towards the device: (the packed
#: batch, its key's wire bytes) → a job; raises to refuse the request.
PreparePacked = Callable[[PackedBatch, bytes], Job]
#: Steps a prepared job: (job, call) → response bytes; raises to refuse the request.
Apply = Callable[[Job, RelayCall], bytes]
#: Turns an exception into (status code, details), given unary.
Refusal = Callable[[Exception, bool], tuple[grpc.StatusCode, str]]
#: Runs a small rpc relayed whole: (method index, request bytes, call) → (code, payload).
Call = Callable[[int, bytes, RelayCall], tuple[grpc.StatusCode, bytes]]

#: Requests prepared ahead of the one being stepped: its copy to the device then overlaps
#: that step.  With the one stepping, within the CUDA backend's upload buffers
#: (cuda.UPLOAD_BUFFERS), so no request's batch is packed at its step.
AHEAD = 1


def _no_packed(packed: PackedBatch, key: bytes) -> Job:
    raise RuntimeError("a packed request reached a relay that takes none")


def _no_calls(method: int, request: bytes, call: RelayCall) -> tuple[grpc.StatusCode, bytes]:
    return grpc.StatusCode.UNIMPLEMENTED, b"this relay takes no small rpcs"


class RelayLearner:
    """The learner process's end: one thread takes every request in arrival order.  It
    reads every front's frames (one epoll), checks the next request and starts its copy
    to the device, then steps the one before and replies, so each request's copy overlaps
    the step before it.  One thread, not one per stream or per front nor a reader handing
    over to a stepper: a request crosses no thread hand-over, and no second busy thread
    takes the GIL between its parts.  A stream's requests
    are answered in its order, and none after its first refusal is applied.

    ``sock`` and ``slots`` are the first front's; :meth:`attach` adds more fronts.  When
    the first front's connection closes, the relay drains and ends; when another's does,
    only that front's streams end."""

    def __init__(self, sock: socket.socket, slots: SlotPool, prepare: Prepare, apply: Apply,
                 refuse: Refusal, *, open_stream: Callable[[], None],
                 close_stream: Callable[[], None], prepare_packed: PreparePacked | None = None,
                 call: Call | None = None, depth: Gauge | None = None,
                 refused: Callable[[str, str], None] = lambda method, code: None,
                 relayed: Callable[[int], None] = lambda front: None):
        self._fronts = [_Front(0, sock, slots)]
        self._joining = list(self._fronts)   # attached, not yet read (under _lock)
        self._lock = threading.Lock()        # attach() runs on other threads
        self._relayed = relayed   # (front index) per request received
        self._depth = depth   # counts requests from their arrival to their answer
        self._refused = refused   # (method, code name) of an rpc the front refused
        self._prepare, self._apply, self._refuse = prepare, apply, refuse
        self._prepare_packed = prepare_packed or _no_packed
        self._call = call or _no_calls
        self._open_stream, self._close_stream = open_stream, close_stream
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
        # not selectors' wrapper of it: ≈ 0.5 µs less a look, one look a request.
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

    def attach(self, sock: socket.socket, slots: SlotPool) -> int:
        """Serve one more front process (after :meth:`start`); returns its index."""
        with self._lock:
            front = _Front(len(self._fronts), sock, slots)
            self._fronts.append(front)
            self._joining.append(front)
        try:
            self._wake_out.send(b"\0")
        except OSError:   # full (a wake is pending anyway) or closed
            pass
        return front.index

    def _serve(self) -> None:
        """Read the fronts' frames, prepare and step their requests in arrival order; ends
        once the first front's connection has closed and every request received is
        answered.  Should it fail, the relay ends as when the first front goes: every
        stream ends and each request left is answered."""
        try:
            self._loop()
        except Exception:  # noqa: BLE001 — logged; the relay ends and answers what it holds
            log.exception("the relay failed: ending every stream")
            self._front_closed(self._fronts[0])
            for item in (*self._prepared, *self._received):   # CANCELLED: their streams ended
                self._answer(item)
            self._answer_calls()
        finally:
            self._poll.close()
            self.closed.set()   # already, unless the relay failed

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
        self._front_closed(front)
        if front.index == 0:
            self._closing = True
            for other in [f for f in self._polled.values() if f is not None]:
                self._unwatch(other)

    def _unwatch(self, front: _Front) -> None:
        """Stop reading ``front`` in :meth:`_look`."""
        del self._polled[front.fd]
        try:
            self._poll.unregister(front.fd)
        except OSError:   # closed meanwhile (as selectors, which ignores it too)
            pass

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
        slot of the front's (its connection is then shut)."""
        unread = front.unread
        at, size = 0, _FRAME.size
        while len(unread) - at >= size:
            op, sid, slot, n, deadline = _FRAME.unpack_from(unread, at)
            # its bytes follow the frame
            inline = op in (PACKED, REFUSED, CALL) or (op == REQ and slot < 0)
            end = at + size + (n if inline else 0)
            if len(unread) < end:
                break
            payload = bytes(unread[at + size:end]) if inline else b""
            at = end
            if (op == REQ or op == PACKED) and not self._in_bounds(front, op, slot, n):
                return False
            try:
                if op == PACKED:   # the usual request
                    self._enqueue(front, sid, slot, front.slots.slot(slot, front.slots.size),
                                  deadline, payload)
                elif op == OPEN:
                    self._open(front, sid, unary=bool(slot))
                elif op == REQ:
                    self._enqueue(front, sid, slot, front.slots.slot(slot, n) if slot >= 0
                                  else memoryview(payload), deadline)
                elif op == END:
                    self._end(front, sid)
                elif op == CALL:   # an END (a cancel) may follow: a stream of its own
                    stream = self._streams[front.index, sid] = _LearnerStream(front, sid, True)
                    self._calls.append((stream, slot, payload, deadline))
                elif op == REFUSED:
                    method, _, code = payload.decode().rpartition(" ")
                    self._refused(method, code)
                else:
                    log.warning("relay frame of unknown kind %d (stream %d) ignored", op, sid)
            except Exception:  # noqa: BLE001 — one bad frame must not end the relay
                log.exception("relay frame %d of stream %d failed", op, sid)
        del unread[:at]
        return True

    @staticmethod
    def _in_bounds(front: _Front, op: int, slot: int, n: int) -> bool:
        """Whether a request frame names one of ``front``'s slots (inline: the slot it
        counts) and its bytes fit there; if not (a front bug, with no slot to answer in),
        shut that front's connection and say False."""
        index = slot if slot >= 0 else INLINE - slot
        if 0 <= index < front.slots.count and (
                slot < 0 and op == REQ or slot >= 0 and (op == PACKED or n <= front.slots.size)):
            return True
        log.error("front process %d sent a request of %d bytes in slot %d of its %d: its "
                  "connection is shut", front.index + 1, n, slot, front.slots.count)
        try:
            front.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        return False

    def _front_closed(self, front: _Front) -> None:
        """``front``'s connection closed: its streams end (every stream, for the first
        front, whose end is the relay's)."""
        log.info("relay closed (front process %d)", front.index + 1)
        for stream in list(self._streams.values()):
            if front.index == 0 or stream.front is front:
                self._ended(stream)
                if not stream.outstanding:   # else it ends with its last answer
                    self._finish(stream)
        if front.index == 0:
            self.closed.set()

    def _open(self, front: _Front, sid: int, unary: bool) -> None:
        stream = _LearnerStream(front, sid, unary)
        if not unary:
            try:
                self._open_stream()
                stream.admitted = True
            except Exception as exc:  # noqa: BLE001 — e.g. too many streams: its first answer
                code, details = self._refuse(exc, unary)
                stream.failed = (code, details.encode())
        self._streams[front.index, sid] = stream

    def _enqueue(self, front: _Front, sid: int, slot: int, data: memoryview,
                 deadline: float, packed: bytes | None = None) -> None:
        stream = self._streams.get((front.index, sid))
        if stream is None:   # not open (a front bug): answer, so its slot comes back
            self._reply(_LearnerStream(front, sid, False), slot, grpc.StatusCode.CANCELLED,
                        b"unknown stream; not applied")
            return
        self._relayed(front.index)
        if self._depth is not None:
            self._depth.inc()
        stream.outstanding += 1
        self._received.append(_Item(stream, slot, data, deadline, packed))

    def _end(self, front: _Front, sid: int) -> None:
        stream = self._streams.get((front.index, sid))
        if stream is not None:
            self._ended(stream)
            if not stream.outstanding:
                self._finish(stream)

    def _ended(self, stream: _LearnerStream) -> None:
        """``stream`` ended: none of its requests not yet started will be applied."""
        stream.ended = True

    def _finish(self, stream: _LearnerStream) -> None:
        """Forget ``stream`` (not another that took its id since) and release its place
        among the open streams, if it had one."""
        key = (stream.front.index, stream.sid)
        if self._streams.get(key) is stream:
            del self._streams[key]
            if stream.admitted:
                self._close_stream()

    def _prepare_next(self) -> _Item:
        """The next request received, checked and its copy started (a refusal is kept, to
        be answered in order)."""
        item = self._received.popleft()
        stream = item.stream
        if stream.failed is None and not stream.ended:
            try:
                item.job = (self._prepare(item.data, stream.unary) if item.packed is None else
                            self._prepare_packed(*read_packed(
                                item.packed, item.data, stream.front.slots.address(item.slot))))
            except Exception as exc:  # noqa: BLE001 — answered in order, at its turn
                item.error = exc
        return item

    def _answer_calls(self) -> None:
        """Run and answer the small rpcs read so far: one that ended first (an END: the
        front's cancel; its front gone) is not run, one that fails is answered INTERNAL."""
        while self._calls:
            stream, method, request, deadline = self._calls.popleft()
            try:
                if stream.ended:
                    code, payload = grpc.StatusCode.CANCELLED, b"the call ended before it ran"
                else:
                    code, payload = self._call(method, request,
                                               RelayCall(deadline, stream, time.perf_counter(),
                                                         self._look))
            except Exception as exc:  # noqa: BLE001 — every call is answered
                log.exception("a relayed call (method %d) failed", method)
                code, payload = grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}".encode()
            self._finish(stream)   # never admitted: no stream place to release
            self._reply(stream, NO_SLOT, code, payload)

    def _answer(self, item: _Item) -> None:
        """Step ``item`` (or refuse it) and reply."""
        code, payload = self._run(item)
        stream = item.stream
        stream.outstanding -= 1
        self._reply(stream, item.slot, code, payload)
        if self._depth is not None:
            self._depth.dec()
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
            return grpc.StatusCode.OK, self._apply(item.job, call)
        except Exception as exc:  # noqa: BLE001 — every refusal is answered
            try:
                code, details = self._refuse(exc, stream.unary)
            except Exception:  # noqa: BLE001 — still answered, so the front's slot comes back
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
    def _reply(stream: _LearnerStream, slot: int, code: grpc.StatusCode,
               payload: bytes) -> None:
        frame = _REPLY.pack(stream.sid, slot, code.value[0], len(payload))
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
