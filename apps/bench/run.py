"""The bench plan, its cells, the off-line codec costs and :func:`run_bench`."""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import grpc
import numpy as np

from duelq.client.client import (LearnerClient, _train_result, _transition_arrays,
                                 _wire_request, encode_batch, encode_batch_wire)
from duelq.client import errors as client_errors
from duelq.v1 import learner_pb2 as pb
from duelq.wire.tensors import INSERT_FIELDS

from duelq.server.core.batch import validate_batch
from duelq.server.core.config import LearnerConfig
from duelq.server.core.learner import Learner, StepResult, make_backend
from duelq.server.fronts import make_server, start_server
from duelq.server.server import LearnerServer, ServerOptions, tune_malloc
from duelq.server.service import decode_batch, train_response
from duelq.server.core.state import LearnerState
from duelq.apps.bench.actors import ActorPool, make_batch, make_transitions
from duelq.apps.bench.base import (EXIT_FAILURE, EXIT_OK, EXIT_USAGE, TRANSPORTS, WIRES, BenchError, UsageError,
                   cpu_seconds)
from duelq.apps.bench.report import add_ratios, percentile_ms, plot, report
from duelq.apps.bench.servers import (TUNED_OPTIONS, AioEchoServer, EchoProcesses, EchoServer, NullBackend,
                      ServerClock,
                      ServerProcess, TimedBackend, TimedLock)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Cell:
    """One measurement: ``actors`` processes driving one kind of call for ``duration``."""

    section: str      # "main" (by batch size), "scaling" (by actors) or "experiment"
    kind: str         # "echo" | "stream" | "unary" | "replay" (inserts; the server trains)
    backend: str      # "echo" for the byte stream, else the learner's backend
    batch: int        # B
    wire: str         # feature dtype on the wire (echo: the one whose message size it copies)
    transport: str    # "tcp" | "uds" | "target"
    actors: int
    variant: str = ""  # experiments: "aio" (echo server on grpc.aio), "tuned" (channel
    #                   args), "malloc" (tune_malloc() in servers and actors)

    @property
    def label(self) -> str:
        v = f" {self.variant}" if self.variant else ""
        return (f"{self.kind}/{self.backend}{v} B={self.batch} {self.wire} "
                f"{self.transport} K={self.actors}")


@dataclass(frozen=True)
class Plan:
    """The flags of one run, checked."""

    batch_sizes: tuple[int, ...]
    actors: int
    scaling_actors: tuple[int, ...]
    scaling_batch: int
    transports: tuple[str, ...]
    wires: tuple[str, ...]
    duration: float
    warmup: float
    window: int
    echo_processes: int
    experiments: bool
    replay: bool
    device_step: bool
    target: str
    out: Path
    quick: bool

    @staticmethod
    def from_args(args: argparse.Namespace) -> "Plan":
        def ints(name: str) -> tuple[int, ...]:
            text = getattr(args, name)
            try:
                values = tuple(int(x) for x in text.split(",") if x.strip())
            except ValueError:
                raise UsageError(f"--{name.replace('_', '-')}: {text!r} is not a "
                                 f"comma-separated list of integers") from None
            if not values or min(values) < 1:
                raise UsageError(f"--{name.replace('_', '-')}: needs integers ≥ 1")
            return values

        def names(name: str, allowed: Sequence[str]) -> tuple[str, ...]:
            values = tuple(x.strip() for x in getattr(args, name).split(",") if x.strip())
            bad = [v for v in values if v not in allowed]
            if not values or bad:
                raise UsageError(f"--{name.replace('_', '-')}: choose from {','.join(allowed)}"
                                 f" (got {getattr(args, name)!r})")
            return tuple(dict.fromkeys(values))

        plan = Plan(batch_sizes=ints("batch_sizes"), actors=args.actors,
                    scaling_actors=ints("scaling_actors") if args.scaling_actors else (),
                    scaling_batch=args.scaling_batch, transports=names("transports", TRANSPORTS),
                    wires=names("wire_dtypes", WIRES), duration=args.duration,
                    warmup=args.warmup, window=args.window,
                    echo_processes=args.echo_processes, experiments=args.experiments,
                    replay=args.replay_cells,
                    device_step=args.device_step, target=args.target, out=Path(args.out),
                    quick=args.quick)
        if plan.quick:
            plan = replace(plan, batch_sizes=(256,), actors=1, scaling_actors=(1, 2),
                           scaling_batch=256, duration=0.25, warmup=0.1, experiments=False,
                           wires=tuple(w for w in plan.wires if w != "float16") or ("float32",))
        for name in ("actors", "window", "scaling_batch", "echo_processes"):
            if getattr(plan, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')}: must be ≥ 1")
        if plan.duration <= 0 or plan.warmup < 0:
            raise UsageError("--duration must be > 0 and --warmup ≥ 0")
        if "float32" not in plan.wires:
            plan = replace(plan, wires=("float32",) + plan.wires)  # the ceiling's reference
        if plan.target:
            plan = replace(plan, transports=("target",))
        return plan

    def cells(self, backend: str, in_process: bool) -> list[Cell]:
        """Every cell of the run, in the order they are measured."""
        cells: list[Cell] = []
        half = [w for w in self.wires if w != "float32"]
        main_transport = self.transports[0]
        learners = [backend] + (["null"] if in_process else [])
        for B in self.batch_sizes:
            cell = lambda kind, be, wire: Cell("main", kind, be, B, wire,  # noqa: E731
                                               main_transport, self.actors)
            cells.append(cell("echo", "echo", "float32"))
            if half:
                cells.append(cell("echo", "echo", half[0]))  # float16, bfloat16: same size
            for be in learners:
                cells += [cell("stream", be, w) for w in self.wires]
            if self.replay:   # right after the stream cells they are compared with
                cells += [cell("replay", backend, w) for w in self.wires]
            cells.append(cell("unary", backend, "float32"))
        B = self.scaling_batch
        for K in self.scaling_actors:
            for transport in self.transports:
                for kind, be in [("echo", "echo")] + [("stream", be) for be in learners]:
                    cells.append(Cell("scaling", kind, be, B, "float32", transport, K))
        if self.experiments and in_process:
            B = 1024 if 1024 in self.batch_sizes else self.batch_sizes[len(self.batch_sizes) // 2]
            for variant in ("aio", "tuned", "malloc"):
                cells.append(Cell("experiment", "echo", "echo", B, "float32", "tcp", self.actors,
                                  variant))
            for variant in ("tuned", "malloc"):
                cells.append(Cell("experiment", "stream", "null", B, "float32", "tcp",
                                  self.actors, variant))
        # One ceiling per (B, message size, transport, actors, variant): drop duplicates.
        return list(dict.fromkeys(cells))


def sample_messages(config: LearnerConfig, B: int, wire: str):
    """(batch, TrainRequest as an actor sends it, StepResult, TrainResponse as answered)."""
    batch = make_batch(np.random.default_rng(B), B, config.hidden_dim, config.n_actions, wire)
    key = pb.RequestKey(actor_id=f"bench-0-{os.getpid()}-{time.monotonic_ns()}", seq=123456)
    request = encode_batch(batch, feature_dtype=wire)
    request.key.CopyFrom(key)
    td = np.random.default_rng(0).standard_normal(B).astype(np.float32)
    result = StepResult(loss=1.0, td_errors=td, priorities=np.abs(td), q_taken_mean=0.5,
                        grad_norm=2.0, step=123456, entropy=None)
    return batch, request, result, pb.TrainResponse.FromString(
        train_response(result, key.SerializeToString()).SerializeToString())


def _median_us(fn: Callable[[], Any], reps: int) -> float:
    fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(samples)


def codec_costs(config: LearnerConfig, B: int, wire: str, reps: int = 20) -> dict:
    """Off-line µs per step of each phase outside the backend, on this machine."""
    batch, request, result, response = sample_messages(config, B, wire)
    data, reply = request.SerializeToString(), response.SerializeToString()
    parsed = pb.TrainRequest.FromString(data)
    decoded = decode_batch(parsed)
    key = request.key.SerializeToString()
    return {
        "request_bytes": len(data), "response_bytes": len(reply),
        # What LearnerClient does per batch: checks and the wire bytes, one copy of the data.
        "client_encode_us": _median_us(lambda: encode_batch_wire(
            batch, feature_dtype=wire, actor_id=request.key.actor_id, seq=request.key.seq), reps),
        # The protobuf way, for comparison: build the message, then serialise it.
        "client_protobuf_encode_us": _median_us(
            lambda: encode_batch(batch, feature_dtype=wire).SerializeToString(), reps),
        "server_parse_us": _median_us(lambda: pb.TrainRequest.FromString(data), reps),
        "server_decode_us": _median_us(lambda: decode_batch(parsed), reps),
        "server_validate_us": _median_us(lambda: validate_batch(decoded, config, 1 << 30), reps),
        "server_encode_us": _median_us(lambda: train_response(result, key), reps),
        "client_decode_us": _median_us(lambda: _train_result(response), reps),
    }


REPLAY_RATIO = 8.0        # the bench's replay_ratio unless --replay-ratio sets one
REPLAY_CAPACITY = 1 << 16  # rows, unless --replay-capacity sets more


def replay_config(config: LearnerConfig, B: int) -> LearnerConfig:
    """``config`` with the replay buffer the bench's replay cells of batch size B use:
    replay_batch_size B, replay_min_size B, replay_ratio (8 unless set), capacity (2^16
    rows or 4 B, unless set)."""
    return replace(config, replay_capacity=config.replay_capacity or max(REPLAY_CAPACITY, 4 * B),
                   replay_batch_size=B, replay_min_size=B,
                   replay_ratio=config.replay_ratio or REPLAY_RATIO)


def insert_sizes(config: LearnerConfig, B: int, wire: str) -> dict:
    """Bytes of an InsertStreamRequest of B rows as an actor sends it, and of its answer."""
    rows = make_transitions(np.random.default_rng(B), B, config.hidden_dim, config.n_actions,
                            wire)
    key = pb.RequestKey(actor_id=f"bench-0-{os.getpid()}-{time.monotonic_ns()}", seq=123456)
    data = _wire_request(_transition_arrays(rows, wire), key.actor_id, key.seq, INSERT_FIELDS)
    reply = pb.InsertStreamResponse(rows=B, size=1 << 16, inserted=1 << 24, version=1 << 20,
                                    step=1 << 20, key=key)
    return {"request_bytes": len(data), "response_bytes": reply.ByteSize()}


class _Window:
    """Reads the replay buffer's counters at the start and the end of a measured window."""

    def __init__(self, read: Callable[[], Any]):
        self.read, self.values, self.thread = read, [], None
        self.error: Exception | None = None

    def start(self, t0: float, t_end: float) -> None:
        def run():
            try:
                for t in (t0, t_end):
                    while (left := t - time.monotonic()) > 0:
                        time.sleep(min(left, 0.05))
                    self.values.append(self.read())
            except Exception as exc:  # noqa: BLE001 — the cell reports it
                self.error = exc
        self.thread = threading.Thread(target=run, name="duelq-bench-window", daemon=True)
        self.thread.start()

    def result(self) -> tuple[Any, Any]:
        if self.thread is not None:
            self.thread.join()
        if self.error is not None:
            raise BenchError(f"cannot read the replay counters: {self.error}")
        if len(self.values) != 2:
            raise BenchError("the replay counters were not read over the window")
        return self.values[0], self.values[1]


def replay_due(info) -> int:
    """Steps replay_ratio still asks for, from GetReplayInfo's figures."""
    if not info.target_ratio or info.size < info.min_size:
        return 0
    return max(0, int((info.target_ratio * info.inserted - info.sampled) // info.batch_size))


class Bench:
    """Servers in this process, actors in others; measures the plan's cells."""

    def __init__(self, plan: Plan, config: LearnerConfig, options: ServerOptions,
                 backend: str, ready_timeout: float):
        self.plan, self.config, self.options = plan, config, options
        self.ready_timeout = ready_timeout
        self.tmp = Path(tempfile.mkdtemp(prefix="duelq-bench-"))
        self.sizes: dict[tuple[int, str], dict] = {}
        self.learners: dict[str, Learner] = {}
        self.server: LearnerServer | None = None
        self.clock = ServerClock()
        self.lock: TimedLock | None = None
        self.echo: dict[str, Any] = {}
        self.targets: dict[tuple[str, str], str] = {}   # (server, transport) → target
        self.pool: ActorPool | None = None
        self.malloc_pool: ActorPool | None = None     # actors that called tune_malloc()
        self.malloc_server: ServerProcess | None = None
        self.backend_name = backend
        self.backend_arg = backend
        self.device = ""
        self.replay_info = None    # a target's replay buffer (GetReplayInfo), None if off
        self.replay_learner: tuple[int, Learner] | None = None   # in-process, by B
        self.notes: list[str] = []
        self._client: LearnerClient | None = None

    # servers

    def start(self, backend: str) -> None:
        plan = self.plan
        addresses = {"tcp": "127.0.0.1:0", "uds": f"unix://{self.tmp}/{{name}}.sock"}
        if not plan.target:
            self.server = make_server(self.options, interceptors=(self.clock,))
            if "uds" in plan.transports:
                uds = addresses["uds"].format(name="learner")
                grpc_server = getattr(self.server, "_server", None)
                if grpc_server is None:
                    raise BenchError("LearnerServer has no _server to add a UDS listener to")
                grpc_server.add_insecure_port(uds)   # bench only: serve has no UDS flag yet
                self.targets["learner", "uds"] = uds
            self.server.start()
            self.targets["learner", "tcp"] = self.server.target
            state = LearnerState.initial(self.config)
            main = make_backend(backend, self.config, state)
            self.backend_name, self.device = main.name, main.device
            for be in (main, NullBackend(self.config, state)):
                self.learners[be.name] = Learner(self.config, backend=TimedBackend(be),
                                                 max_batch_size=self.options.max_batch_size)
            self.server.attach(self.learners[main.name])
            lock = getattr(self.server.service, "_apply_lock", None)
            if lock is not None:
                self.lock = TimedLock(lock)
                self.server.service._apply_lock = self.lock
        else:
            self.targets["learner", "target"] = plan.target
            with LearnerClient(plan.target, token=self.options.bearer_token() or None) as client:
                client.wait_ready(self.ready_timeout)
                info = client.info()
                try:
                    self.replay_info = client.replay_info()
                except client_errors.DuelqError:   # FAILED_PRECONDITION: the buffer is off
                    self.replay_info = None
            self.backend_name, self.device = info.backend, info.device
            if (info.hidden_dim, info.n_actions) != (self.config.hidden_dim,
                                                                    self.config.n_actions):
                raise UsageError(f"--target serves H={info.hidden_dim}, "
                                 f"N={info.n_actions}; pass --hidden-dim and --n-actions")
        sync = (EchoServer if plan.echo_processes == 1 else
                functools.partial(EchoProcesses, count=plan.echo_processes))
        self._start_echo("sync", sync, (), addresses)

    def _start_echo(self, name: str, kind, extra, addresses) -> None:
        transports = [t for t in self.plan.transports if t != "target"] or ["tcp"]
        wanted = [addresses[t].format(name=f"echo-{name}") for t in transports]
        server = kind(self.options, wanted, extra)
        self.echo[name] = server
        for transport, address, port in zip(transports, wanted, server.ports):
            self.targets[f"echo-{name}", transport] = (
                f"127.0.0.1:{port}" if transport == "tcp" else address)
        if self.plan.target:
            self.targets[f"echo-{name}", "target"] = self.targets[f"echo-{name}", "tcp"]

    def echo_target(self, cell: Cell) -> str:
        name = {"aio": "aio", "tuned": "tuned"}.get(cell.variant, "sync")
        if name not in self.echo:
            addresses = {"tcp": "127.0.0.1:0", "uds": f"unix://{self.tmp}/{{name}}.sock"}
            kind = AioEchoServer if name == "aio" else EchoServer
            self._start_echo(name, kind, TUNED_OPTIONS if name == "tuned" else (), addresses)
        return self.targets[f"echo-{name}", cell.transport]

    def replay_cells(self, cells: list[Cell]) -> list[Cell]:
        """``cells`` less the replay cells this server cannot run, each skip noted: a
        target (or the fronts the bench started) runs them only with a replay buffer, at
        its replay_batch_size, in wires its buffer takes."""
        if self.server is not None or not any(c.kind == "replay" for c in cells):
            return cells
        info = self.replay_info
        if info is None:
            self.notes.append("replay cells skipped: the server has no replay buffer "
                              "(GetReplayInfo: FAILED_PRECONDITION; serve it with "
                              "--replay-capacity)")
            return [c for c in cells if c.kind != "replay"]
        keep = [c for c in cells if c.kind != "replay" or (
            c.batch == info.batch_size and info.dtype in ("float32", c.wire))]
        if len(keep) < len(cells):
            self.notes.append(f"replay cells run at the server's replay_batch_size "
                              f"{info.batch_size} only, in wires its {info.dtype} buffer "
                              f"takes; the others skipped")
        return keep

    def _attach(self, learner: Learner) -> None:
        """Serve ``learner`` in-process, the previous one's replay loop stopped."""
        server = self.server
        if server.replay_loop is not None:
            server.replay_loop.stop()
            server.replay_loop = None
            server.service.on_insert = None
        server.attach(learner)

    def _replay_learner(self, B: int) -> Learner:
        if self.replay_learner is None or self.replay_learner[0] != B:
            self.replay_learner = None   # one buffer at a time
            config = replay_config(self.config, B)
            state = LearnerState.initial(config)
            learner = Learner(config, backend=make_backend(self.backend_arg, config, state),
                              max_batch_size=self.options.max_batch_size)
            self.replay_learner = (B, learner)
        return self.replay_learner[1]

    def client(self, transport: str) -> LearnerClient:
        """The coordinator's own client of the learner (replay counters)."""
        if self._client is None:
            self._client = LearnerClient(self.targets["learner", transport],
                                         token=self.options.bearer_token() or None,
                                         actor_id=f"bench-coordinator-{os.getpid()}")
        return self._client

    def drain_replay(self, client: LearnerClient, timeout: float = 30.0) -> None:
        """Wait until the server has run the replay steps that its ratio still asks for,
        so that they do not land in the next cell's window."""
        deadline, last, since = time.monotonic() + timeout, None, time.monotonic()
        while time.monotonic() < deadline:
            info = client.replay_info()
            if replay_due(info) == 0:
                return
            if info.sampled != last:
                last, since = info.sampled, time.monotonic()
            elif time.monotonic() - since > 2.0:   # refused steps: it waits for new rows
                return
            time.sleep(0.02)
        log.warning("the replay steps due were not all run within %g s", timeout)

    def stop(self) -> None:
        if self._client is not None:
            self._client.close()
        for pool in (self.pool, self.malloc_pool):
            if pool is not None:
                pool.close()
        if self.malloc_server is not None:
            self.malloc_server.stop()
        for server in self.echo.values():
            server.stop()
        if self.server is not None:
            self.server.stop(0)
        shutil.rmtree(self.tmp, ignore_errors=True)

    # cells

    def size(self, B: int, wire: str) -> dict:
        if (B, wire) not in self.sizes:
            self.sizes[B, wire] = codec_costs(self.config, B, wire)
        return self.sizes[B, wire]

    def _server_totals(self, backend: str) -> dict:
        totals = self.clock.snapshot()
        totals["backend_s"] = self.learners[backend].backend.seconds
        totals["backend_cpu_s"] = self.learners[backend].backend.cpu_seconds
        totals["wait_s"] = self.lock.wait_s if self.lock is not None else 0.0
        return totals

    def measure(self, cell: Cell) -> dict:
        if cell.kind == "replay":
            return self.measure_replay(cell)
        plan = self.plan
        size = self.size(cell.batch, cell.wire)
        job = {"kind": cell.kind, "batch": cell.batch, "wire": cell.wire,
               "hidden_dim": self.config.hidden_dim, "n_actions": self.config.n_actions,
               "window": 1 if cell.kind == "unary" else plan.window,
               "request_bytes": size["request_bytes"], "reply_bytes": size["response_bytes"],
               "max_message_bytes": self.options.max_message_bytes, "seed": 7,
               "channel_options": TUNED_OPTIONS if cell.variant == "tuned" else (),
               "tune_malloc": cell.variant == "malloc",
               "token": self.options.bearer_token(), "ready_timeout": self.ready_timeout}
        pool, server_cpu_seconds = self.pool, cpu_seconds
        if cell.variant == "malloc":   # servers and actors in processes of their own
            if self.malloc_server is None:
                self.malloc_server = ServerProcess(self.config, self.options, tune=True)
                self.malloc_pool = ActorPool(self.plan.actors)
            job["target"] = self.malloc_server.targets["echo" if cell.kind == "echo"
                                                       else "learner"]
            pool, server_cpu_seconds = self.malloc_pool, self.malloc_server.cpu_seconds
        elif cell.kind == "echo":
            job["target"] = self.echo_target(cell)
        else:
            job["target"] = self.targets["learner", cell.transport]
            if self.server is not None:
                self._attach(self.learners[cell.backend])
        before = (self._server_totals(cell.backend)
                  if self.learners and cell.kind != "echo" and cell.variant != "malloc" else None)
        cpu = server_cpu_seconds()
        reports = pool.run([dict(job) for _ in range(cell.actors)], plan.warmup, plan.duration)
        server_cpu = server_cpu_seconds() - cpu   # the servers' process (coordinator idle)
        answers = sum(r["answers"] for r in reports) or 1
        latencies = [x for r in reports for x in r["latencies"]]
        steps_per_s = len(latencies) / plan.duration
        row = {**asdict(cell), "request_bytes": size["request_bytes"],
               "response_bytes": size["response_bytes"], "answers": len(latencies),
               "steps_per_s": steps_per_s, "transitions_per_s": steps_per_s * cell.batch,
               "mb_per_s": steps_per_s * size["request_bytes"] / 1e6,
               "p50_ms": percentile_ms(latencies, 50), "p99_ms": percentile_ms(latencies, 99),
               "client_cpu_us": 1e6 * sum(r["cpu_s"] for r in reports) / answers,
               # A remote learner's CPU is not ours to read (the echo server is local).
               "server_cpu_us": (None if self.server is None and cell.kind != "echo"
                                 else 1e6 * server_cpu / answers)}
        if before is not None:
            after = self._server_totals(cell.backend)
            n = after["requests"] - before["requests"]
            if n:
                us = {k: 1e6 * (after[k] - before[k]) / n for k in after if k.endswith("_s")}
                row["server_us"] = {   # wall µs per request, and thread-CPU µs ("cpu_…")
                    **{k[:-2]: v for k, v in us.items()}, "requests": n,
                    "overhead_wall": us["parse_s"] + us["handler_s"] - us["backend_s"]
                    - us["wait_s"] + us["serialize_s"],
                    "overhead": us["parse_cpu_s"] + us["handler_cpu_s"] - us["backend_cpu_s"]
                    + us["serialize_cpu_s"]}
        return row

    def measure_replay(self, cell: Cell) -> dict:
        """Actors stream inserts of B rows; the server trains from its buffer to hold its
        replay ratio.  Learner steps and rows inserted come from the buffer's counters read
        at the window's start and end."""
        plan = self.plan
        size = insert_sizes(self.config, cell.batch, cell.wire)
        if self.server is not None:
            self._attach(self._replay_learner(cell.batch))
        job = {"kind": "replay", "batch": cell.batch, "wire": cell.wire,
               "hidden_dim": self.config.hidden_dim, "n_actions": self.config.n_actions,
               "window": plan.window, "request_bytes": size["request_bytes"],
               "reply_bytes": size["response_bytes"],
               "max_message_bytes": self.options.max_message_bytes, "seed": 7,
               "channel_options": (), "tune_malloc": False,
               "token": self.options.bearer_token(), "ready_timeout": self.ready_timeout,
               "target": self.targets["learner", cell.transport]}
        client = self.client(cell.transport)
        try:
            self.drain_replay(client)
            window = _Window(client.replay_info)
            first, cpu = client.replay_info(), cpu_seconds()
            reports = self.pool.run([dict(job) for _ in range(cell.actors)], plan.warmup,
                                    plan.duration, on_go=window.start)
            server_cpu, last = cpu_seconds() - cpu, client.replay_info()
            before, after = window.result()
            self.drain_replay(client)
        except client_errors.DuelqError as exc:
            raise BenchError(f"replay counters: {exc}") from exc
        latencies = [x for r in reports for x in r["latencies"]]
        B = after.batch_size
        steps = (after.sampled - before.sampled) / B
        rows_in = after.inserted - before.inserted
        inserts = rows_in / cell.batch
        wire_bytes = inserts * size["request_bytes"]
        # CPU is counted over the whole run, warm-up included, and so are its steps here.
        run_steps = (last.sampled - first.sampled) / B
        per_step = (lambda x: 1e6 * x / run_steps) if run_steps else (lambda x: None)  # noqa: E731
        steps_per_s = steps / plan.duration
        return {**asdict(cell), "request_bytes": size["request_bytes"],
                "response_bytes": size["response_bytes"], "answers": len(latencies),
                "steps_per_s": steps_per_s, "transitions_per_s": steps_per_s * B,
                "mb_per_s": wire_bytes / plan.duration / 1e6,
                "p50_ms": percentile_ms(latencies, 50), "p99_ms": percentile_ms(latencies, 99),
                # CPU per learner step: the actors' and (in-process) the server's.
                "client_cpu_us": per_step(sum(r["cpu_s"] for r in reports)),
                "server_cpu_us": None if self.server is None else per_step(server_cpu),
                "replay_batch": B, "replay_ratio": after.target_ratio,
                "learner_steps": steps, "inserted_rows_per_s": rows_in / plan.duration,
                "inserts_per_s": inserts / plan.duration,
                "ratio_measured": ((after.sampled - before.sampled) / rows_in
                                   if rows_in else None),
                "wire_bytes_per_step": wire_bytes / steps if steps else None}

    def run(self, cells: list[Cell], progress, rows: list[dict],
            after_each: Callable[[], Any]) -> list[str]:
        """Measure ``cells`` in order, appending to ``rows``; the failures."""
        failures = []
        self.pool = ActorPool(max(c.actors for c in cells))
        for cell in progress(cells):
            log.info("measuring %s", cell.label)
            try:
                row = self.measure(cell)
            except BenchError as exc:
                log.error("%s: %s", cell.label, exc)
                failures.append(f"{cell.label}: {exc}")
                rows.append({**asdict(cell), "error": str(exc)})
                after_each()
                if "did not answer" in str(exc) or "died" in str(exc):
                    break   # the pool is out of step with the plan: stop here
                continue
            rows.append(row)
            after_each()
            log.info("%s: %.0f steps/s, p50 %.2f ms", cell.label, row["steps_per_s"],
                     row["p50_ms"] or float("nan"))
        return failures


def device_step(sizes: Sequence[int], config: LearnerConfig) -> dict:
    """Device µs per step vs PyTorch eager and CUDA graph, from benchmarks/device_step.py."""
    here = Path(__file__).resolve().parents[1] / "benchmarks" / "device_step.py"
    path = next((p for p in (here, Path.cwd() / "benchmarks" / "device_step.py") if p.exists()),
                None)
    if path is None:
        return {"skipped": "benchmarks/device_step.py not found (run from a duelq checkout)"}
    if (config.hidden_dim, config.n_actions) != (128, 11):
        return {"skipped": "benchmarks/device_step.py times H=128, N=11 only"}
    spec = importlib.util.spec_from_file_location("duelq_device_step", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        import torch
        torch.cuda.init()
    except ImportError:
        torch = None
    timer = module.Timer(20, 30)
    rng = np.random.default_rng(0)
    rows = [module.bench_step(B, timer, torch, rng) for B in sizes]
    return {"source": str(path), "torch": torch.__version__ if torch else None, "rows": rows}


def machine() -> dict:
    from importlib import metadata
    return {"platform": platform.platform(), "cpu": _cpu_name(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "grpcio": grpc.__version__,
            "protobuf": metadata.version("protobuf"), "numpy": np.__version__}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def run_bench(args: argparse.Namespace, config: LearnerConfig, options: ServerOptions,
              argv: Sequence[str] | None = None) -> int:
    """``duelq bench``; returns the exit code."""
    try:
        plan = Plan.from_args(args)
    except UsageError as exc:
        print(f"duelq: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    from tqdm import tqdm

    plan.out.mkdir(parents=True, exist_ok=True)
    # The servers the bench starts are its own: no checkpoints (never the user's), no
    # metrics port, no TLS (its actors speak plaintext); a token, from either source, is
    # kept and sent.
    options = replace(options, checkpoint_dir="", metrics_port=0, tls_cert="", tls_key="",
                      tls_client_ca="")
    front = options.front_processes and not plan.target   # that server, benched as a target
    server_label = (f"a front-process server with {options.front_processes} front(s), "
                    "started by the bench" if front else
                    "remote" if plan.target else "in-process")
    if front:
        options = replace(options, host="127.0.0.1", port=0)
        tune_malloc()   # its processes run as `duelq serve` runs them (the actors too)
    fronts: LearnerServer | None = None
    bench: Bench | None = None
    started = time.time()
    failures: list[str] = []
    rows: list[dict] = []
    device: dict = {"skipped": "the backend is not cuda"}

    def result(partial: bool) -> dict:
        """Everything measured so far; written after each cell, so a killed run leaves data."""
        add_ratios(rows)
        out = {
            "meta": {**machine(), "backend": bench.backend_name, "device": bench.device or "?",
                     "target": plan.target or "in-process",
                     "server": server_label,
                     "hidden_dim": config.hidden_dim,
                     "n_actions": config.n_actions, "actors": plan.actors,
                     "batch_sizes": list(plan.batch_sizes), "scaling_batch": plan.scaling_batch,
                     "window": plan.window, "echo_processes": plan.echo_processes,
                     "replay_cells": plan.replay,
                     "duration_s": plan.duration,
                     "warmup_s": plan.warmup, "quick": plan.quick, "partial": partial,
                     "argv": list(argv) if argv is not None else sys.argv[1:],
                     "env": {k: v for k, v in os.environ.items()
                             if k.startswith(("OPENBLAS_", "OMP_", "MKL_", "MALLOC_"))},
                     "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
                     "wall_s": round(time.time() - started, 1)},
            "rows": rows, "codec_us": {f"{B}/{w}": c for (B, w), c in bench.sizes.items()},
            "device_step": device, "notes": bench.notes if bench is not None else [],
            "failures": failures}
        (plan.out / "bench.json").write_text(json.dumps(out, indent=1))
        return out

    try:
        try:
            if front:   # with a replay buffer for the replay cells at the first B
                fronts = start_server(replay_config(config, plan.batch_sizes[0])
                                      if plan.replay else config, options,
                                      backend=args.backend)
                plan = replace(plan, target=fronts.target, transports=("target",))
            bench = Bench(plan, config, options, args.backend, args.ready_timeout)
            bench.start(args.backend)
        except UsageError as exc:
            print(f"duelq: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        except Exception as exc:  # noqa: BLE001 — cannot bind, no usable backend, no target
            log.error("cannot start the bench: %s", exc)
            return EXIT_FAILURE
        cells = bench.replay_cells(plan.cells(bench.backend_name,
                                              in_process=bench.server is not None))
        progress = lambda cells: tqdm(cells, desc="duelq bench", unit="cell",  # noqa: E731
                                      file=sys.stderr, disable=None)
        failures += bench.run(cells, progress, rows, lambda: result(partial=True))
        if bench.backend_name == "cuda" and plan.device_step:
            for server in (bench.server, fronts):   # the GPU to the device benchmark alone
                if server is not None:
                    server.stop(0)
            bench.server = fronts = None
            try:
                device = device_step(plan.batch_sizes, config)
            except Exception as exc:  # noqa: BLE001 — reported, the rest still written
                log.exception("device step benchmark failed")
                device = {"error": f"{type(exc).__name__}: {exc}"}
                failures.append(f"device step: {exc}")
        elif bench.backend_name == "cuda":
            device = {"skipped": "--no-device-step"}
    finally:
        try:
            if bench is not None:
                bench.stop()
        finally:
            if fronts is not None:
                fronts.stop(0)

    final = result(partial=False)
    try:
        plot(final, plan.out / "bench.png")
    except Exception as exc:  # noqa: BLE001 — the JSON is written; say what failed
        log.exception("cannot draw the plot")
        failures.append(f"plot: {exc}")
        result(partial=False)
    print(report(final))
    print(f"\nwrote {plan.out / 'bench.json'} and {plan.out / 'bench.png'} "
          f"in {time.time() - started:.0f} s")
    if failures:
        print(f"duelq bench: {len(failures)} failure(s): " + "; ".join(failures),
              file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK
