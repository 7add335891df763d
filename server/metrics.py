"""Prometheus metrics of a duelq server (prometheus-client, the reference exporter).

Counting happens outside the servicer, which stays free of metrics code: in one process,
in a gRPC interceptor; with front processes, in the learner process's relay
(server/fronts/front.py's RelayedService), which sees the same requests.  Either times
every train request from arrival to answer, counts applied steps and transitions (a
replayed idempotent answer is not a step), records the loss, and counts refused rpcs by
method and status code.  Values that live elsewhere (ISV entropy EMAs, checkpoint age,
device memory, the replay buffer) are read when Prometheus scrapes, by a custom
collector.  Each server has its own registry, so several servers in one process (tests)
do not collide.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

from duelq.server.core.learner import Learner

log = logging.getLogger(__name__)

TRAIN_METHODS = ("/duelq.v1.Learner/TrainStep", "/duelq.v1.Learner/TrainStream")
#: Step latency buckets, seconds: 50 µs … 2.5 s.
LATENCY_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25,
                   0.5, 1.0, 2.5)


class Metrics:
    """The metric families of one server, and the interceptor that feeds them."""

    def __init__(self, learner: Callable[[], Learner | None]) -> None:
        self.checkpoint_dir = ""
        """Directory whose newest ``ckpt-*`` file gives the checkpoint age; "" = none."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.steps = Counter("duelq_steps", "Learner steps applied", registry=r)
        self.transitions = Counter("duelq_transitions", "Transitions trained on", registry=r)
        self.step_latency = Histogram(
            "duelq_step_latency_seconds", "Train request latency inside the server, "
            "arrival to answer (queueing included)", buckets=LATENCY_BUCKETS, registry=r)
        self.loss = Gauge("duelq_loss", "Loss of the latest step", registry=r)
        self.refused = Counter("duelq_refused_requests", "Rpcs answered with an error status",
                               ["method", "code"], registry=r)
        self.queue_depth = Gauge("duelq_queue_depth", "Train requests received and not yet "
                                 "answered (waiting for the learner or running)", registry=r)
        self.active_streams = Gauge("duelq_active_streams", "Open TrainStreams", registry=r)
        self.relayed = Counter("duelq_relayed_requests", "Train requests relayed by each front "
                               "process (--front-processes)", ["front"], registry=r)
        r.register(_ScrapeTimeCollector(learner, lambda: self.checkpoint_dir))
        self.interceptor = _MetricsInterceptor(self)
        self._http = None

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Expose /metrics over HTTP; returns the bound port."""
        self._http, _ = start_http_server(port, addr=host, registry=self.registry)
        bound = self._http.server_port
        log.info("metrics on http://%s:%d/metrics", host, bound)
        return bound

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None

    def count_refusal(self, method: str, code: str, count: int = 1) -> None:
        """Count ``count`` rpcs refused before their handler ran (the gate's, or a front's
        refusals)."""
        self.refused.labels(method, code).inc(count)

    def observe_answer(self, response, started: float, answered: float | None = None) -> None:
        """Account one train answer given ``answered`` (default: now) − ``started`` after its
        request arrived (``time.perf_counter()`` clocks)."""
        self.step_latency.observe((time.perf_counter() if answered is None else answered)
                                  - started)
        if not response.replayed:
            self.steps.inc()
            rows = getattr(response, "rows", None)   # an EncodedTrainResponse's
            if rows is None:
                rows = response.td_errors.shape[0] if response.td_errors.shape else 0
            self.transitions.inc(rows)
            self.loss.set(response.loss)


class _ScrapeTimeCollector:
    """Gauges read on scrape: ISV slot values, checkpoint age, device memory."""

    def __init__(self, learner: Callable[[], Learner | None], checkpoint_dir: Callable[[], str]):
        self._learner = learner
        self._checkpoint_dir = checkpoint_dir

    def describe(self):
        return []  # values depend on the learner attached at scrape time

    def collect(self):
        learner = self._learner()
        if learner is not None:
            isv = GaugeMetricFamily("duelq_isv_value", "Value of a named ISV slot (entropy "
                                    "EMAs and the like); NaN until first observed",
                                    labels=["slot"])
            for v in learner.read_isv([]):
                isv.add_metric([v.name], v.value if v.observed else float("nan"))
            yield isv
            step = GaugeMetricFamily("duelq_step", "Steps applied (= weights version)")
            step.add_metric([], learner.step_count)
            yield step
            if learner.backend.name == "cuda":
                yield from _device_memory()
            if learner.replay is not None:
                yield from _replay_figures(learner)
        directory = self._checkpoint_dir()
        if directory:
            newest = max((_mtime(p) for p in Path(directory).glob("ckpt-*")), default=None)
            if newest is not None and newest > float("-inf"):
                age = GaugeMetricFamily("duelq_checkpoint_age_seconds",
                                        "Seconds since the newest checkpoint was written")
                age.add_metric([], max(0.0, time.time() - newest))
                yield age


def _mtime(path: Path) -> float:
    """Modification time, or −inf for a file pruned since it was listed."""
    try:
        return path.stat().st_mtime
    except OSError:
        return float("-inf")


def _replay_figures(learner: Learner):
    """The server-side replay buffer's figures (its steps are in duelq_step, not in
    duelq_steps_total, which counts train answers)."""
    info = learner.replay_info()
    rows = GaugeMetricFamily("duelq_replay_rows", "Rows of the server-side replay buffer",
                             labels=["kind"])
    for kind in ("size", "capacity", "inserted", "sampled"):
        rows.add_metric([kind], getattr(info, kind))
    yield rows
    ratio = GaugeMetricFamily("duelq_replay_ratio", "Rows sampled per row inserted")
    ratio.add_metric([], info.ratio)
    yield ratio


def _device_memory():
    import cupy
    free, total = cupy.cuda.runtime.memGetInfo()
    used = GaugeMetricFamily("duelq_device_memory_bytes", "GPU memory", labels=["kind"])
    used.add_metric(["used"], total - free)
    used.add_metric(["total"], total)
    used.add_metric(["pool_used"], cupy.get_default_memory_pool().used_bytes())
    yield used


class _MetricsInterceptor(grpc.ServerInterceptor):
    """Wraps every handler to time train requests and count refusals."""

    def __init__(self, metrics: Metrics):
        self.m = metrics

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None:
            return None
        method = details.method
        train = method in TRAIN_METHODS
        name = method.rsplit("/", 1)[-1]
        m = self.m

        def refused(context, exc: Exception) -> None:
            code = context.code()
            m.refused.labels(name, code.name if isinstance(code, grpc.StatusCode)
                             else type(exc).__name__).inc()

        if handler.unary_unary:
            inner = handler.unary_unary

            def behaviour(request, context):
                started = time.perf_counter()
                if train:
                    m.queue_depth.inc()
                try:
                    response = inner(request, context)
                except Exception as exc:
                    refused(context, exc)
                    raise
                finally:
                    if train:
                        m.queue_depth.dec()
                if train:
                    m.observe_answer(response, started)
                return response
            return grpc.unary_unary_rpc_method_handler(
                behaviour, handler.request_deserializer, handler.response_serializer)

        if handler.stream_stream and train:
            inner_stream = handler.stream_stream

            def stream(request_iterator, context) -> Iterator:
                arrivals: list[float] = []   # arrival times of unanswered requests, in order
                lock = threading.Lock()

                def timed_requests():
                    for request in request_iterator:
                        with lock:
                            arrivals.append(time.perf_counter())
                        m.queue_depth.inc()
                        yield request

                m.active_streams.inc()
                try:
                    for response in inner_stream(timed_requests(), context):
                        with lock:
                            started = arrivals.pop(0)
                        m.queue_depth.dec()
                        m.observe_answer(response, started)
                        yield response
                except Exception as exc:
                    refused(context, exc)
                    raise
                finally:
                    m.queue_depth.dec(len(arrivals))
                    m.active_streams.dec()
            return grpc.stream_stream_rpc_method_handler(
                stream, handler.request_deserializer, handler.response_serializer)

        if handler.stream_stream:   # InsertStream: its refusals only
            inner_other = handler.stream_stream

            def counted(request_iterator, context) -> Iterator:
                try:
                    yield from inner_other(request_iterator, context)
                except Exception as exc:
                    refused(context, exc)
                    raise
            return grpc.stream_stream_rpc_method_handler(
                counted, handler.request_deserializer, handler.response_serializer)
        return handler
