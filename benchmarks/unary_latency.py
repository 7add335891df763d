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
instead of ``--calls`` times, and the table gives the actors' steps/s.  Prints a table.
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
        for _ in range(50):
            call()   # warm up
        times: list[float] = []
        end = None if seconds is None else time.perf_counter() + seconds
        while len(times) < calls if end is None else time.perf_counter() < end:
            t = time.perf_counter()
            call()
            times.append(time.perf_counter() - t)
        out[name] = times
    return out


def streamed(pool: ActorPool, target: str, config: LearnerConfig, options: ServerOptions,
             seconds: float) -> tuple[threading.Thread, dict]:
    """Start the pool's actors streaming to ``target`` for ``seconds`` after a warm-up;
    the thread running them and the dict its steps/s (or error) lands in."""
    job = {"kind": "stream", "batch": 1024, "wire": "float32", "target": target,
           "hidden_dim": config.hidden_dim, "n_actions": config.n_actions, "window": 8,
           "max_message_bytes": options.max_message_bytes, "seed": 7, "channel_options": (),
           "tune_malloc": False, "token": "", "ready_timeout": 60.0}
    result: dict = {}

    def run() -> None:
        try:
            reports = pool.run([dict(job) for _ in pool.procs], WARMUP_S, seconds)
            result["steps_per_s"] = sum(len(r["latencies"]) for r in reports) / seconds
        except Exception as exc:  # noqa: BLE001 — reported in the table
            result["error"] = f"{type(exc).__name__}: {exc}"
    thread = threading.Thread(target=run, name="stream-actors")
    thread.start()
    return thread, result


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
    if args.calls < 1 or args.stream_actors < 0 or args.seconds <= 0 or args.front_processes < 1:
        parser.error("--calls, --seconds and --front-processes must be positive, "
                     "--stream-actors not negative")
    config = LearnerConfig()
    seconds = args.seconds if args.stream_actors else None
    pool = ActorPool(args.stream_actors) if args.stream_actors else None
    results, streams = {}, {}
    try:
        for mode, front in (("one process", False), ("front process", True)):
            options = ServerOptions(port=0, front_process=front,
                                    front_processes=args.front_processes if front else 1)
            server = start_server(config, options, backend=args.backend)
            try:
                with LearnerClient(server.target) as client:
                    client.wait_ready(60.0)
                    if pool is not None:
                        thread, streams[mode] = streamed(pool, server.target, config, options,
                                                         len(RPCS) * (seconds + 0.5) + 2)
                        time.sleep(WARMUP_S + 1)
                    results[mode] = timings(client, config, args.calls, seconds)
                    if pool is not None:
                        thread.join()
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
    for mode, stream in streams.items():
        print(f"{mode}: the actors' TrainStream " + (f"{stream['steps_per_s']:.0f} steps/s"
              if "steps_per_s" in stream else f"failed: {stream.get('error')}"))


if __name__ == "__main__":
    main()
