"""The learner process's relay at full speed: several front processes, no gRPC.

    python3 benchmarks/relay_path.py [--backend cuda|reference|null] [--fronts 4]
        [--streams 2] [--window 8] [--batch 1024] [--duration 5] [--host-calls …] [--parts]
        [--driver-calls] [--unpacked] [--plain-copies] [--no-lane]

This process plays a ``--front-process`` server's learner process: the service on
``--backend`` behind a RelayLearner (its one thread reads every front, prepares, steps and
replies), each front's slot pool page-locked on cuda.  Each of ``--fronts`` child processes
plays a front with the real RelayFront: ``--streams`` TrainStreams that keep ``--window``
requests in flight, every request with a key of its own (B = ``--batch`` float32), packed
into its slot as the server's fronts pack them (server/packing.py; ``--unpacked``: the
request's bytes as they came, as before round 13), the large arrays with non-temporal
stores as the server's fronts write them since round 16 (``--plain-copies``: cached ones).  With
no gRPC and no actors, what is left is the relay and the learner's own work, under the
same thread as in the server.  The fronts build each request with one
copy of its body (``b"".join``): until round 9 they chained ``+``, whose 1 MB temporaries
made glibc return memory and fault it in again on every request, so one front carried
≈ 1000 steps/s instead of ≈ 5000 and the fronts, not the learner, set the pace.  Reports steps/s
and this process's CPU per step over ``--duration`` seconds after a 0.5 s warm-up, with the
relay thread's part of it (its CPU-time clock) and, of that, the step's device wait (cuda's
sync spins): the rest is the learner's host work per request as the server runs it, the
figure issue 5's overhead goal is about.  Set it against
benchmarks/learner_path.py's one-thread figure.  ``--backend null`` steps with no
arithmetic and leaves the values unchecked on the host, as cuda does (its kernel checks
them): the service and relay alone.  ``--parts`` also times the relay thread's parts
(frames read, prepare, step, reply, the answer's bookkeeping) in thread CPU time, by
wrapping those methods of the RelayLearner, at two clock reads (system calls) each, and
counts the reads of a front's socket per request.
``--driver-calls`` (cuda, host calls in C) builds server/native.c with a clock around each
driver call and reports each one's wall µs per step (the sync's is the device wait).
On cuda with host calls in C the relay runs with its fast lane, as the server does
(server/lane.c; the share of requests it answered is printed); ``--no-lane`` leaves every
request to the Python relay, as before round 17 (``--parts`` times that one's methods).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import threading
import time

import numpy as np

WARMUP_S = 0.5
SLOTS = 16            # per front, as --relay-slots's default
BODIES = 8            # distinct batches a front's requests cycle through


def _front(args: argparse.Namespace) -> None:
    """A front process: --streams streams over the relay until the run's end; prints the
    answers it got as JSON."""
    from duelq.client.client import encode_batch_wire
    from duelq.client.tensors import varint
    from duelq.server.bench.actors import make_batch
    from duelq.server.config import LearnerConfig
    from duelq.server.native import stream_copy
    from duelq.server.packing import Packer
    from duelq.server.relay import RelayFront, SlotPool
    from duelq.v1 import learner_pb2 as pb

    config = LearnerConfig()
    rng = np.random.default_rng(args.index)
    bodies = [encode_batch_wire(make_batch(rng, args.batch, config.hidden_dim,
                                           config.n_actions, "float32"))
              for _ in range(BODIES)]
    streams = None if args.plain_copies or args.unpacked else stream_copy()
    front = RelayFront(socket.socket(fileno=args.sock_fd),
                       SlotPool(SLOTS, args.slot_size, fd=args.pool_fd),
                       None if args.unpacked else Packer(streams).pack)
    counts = [0] * args.streams
    end = args.start_at + WARMUP_S + args.duration + 0.2

    def request(stream: int, seq: int) -> bytes:   # the key last, as the client encodes it
        key = pb.RequestKey(actor_id=f"relay-{args.index}-{stream}", seq=seq)
        return b"".join((bodies[seq % BODIES], b"\x42", varint(key.ByteSize()),
                         key.SerializeToString()))   # one copy (see the module's doc)

    def run(s: int) -> None:
        stream = front.open(unary=False, deadline=None)
        seq = 0
        for _ in range(args.window):
            seq += 1
            stream.submit(request(s, seq))
        sending = True
        for code, payload in stream.replies():
            if code.name != "OK":   # the learner end refused or went away: stop
                break
            counts[s] += 1
            if sending and time.time() < end:
                seq += 1
                stream.submit(request(s, seq))
            elif sending:
                stream.done_sending()
                sending = False
        stream.close()
    late = time.time() - args.start_at   # > 0: this front started after the measured window
    time.sleep(max(0.0, -late))
    threads = [threading.Thread(target=run, args=(s,)) for s in range(args.streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    front.close()
    print(json.dumps({"answers": sum(counts), "late_s": max(0.0, late),
                      "stream_copy": streams is not None}))


class _PartClocks:
    """CPU seconds the relay thread spends in some of a RelayLearner's methods, each
    wrapped on the instance (its loop calls them through ``self``)."""

    PARTS = ("_read", "_prepare_next", "_answer", "_run", "_reply")

    def __init__(self, relay):
        self.spent = dict.fromkeys(self.PARTS, 0.0)
        self.calls = dict.fromkeys(self.PARTS, 0)
        for name in self.PARTS:
            setattr(relay, name, self._timed(name, getattr(relay, name)))

    def _timed(self, name: str, method):
        spent, calls, clock = self.spent, self.calls, time.thread_time

        def timed(*args):
            calls[name] += 1
            start = clock()
            try:
                return method(*args)
            finally:
                spent[name] += clock() - start
        return timed


def _driver_calls(args: argparse.Namespace) -> dict[str, tuple[float, int]]:
    """{driver entry point: (seconds, calls)} so far, with --driver-calls; else {}."""
    if not args.driver_calls:
        return {}
    from duelq.server import native
    times = native.load().call_times()
    if times is None:
        raise SystemExit("--driver-calls: the library in use was built without its clocks")
    return times


def _learner(args: argparse.Namespace) -> dict:
    """Serve --fronts child fronts from this process; returns the figures."""
    import grpc

    from duelq.client.client import encode_batch_wire
    from duelq.server.bench.actors import make_batch
    from duelq.server.bench.servers import serve_for_paths
    from duelq.server.config import LearnerConfig
    from duelq.server.lane import Lane, cuda_engine
    from duelq.server.relay import RelayLearner, SlotPool
    from duelq.server.service import refusal

    config = LearnerConfig()
    if args.driver_calls:
        from duelq.server import native
        native.time_calls()   # before the backend loads the library
    server = serve_for_paths(config, args.backend, args.host_calls)
    relay, lane, children, first_end = None, None, [], None
    try:
        service = server.service
        learner = service.learner
        size = 2 * len(encode_batch_wire(make_batch(np.random.default_rng(0), args.batch,
                                                    config.hidden_dim, config.n_actions,
                                                    "float32"),
                                         actor_id="relay-00-00", seq=1))
        pools = [SlotPool(SLOTS, size) for _ in range(args.fronts)]
        ends = [socket.socketpair() for _ in range(args.fronts)]
        for pool in pools:
            learner.backend.register_host(pool.bytes)

        def refuse(exc: Exception, unary: bool) -> tuple[grpc.StatusCode, str]:
            return refusal(exc, "TrainStream", "relay")
        # The relay's first front, whose end is the relay's, is this process's own: the
        # child fronts are all "other" fronts, so one that finishes first ends only its
        # streams.
        first, first_end = socket.socketpair()
        if not args.no_lane and cuda_engine(learner.backend):   # as the server
            lane = Lane(service)
        relay = RelayLearner(first, SlotPool(1, 4096), service.relay_prepare,
                             lambda job, call: service.apply_train(
                                 job, call, encoded=True).SerializeToString(),
                             refuse, open_stream=service.open_stream,
                             close_stream=service.close_stream,
                             prepare_packed=service.relay_prepare_packed, lane=lane)
        clocks = _PartClocks(relay) if args.parts else None
        relay.start()
        for (mine, _), pool in zip(ends, pools):
            relay.attach(mine, pool)
        start_at = time.time() + 3.0   # the fronts encode their batches meanwhile
        for i, ((_, theirs), pool) in enumerate(zip(ends, pools)):
            children.append(subprocess.Popen(
                [sys.executable, __file__, "--front-child", str(i), "--sock-fd",
                 str(theirs.fileno()), "--pool-fd", str(pool.fd), "--slot-size", str(size),
                 "--start-at", str(start_at), "--streams", str(args.streams), "--window",
                 str(args.window), "--batch", str(args.batch), "--duration",
                 str(args.duration)] + ["--unpacked"] * args.unpacked
                + ["--plain-copies"] * args.plain_copies,
                pass_fds=(theirs.fileno(), pool.fd), stdout=subprocess.PIPE, text=True))
            theirs.close()
        time.sleep(max(0.0, start_at + WARMUP_S - time.time()))
        # The thread's clock is read inside the process clock's window, so its share of it
        # is never overstated.
        clock = time.pthread_getcpuclockid(relay.thread.ident)
        cpu, wall = time.process_time(), time.perf_counter()
        steps, relay_cpu = learner.step_count, time.clock_gettime(clock)
        waited = getattr(learner.backend, "sync_seconds", 0.0)
        parts = dict(clocks.spent) if clocks else {}
        reads = clocks.calls["_read"] if clocks else 0
        taken = (lane.answers, lane.handovers) if lane else (0, 0)
        calls = _driver_calls(args)
        time.sleep(args.duration)
        waited = getattr(learner.backend, "sync_seconds", 0.0) - waited
        calls = {name: (t - calls[name][0], n - calls[name][1])
                 for name, (t, n) in _driver_calls(args).items()}
        parts = {name: clocks.spent[name] - t for name, t in parts.items()}
        reads = clocks.calls["_read"] - reads if clocks else 0
        taken = (lane.answers - taken[0], lane.handovers - taken[1]) if lane else None
        relay_cpu = time.clock_gettime(clock) - relay_cpu
        steps = learner.step_count - steps
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        outputs = [child.communicate(timeout=120)[0] for child in children]
    finally:
        for child in children:
            child.kill()
        if relay is not None:
            relay.close()
        if first_end is not None:
            first_end.close()
        server.stop(0)
    if any(child.returncode for child in children):
        raise SystemExit(f"a front failed: exit codes {[c.returncode for c in children]}")
    reports = [json.loads(out) for out in outputs]
    if max(r["late_s"] for r in reports) > WARMUP_S:
        raise SystemExit("a front started after the measured window began; its figures "
                         "would be low: rerun on a less loaded machine")
    answers = sum(r["answers"] for r in reports)
    per_step = 1e6 / max(steps, 1)
    return {"steps_per_s": steps / wall, "cpu_us_per_step": cpu * per_step,
            "relay_us_per_step": relay_cpu * per_step, "wait_us_per_step": waited * per_step,
            "parts_us_per_step": {name: t * per_step for name, t in parts.items()},
            "reads_per_step": reads / max(steps, 1),
            "driver_calls_per_step": {name: (t * per_step, n / max(steps, 1))
                                      for name, (t, n) in calls.items()},
            "answers": answers, "host_calls": getattr(learner.backend, "host_path", None),
            "lane": None if taken is None else {"share": taken[0] / max(steps, 1),
                                                "handovers": taken[1]},
            "stream_copy": all(r["stream_copy"] for r in reports)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="cuda", choices=("cuda", "reference", "null"))
    parser.add_argument("--fronts", type=int, default=4)
    parser.add_argument("--streams", type=int, default=2, help="per front")
    parser.add_argument("--window", type=int, default=8, help="requests in flight per stream")
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds measured")
    parser.add_argument("--host-calls", default="auto", choices=("auto", "native", "python"),
                        help="cuda: a step's driver calls through server/native.c or Python")
    parser.add_argument("--parts", action="store_true",
                        help="also time the relay thread's parts (a little slower)")
    parser.add_argument("--driver-calls", action="store_true",
                        help="cuda: also time each driver call (server/native.c built with "
                             "clocks)")
    parser.add_argument("--unpacked", action="store_true",
                        help="the fronts send each request's bytes as they came (the learner "
                             "parses and unpacks them), not packed")
    parser.add_argument("--plain-copies", action="store_true",
                        help="the fronts write the slots with cached stores, not "
                             "non-temporal ones (as before round 16)")
    parser.add_argument("--no-lane", action="store_true",
                        help="cuda: the Python relay takes every request (no fast lane in C, "
                             "server/lane.c), as before round 17")
    parser.add_argument("--front-child", type=int, dest="index", help=argparse.SUPPRESS)
    for name in ("--sock-fd", "--pool-fd", "--slot-size"):
        parser.add_argument(name, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--start-at", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.index is not None:
        _front(args)
        return
    if min(args.fronts, args.streams, args.window, args.batch) < 1 or args.duration <= 0:
        parser.error("--fronts, --streams, --window and --batch must be ≥ 1, --duration > 0")
    if args.driver_calls and (args.backend != "cuda" or args.host_calls == "python"):
        parser.error("--driver-calls needs --backend cuda and host calls in C")
    if args.parts and args.backend == "cuda" and args.host_calls != "python" and not args.no_lane:
        parser.error("--parts times the Python relay's methods: add --no-lane")
    result = _learner(args)
    if not result["answers"]:
        raise SystemExit("no request was answered")
    calls = f" (host calls: {result['host_calls']})" if result["host_calls"] else ""
    print(f"\n{args.backend}{calls}, B = {args.batch} float32, {args.fronts} fronts × "
          f"{args.streams} streams × window {args.window}, {args.duration:g} s, requests "
          f"{'as they came' if args.unpacked else 'packed by the fronts'}"
          f"{', plain copies' if not (args.unpacked or result['stream_copy']) else ''}"
          + (f", the fast lane (server/lane.c) answered {100 * result['lane']['share']:.1f} % "
             f"({result['lane']['handovers']} handovers)" if result["lane"] else
             ", no fast lane"))
    print("| steps/s | learner process CPU µs/step | of which the relay thread "
          "| of which the device wait | the relay thread's host work |")
    print("|---|---|---|---|---|")
    print(f"| {result['steps_per_s']:.0f} | {result['cpu_us_per_step']:.0f} "
          f"| {result['relay_us_per_step']:.0f} | {result['wait_us_per_step']:.0f} "
          f"| {result['relay_us_per_step'] - result['wait_us_per_step']:.0f} |")
    parts = result["parts_us_per_step"]
    if parts:   # the look for frames and the loop are the thread's CPU left over
        rows = {"frames read": parts["_read"], "prepare": parts["_prepare_next"],
                "step, response, serialise (with the device wait)": parts["_run"],
                "reply": parts["_reply"],
                "the answer's bookkeeping": parts["_answer"] - parts["_run"] - parts["_reply"],
                "the rest of the thread's CPU (the look for frames, the loop)":
                    result["relay_us_per_step"] - parts["_read"] - parts["_prepare_next"]
                    - parts["_answer"]}
        print("\n| relay thread part | µs/step |\n|---|---|")
        for name, value in rows.items():
            print(f"| {name} | {value:.1f} |")
        print(f"\nreads of a front's socket per request: {result['reads_per_step']:.2f}")
    calls = result["driver_calls_per_step"]
    if calls:
        print("\n| driver call | calls/step | wall µs/step |\n|---|---|---|")
        for name, (us, n) in calls.items():
            print(f"| {name} | {n:.2f} | {us:.2f} |")
        host = sum(us for name, (us, _) in calls.items() if name != "cuStreamSynchronize")
        print(f"| all but the sync | | {host:.2f} |")


if __name__ == "__main__":
    main()
