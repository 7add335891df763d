"""Host time of the learner process's relay path per request: one thread, no gRPC.

    python3 benchmarks/learner_path.py [--backend cuda] [--batch 1024] [--requests 2000]
                                       [--profile]

Builds a server's service on ``--backend`` and, for each request, does what the front and
learner processes of ``--front-process`` do with it: copy the request's bytes into a slot
of a (page-locked on cuda) slot pool, then ``relay_prepare`` (parse, decode, checks, the
copy towards the device), ``apply_train`` (idempotency key, step, response) and serialise
the response.  Requests are distinct batches with keys, as from an actor.  Reports wall and
CPU µs per request with and without the slot copy and, on cuda, the step's wait for the
device (each step is waited for before the next request is read, so nothing overlaps it);
--profile adds cProfile's top entries.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np

from duelq.client.client import encode_batch_wire
from duelq.server.bench.actors import make_batch
from duelq.server.config import LearnerConfig
from duelq.server.relay import SlotPool
from duelq.server.server import ServerOptions, start_server

SLOTS = 8
WARM = 300   # requests before the timing, under a key of their own


class TimedStream:
    """A CuPy stream that adds up the time its ``synchronize`` calls wait: a step's wait
    for the device, which is not host work."""

    def __init__(self, stream):
        self.stream, self.waited = stream, 0.0

    def synchronize(self) -> None:
        start = time.perf_counter()
        self.stream.synchronize()
        self.waited += time.perf_counter() - start

    def __getattr__(self, name):
        return getattr(self.stream, name)

    def __enter__(self):
        return self.stream.__enter__()

    def __exit__(self, *exc):
        return self.stream.__exit__(*exc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="cuda", choices=("cuda", "reference"))
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    config = LearnerConfig()
    server = start_server(config, ServerOptions(port=0), backend=args.backend)
    service, backend = server.service, server.learner.backend
    rng = np.random.default_rng(0)
    n = args.requests
    requests = [encode_batch_wire(make_batch(rng, args.batch, config.hidden_dim,
                                             config.n_actions, "float32"),
                                  actor_id="warm-up" if i < WARM else "bench-0-1234-5678",
                                  seq=i + 1)
                for i in range(WARM + (2 if args.profile else 1) * n)]
    slots = SlotPool(SLOTS, max(len(r) for r in requests))
    backend.register_host(slots.bytes)
    if args.backend == "cuda":
        backend.stream = TimedStream(backend.stream)

    def copy(i: int) -> None:
        slots.write(i % SLOTS, requests[i])

    def relay(i: int) -> bytes:
        data, slot = requests[i], i % SLOTS
        slots.write(slot, data)
        with service.relay_prepare(slots.slot(slot, len(data)), False,
                                   slots.address(slot)) as job:
            return service.apply_train(job, None).SerializeToString()

    def timed(fn, first: int) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        for i in range(first, first + n):
            fn(i)
        return (1e6 * (time.perf_counter() - wall) / n, 1e6 * (time.process_time() - cpu) / n)
    try:
        for i in range(WARM):
            relay(i)
        stream = getattr(backend, "stream", None)
        waited = getattr(stream, "waited", 0.0)
        whole = timed(relay, WARM)
        waited = 1e6 * (getattr(stream, "waited", 0.0) - waited) / n
        slot_copy = timed(copy, WARM)
        if args.profile:
            profile = cProfile.Profile()
            profile.runcall(lambda: [relay(i) for i in range(WARM + n, WARM + 2 * n)])
            pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    finally:
        server.stop(0)   # the slot pool (page-locked on cuda) goes with the process
    print(f"\n{args.backend}, B = {args.batch} float32, {n} requests, one thread")
    print("| part | wall µs/request | CPU µs/request |")
    print("|---|---|---|")
    print(f"| slot copy + prepare + apply + serialise | {whole[0]:.0f} | {whole[1]:.0f} |")
    print(f"| slot copy alone (the front's share) | {slot_copy[0]:.0f} | {slot_copy[1]:.0f} |")
    print(f"| the learner's share | {whole[0] - slot_copy[0]:.0f} | "
          f"{whole[1] - slot_copy[1]:.0f} |")
    if args.backend == "cuda":
        print(f"| of which the step's wait for the device (stream sync) | {waited:.0f} | |")
        print(f"| the learner's host work (share less that wait) | "
              f"{whole[0] - slot_copy[0] - waited:.0f} | |")


if __name__ == "__main__":
    main()
