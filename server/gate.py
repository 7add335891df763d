"""The gate every call passes before it may hold a worker, and how long it may hold one.

grpcio's synchronous server gives each call a worker thread as soon as its headers
arrive, and a unary call's thread then waits for the request for ever.  So a client that
sends headers and nothing more, or stops mid-message, could hold every worker.  The
:class:`Gate` interceptor decides at the headers, before anything waits:

* a call without the bearer token (health excepted) is refused UNAUTHENTICATED at once,
  its request unread: it holds nothing an actor needs;
* an admitted call holds one of ``max_rpcs`` places (server-wide: with front processes
  the count is shared, server/fronts/shared.py); past it RESOURCE_EXHAUSTED at once.
  Health checks, which need no token, have :data:`HEALTH_RPCS` places of their own;
* every request message must arrive whole within ``receive_timeout_s`` of the server
  asking for it, or the call is cancelled (CANCELLED) and gives its place back
  (:class:`Watchdog`).  TrainStream and InsertStream time their own reads instead
  (:class:`StreamReader`): between requests an actor may pause, and an idle stream ends
  UNAVAILABLE, which the client answers by reopening it.

Refusals run on a worker for a few microseconds; the pool has room for them beyond the
admitted calls (:func:`worker_count`).
"""

from __future__ import annotations

import hmac
import itertools
import logging
import queue
import threading
import time
from collections import OrderedDict
from typing import Callable, Iterator, Protocol

import grpc

log = logging.getLogger(__name__)

HEALTH_PREFIX = "/grpc.health.v1.Health/"
#: Health rpcs (no token needed) running at once, beside ``max_rpcs``.
HEALTH_RPCS = 8
#: Workers beyond the admitted calls', for refusals, so none waits behind a held call.
REFUSAL_WORKERS = 4


def worker_count(max_rpcs: int) -> int:
    """Worker threads of a server admitting ``max_rpcs`` calls."""
    return max_rpcs + HEALTH_RPCS + REFUSAL_WORKERS


def too_many_rpcs(limit: int) -> str:
    """What the server says to a call past ``max_rpcs``, in every server model."""
    return f"too many concurrent rpcs (limit {limit})"


class Tally(Protocol):
    """How many of something are held, server-wide, up to ``limit``."""

    limit: int

    def take(self) -> bool:
        """Hold one more; False (holding nothing) at the limit."""

    def give_back(self) -> None:
        """Give one back."""


class Count:
    """A :class:`Tally` within one process (thread-safe)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.held = 0
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            if self.held >= self.limit:
                return False
            self.held += 1
            return True

    def give_back(self) -> None:
        with self._lock:
            self.held -= 1


def same_shape(handler: grpc.RpcMethodHandler, behaviour, request_deserializer, *,
               request_streaming: bool | None = None,
               response_serializer=None) -> grpc.RpcMethodHandler:
    """A handler with ``handler``'s streaming shape (its requests' streaming replaced by
    ``request_streaming`` when given) and serializer (or ``response_serializer``), running
    ``behaviour``."""
    make = {(False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler}
    streaming = handler.request_streaming if request_streaming is None else request_streaming
    return make[streaming, handler.response_streaming](
        behaviour, request_deserializer=request_deserializer,
        response_serializer=response_serializer or handler.response_serializer)


class Watchdog:
    """Cancels each call whose awaited request has not come (or whose answer has not been
    taken) ``timeout_s`` after :meth:`arm`, unless :meth:`disarm` came first.  One thread
    for all calls; every wait is as long, so the oldest armed is the next due, and arming
    and disarming cost O(1) and wake no thread."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._armed: OrderedDict[int, tuple[float, grpc.ServicerContext, str, str]] = (
            OrderedDict())
        self._ids = itertools.count()
        self._changed = threading.Condition(threading.Lock())   # not an RLock: cheaper per call
        self._closed = False
        self._thread: threading.Thread | None = None

    def arm(self, context: grpc.ServicerContext, method: str, awaited: str = "request") -> int:
        key = next(self._ids)
        with self._changed:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="duelq-watchdog",
                                                daemon=True)
                self._thread.start()
            self._armed[key] = (time.monotonic() + self.timeout_s, context, method, awaited)
        return key

    def disarm(self, key: int) -> None:
        with self._changed:
            self._armed.pop(key, None)

    def send(self, answer, context: grpc.ServicerContext, method: str) -> Iterator:
        """Yield ``answer`` to grpc, which asks for the next one once this one is sent: a
        client that leaves a stream's answers unread (HTTP/2 flow control then holds the
        send) has its call cancelled ``timeout_s`` later, and its places come back."""
        key = self.arm(context, method, "read of its answer")
        try:
            yield answer
        finally:
            self.disarm(key)

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify()

    def _run(self) -> None:
        # Never woken by arm: a call armed now is due after every armed one and at most
        # timeout_s after this thread's next look, so it is cancelled on time regardless.
        while True:
            with self._changed:
                if self._closed:
                    return
                if not self._armed:
                    self._changed.wait(self.timeout_s)
                    continue
                key, (due, context, method, awaited) = next(iter(self._armed.items()))
                left = due - time.monotonic()
                if left > 0:
                    self._changed.wait(left)
                    continue
                del self._armed[key]
            log.info("%s from %s: no %s within %g s: cancelled", method, context.peer(),
                     awaited, self.timeout_s)
            context.cancel()


class Gate(grpc.ServerInterceptor):
    """Admits a call, or refuses it at its headers: the bearer token (``token``; "": none
    needed), the rpc places (``rpcs``), the receive deadline (``receive_timeout_s``; the
    methods in ``self_timed`` read their requests themselves).  ``on_refuse`` is told the
    method path and code of each refusal (for the metrics)."""

    def __init__(self, rpcs: Tally, receive_timeout_s: float, *, token: str = "",
                 on_refuse: Callable[[str, grpc.StatusCode], None] | None = None,
                 self_timed: tuple[str, ...] = ()):
        self._rpcs, self._health = rpcs, Count(HEALTH_RPCS)
        self._expected = token.encode() if token else None
        self._on_refuse = on_refuse
        self._self_timed = frozenset(self_timed)
        self.watchdog = Watchdog(receive_timeout_s)
        # method path -> (grpc's handler, the admitted wrapper of it): built once per method,
        # not per call (the wrapper depends on nothing else)
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None:
            return None
        method = details.method
        health = method.startswith(HEALTH_PREFIX)
        if not health and self._expected is not None:
            if not self.admits(dict(details.invocation_metadata).get("authorization", "")):
                return self._refusal(handler, method, grpc.StatusCode.UNAUTHENTICATED,
                                     "missing or wrong bearer token")
        places = self._health if health else self._rpcs
        if not places.take():
            return self._refusal(handler, method, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 f"too many concurrent health checks (limit {HEALTH_RPCS})"
                                 if health else too_many_rpcs(places.limit))
        cached = self._wrapped.get(method)
        if cached is None or cached[0] is not handler:
            cached = self._wrapped[method] = (handler, self._admitted(handler, method, places))
        return cached[1]

    def admits(self, value: str | bytes) -> bool:
        """Whether an authorization header's ``value`` carries the token: ``Bearer <token>``,
        the scheme in any case (RFC 7235), the token compared in constant time."""
        value = value.decode(errors="replace") if isinstance(value, bytes) else value
        scheme, _, token = value.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.lstrip(" ").encode(),
                                                                 self._expected)

    def _refusal(self, handler: grpc.RpcMethodHandler, method: str, code: grpc.StatusCode,
                 details: str) -> grpc.RpcMethodHandler:
        """A handler that answers ``code`` at once: request-streaming whatever the method,
        so it waits for no request (raw bytes: nothing of one would be parsed)."""
        def refuse(requests, context):
            if self._on_refuse is not None:
                self._on_refuse(method, code)
            context.abort(code, details)

        return same_shape(handler, refuse, None, request_streaming=True)

    def _admitted(self, handler: grpc.RpcMethodHandler, method: str,
                  places: Tally) -> grpc.RpcMethodHandler:
        """``handler``, holding a place until the call ends, with its requests read under
        the receive deadline: request-streaming whatever the method, so the read is ours."""
        def hold(context: grpc.ServicerContext) -> None:
            if not context.add_callback(places.give_back):   # the call is over already
                places.give_back()

        if handler.request_streaming:
            inner = handler.stream_stream or handler.stream_unary
            timed = method not in self._self_timed

            def streaming(requests, context):
                hold(context)
                return inner(self._watched(requests, context, method) if timed else requests,
                             context)
            return same_shape(handler, streaming, handler.request_deserializer)

        inner = handler.unary_unary or handler.unary_stream

        def unary(requests, context):
            hold(context)
            key = self.watchdog.arm(context, method)
            try:
                request = next(requests, None)
            finally:
                self.watchdog.disarm(key)
            if request is None:   # half-closed without one (grpc's own words)
                context.abort(grpc.StatusCode.UNIMPLEMENTED,
                              f'"{method}" requires exactly one request message.')
            return inner(request, context)
        return same_shape(handler, unary, handler.request_deserializer, request_streaming=True)

    def _watched(self, requests: Iterator, context: grpc.ServicerContext,
                 method: str) -> Iterator:
        while True:
            key = self.watchdog.arm(context, method)
            try:
                request = next(requests, None)
            finally:
                self.watchdog.disarm(key)
            if request is None:
                return
            yield request

    def close(self) -> None:
        self.watchdog.close()


#: What a :class:`StreamReader` puts in its inbox: ``(REQUEST, message)`` for each request
#: (or, with ``handle``, ``(STOPPED, why)`` when it refused one), then ``(END, None)`` at the
#: half-close or ``(FAILED, exception)`` (the call was cancelled, or a request's bytes did
#: not parse).
REQUEST, STOPPED, END, FAILED = "request", "stopped", "end", "failed"


class StreamReader:
    """Reads a streaming call's requests on a thread of its own, at most ``ahead`` beyond
    those the handler is done with (:meth:`done`).  grpc's iterator waits for ever; the
    handler waits on ``inbox`` instead, with a deadline, and may put other things there (a
    front's replies).  A stream whose answers are not read stops being read, so HTTP/2
    flow control stops its client.

    Each request goes into ``inbox``, or, given ``handle``, to ``handle`` on the reader's
    thread (a front sends it on while the handler writes earlier answers): ``handle``
    returns None, or why it refused the request, which ends the reading.  :attr:`handled`
    counts the requests ``handle`` took, each counted before it is handed over."""

    def __init__(self, requests: Iterator, inbox: queue.SimpleQueue, ahead: int,
                 handle: Callable[[object], str | None] | None = None):
        self._credits: queue.SimpleQueue = queue.SimpleQueue()   # a token per read allowed
        for _ in range(ahead):
            self._credits.put(None)
        self._closed = False
        self.handled = 0
        threading.Thread(target=self._read, args=(requests, inbox, handle), daemon=True,
                         name="duelq-stream-reader").start()

    def _read(self, requests: Iterator, inbox: queue.SimpleQueue,
              handle: Callable[[object], str | None] | None) -> None:
        try:
            while True:
                self._credits.get()
                if self._closed:
                    return
                request = next(requests, None)
                if request is None:
                    inbox.put((END, None))
                    return
                if handle is None:
                    inbox.put((REQUEST, request))
                    continue
                self.handled += 1
                why = handle(request)
                if why is not None:
                    self.handled -= 1
                    inbox.put((STOPPED, why))
                    return
        except Exception as exc:  # noqa: BLE001 — handed to the handler, which answers it
            inbox.put((FAILED, exc))

    def done(self) -> None:
        """The handler is done with one request: one more may be read."""
        self._credits.put(None)

    def close(self) -> None:
        """Read no more (a read under way ends with the call)."""
        self._closed = True
        self._credits.put(None)
