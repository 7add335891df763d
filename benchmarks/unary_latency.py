"""Latency of the small unary rpcs in one process and with ``--front-process``.

    python3 benchmarks/unary_latency.py [--backend reference] [--calls 2000]
        [--stream-actors N [--seconds 2] [--front-processes K]]

``--front-process`` passes every rpc from the front to the learner process: the train
rpcs and the small ones (Act, GetWeights, ReadISV, GetInfo, ComputeEntropy) over the relay's
socket (until round 13 the small ones took a second gRPC hop, a private Unix socket, as
SaveCheckpoint still does).  This starts both
servers (same config, fresh state) and times Act (B = 1 and 64), GetWeights, ReadISV and
GetInfo through the client library, one call at a time: p50 and p99 in µs, and the front's
extra p50.  With ``--stream-actors N``, N actor processes (the bench's) stream B = 1024
float32 batches through TrainStream all the while, each rpc is timed for ``--seconds``
instead of ``--calls`` times, once the server has stepped, and all within the actors'
streaming (else exit 1, as when an actor fails); the table gives the actors' steps/s.
Prints a table.
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np

from duelq.client import LearnerClient
from duelq.server.bench.actors import ActorPool
from duelq.server.config import LearnerConfig
from duelq.server.server import ServerOptions, start_server

RPCS = ("Act, B = 1", "Act, B = 64", "GetWeights", "ReadISV", "GetInfo")
WARMUP_S = 1.0   # the streams' unmeasured start


def timings(client: LearnerClient, config: LearnerConfig, calls: int,
            seconds: float | None) -> dict[str, list[float]]:
    """Each rpc's call times (s): ``calls`` of them, or as many as fit in ``seconds``."""
    rng = np.random.default_rng(0)
    h1 = rng.standard_normal((1, config.hidden_dim), dtype=np.float32)
    h64 = rng.standard_normal((64, config.hidden_dim), dtype=np.float32)
    rpcs = dict(zip(RPCS, (lambda: client.act(h1), lambda: client.act(h64),
                           client.get_weights, client.read_isv, client.info)))
    out = {}
    for name, call in rpcs.items():
        for _ in range(50 if seconds is None else 20):
            call()   # warm up (fewer beside the streams, where each call is slower)
        times: list[float] = []
        end = None if seconds is None else time.perf_counter() + seconds
        while len(times) < calls if end is None else time.perf_counter() < end:
            t = time.perf_counter()
            call()
            times.append(time.perf_counter() - t)
        out[name] = times
    return out


class Streams:
    """The pool's actors streaming B = 1024 float32 batches to ``target`` for ``seconds``
    after a warm-up, run from a thread."""

    def __init__(self, pool: ActorPool, target: str, config: LearnerConfig,
                 options: ServerOptions, seconds: float):
        job = {"kind": "stream", "batch": 1024, "wire": "float32", "target": target,
               "hidden_dim": config.hidden_dim, "n_actions": config.n_actions, "window": 8,
               "max_message_bytes": options.max_message_bytes, "seed": 7,
               "channel_options": (), "tune_malloc": False, "token": "",
               "ready_timeout": 60.0}
        self.seconds, self.result = seconds, {}
        # The actors start once all are ready, so they stream at least until then.
        self.streaming_until = time.monotonic() + WARMUP_S + seconds

        def run() -> None:
            try:
                reports = pool.run([dict(job) for _ in pool.procs], WARMUP_S, seconds)
                self.result["steps"] = sum(len(r["latencies"]) for r in reports)
            except Exception as exc:  # noqa: BLE001 — raised by finish()
                self.result["error"] = f"{type(exc).__name__}: {exc}"
        self.thread = threading.Thread(target=run, name="stream-actors")
        self.thread.start()

    def wait_streaming(self, client: LearnerClient, steps: int = 20,
                       timeout: float = 60.0) -> None:
        """Return once the server has stepped ``steps`` times since the call."""
        first, deadline = client.info().step, time.monotonic() + timeout
        while client.info().step < first + steps:
            if not self.thread.is_alive():
                self.finish()   # exits with the actors' error, if any
                raise SystemExit("unary_latency: the actors ended before the server stepped")
            if time.monotonic() > deadline:
                raise SystemExit(f"unary_latency: the server did not step {steps} times in "
                                 f"{timeout:g} s of streaming")
            time.sleep(0.05)

    def finish(self, check: bool = True) -> float | None:
        """The actors' steps/s, once they are done; exits 1 if they failed (with
        ``check``: else None, as when another error is on its way)."""
        self.thread.join()
        if not check:
            return None
        if "error" in self.result:
            raise SystemExit(f"unary_latency: the streaming actors failed: "
                             f"{self.result['error']}")
        return self.result["steps"] / self.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="reference", choices=("reference", "cuda"))
    parser.add_argument("--calls", type=int, default=2000, help="calls per rpc, unloaded")
    parser.add_argument("--stream-actors", type=int, default=0,
                        help="actor processes streaming B = 1024 batches meanwhile")
    parser.add_argument("--seconds", type=float, default=2.0,
                        help="seconds per rpc with --stream-actors")
    parser.add_argument("--front-processes", type=int, default=1)
    args = parser.parse_args()
    if args.calls < 1 or args.stream_actors < 0 or args.seconds <= 0 \
            or not 1 <= args.front_processes <= 64:
        parser.error("--calls and --seconds must be positive, --stream-actors not negative, "
                     "--front-processes in [1, 64]")
    config = LearnerConfig()
    seconds = args.seconds if args.stream_actors else None
    pool = ActorPool(args.stream_actors) if args.stream_actors else None
    results, rates = {}, {}
    try:
        for mode, front in (("one process", False), ("front process", True)):
            options = ServerOptions(port=0, front_process=front,
                                    front_processes=args.front_processes if front else 1)
            server = start_server(config, options, backend=args.backend)
            try:
                with LearnerClient(server.target) as client:
                    client.wait_ready(60.0)
                    if pool is None:
                        results[mode] = timings(client, config, args.calls, None)
                        continue
                    # room for each rpc's warm-up calls and for the streams to start
                    streams = Streams(pool, server.target, config, options,
                                      len(RPCS) * (seconds + 0.5) + 3)
                    try:
                        streams.wait_streaming(client)
                        results[mode] = timings(client, config, args.calls, seconds)
                        if time.monotonic() > streams.streaming_until:
                            raise SystemExit("unary_latency: the actors may have stopped "
                                             "streaming before the timings ended")
                    except BaseException:
                        streams.finish(check=False)   # joined before the pool is closed
                        raise
                    rates[mode] = streams.finish()   # joined before the pool is reused
            finally:
                server.stop(0)
    finally:
        if pool is not None:
            pool.close()
    load = (f"{args.stream_actors} actors streaming B = 1024 float32, {seconds:g} s per rpc"
            if pool is not None else f"{args.calls} calls each, one at a time")
    print(f"\n{args.backend}, {load}, {args.front_processes} front(s) (µs)")
    print("| rpc | one process p50 / p99 | front process p50 / p99 | extra p50 |")
    print("|---|---|---|---|")
    for name in RPCS:
        one, two = (np.percentile(np.array(results[m][name]) * 1e6, (50, 99))
                    for m in ("one process", "front process"))
        print(f"| {name} | {one[0]:.0f} / {one[1]:.0f} | {two[0]:.0f} / {two[1]:.0f} | "
              f"{two[0] - one[0]:+.0f} |")
    for mode, rate in rates.items():
        print(f"{mode}: the actors' TrainStream {rate:.0f} steps/s")


if __name__ == "__main__":
    main()
