"""Latency of the small unary rpcs in one process and with ``--front-process``.

    python3 benchmarks/unary_latency.py [--backend reference] [--calls 2000]

``--front-process`` passes every rpc from the front to the learner process: the train
rpcs and the small ones (Act, GetWeights, ReadISV, GetInfo, ComputeEntropy) over the relay's
socket (until round 13 the small ones took a second gRPC hop, a private Unix socket, as
SaveCheckpoint still does).  This starts both
servers (same config, fresh state) and times Act (B = 1 and 64), GetWeights, ReadISV and
GetInfo through the client library, one call at a time: p50 and p99 in µs, and the front's
extra p50.  Prints a table.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from duelq.client import LearnerClient
from duelq.server.config import LearnerConfig
from duelq.server.server import ServerOptions, start_server


def timings(client: LearnerClient, calls: int, config: LearnerConfig) -> dict[str, list[float]]:
    rng = np.random.default_rng(0)
    h1 = rng.standard_normal((1, config.hidden_dim), dtype=np.float32)
    h64 = rng.standard_normal((64, config.hidden_dim), dtype=np.float32)
    rpcs = {"Act, B = 1": lambda: client.act(h1), "Act, B = 64": lambda: client.act(h64),
            "GetWeights": client.get_weights, "ReadISV": client.read_isv,
            "GetInfo": client.info}
    out = {}
    for name, call in rpcs.items():
        for _ in range(50):
            call()   # warm up
        times = []
        for _ in range(calls):
            t = time.perf_counter()
            call()
            times.append(time.perf_counter() - t)
        out[name] = times
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="reference", choices=("reference", "cuda"))
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    config = LearnerConfig()
    results = {}
    for mode, front in (("one process", False), ("front process", True)):
        server = start_server(config, ServerOptions(port=0, front_process=front),
                              backend=args.backend)
        try:
            with LearnerClient(server.target) as client:
                results[mode] = timings(client, args.calls, config)
        finally:
            server.stop(0)
    print(f"\n{args.backend}, {args.calls} calls each, one at a time (µs)")
    print("| rpc | one process p50 / p99 | front process p50 / p99 | extra p50 |")
    print("|---|---|---|---|")
    for name in results["one process"]:
        one, two = (np.percentile(np.array(results[m][name]) * 1e6, (50, 99))
                    for m in ("one process", "front process"))
        print(f"| {name} | {one[0]:.0f} / {one[1]:.0f} | {two[0]:.0f} / {two[1]:.0f} | "
              f"{two[0] - one[0]:+.0f} |")


if __name__ == "__main__":
    main()
