"""Host time of the learner process's relay path per request: one thread, no gRPC.

    python3 benchmarks/learner_path.py [--backend cuda] [--batch 1024] [--requests 1000]
                                       [--repeats 5] [--host-calls native|python] [--profile]

Builds a server's service on ``--backend`` (``null``: steps with no arithmetic, values
left unchecked on the host as on cuda) and, for each request, does what the front and
learner processes of ``--front-process`` do with it: copy the request's bytes into a slot
of a (page-locked on cuda) slot pool, then ``relay_prepare`` (parse, decode, checks, the
copy towards the device), ``apply_train`` (idempotency key, step, response) and serialise
the response: the learner's share, timed around those three.  (Until round 9 the share was
the whole less a loop of slot copies alone, which also counted as the learner's anything
that slowed the copies in the whole (the device reading the pool, caches); that figure is
still printed.)  Requests carry distinct keys, as from an actor (their batches cycle
through 256 distinct ones).  Reports wall and CPU µs per request with and without the slot copy
and, on cuda, the step's wait for the device (each step is waited for before the next
request is read, so nothing overlaps it): the median and the range over ``--repeats``
blocks of ``--requests`` each, since one host's figures drift by tens of per cent from
block to block; --profile adds cProfile's top entries over one more block.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import numpy as np

from duelq.client.client import encode_batch_wire
from duelq.server.bench.actors import make_batch
from duelq.server.config import LearnerConfig
from duelq.server.bench.servers import serve_for_paths
from duelq.server.relay import SlotPool

SLOTS = 8
WARM = 300       # requests before the timing
BATCHES = 256    # distinct batches the requests cycle through


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="cuda", choices=("cuda", "reference", "null"))
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--requests", type=int, default=1000, help="per block")
    parser.add_argument("--repeats", type=int, default=5, help="timed blocks")
    parser.add_argument("--host-calls", default="auto", choices=("auto", "native", "python"),
                        help="cuda: a step's driver calls through server/native.c or Python")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    if args.requests < 1 or args.repeats < 1:
        parser.error("--requests and --repeats must be ≥ 1")
    config = LearnerConfig()
    server = serve_for_paths(config, args.backend, args.host_calls)
    service, backend = server.service, server.learner.backend
    rng = np.random.default_rng(0)
    n = args.requests
    batches = [make_batch(rng, args.batch, config.hidden_dim, config.n_actions, "float32")
               for _ in range(min(BATCHES, WARM + n))]
    sent = 0   # requests encoded so far: the next one's seq is sent + 1

    def encode(count: int) -> list[bytes]:
        nonlocal sent
        first, sent = sent, sent + count
        return [encode_batch_wire(batches[i % len(batches)], actor_id="bench-0-1234-5678",
                                  seq=i + 1) for i in range(first, sent)]
    requests = encode(WARM)
    slots = SlotPool(SLOTS, 2 * len(requests[0]))   # room for the key's seq to grow
    backend.register_host(slots.bytes)

    def copy(i: int) -> None:
        slots.write(i % SLOTS, requests[i])

    inside = [0.0]   # seconds in the learner's share, timed around it

    def relay(i: int) -> bytes:
        data, slot = requests[i], i % SLOTS
        slots.write(slot, data)
        start = time.perf_counter()
        with service.relay_prepare(slots.slot(slot, len(data)), False,
                                   slots.address(slot)) as job:
            reply = service.apply_train(job, None).SerializeToString()
        inside[0] += time.perf_counter() - start
        return reply

    def timed(fn) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        for i in range(n):
            fn(i)
        return (1e6 * (time.perf_counter() - wall) / n, 1e6 * (time.process_time() - cpu) / n)
    rows: dict[str, list[float]] = {}   # figure → one value per block
    try:
        for i in range(WARM):
            relay(i)
        for _ in range(args.repeats):
            requests = []          # the last block's, freed before the next is encoded
            requests = encode(n)
            waited, inside[0] = getattr(backend, "sync_seconds", 0.0), 0.0
            whole = timed(relay)
            wait = 1e6 * (getattr(backend, "sync_seconds", 0.0) - waited) / n
            share = 1e6 * inside[0] / n
            slot_copy = timed(copy)
            for name, value in (("whole", whole[0]), ("whole cpu", whole[1]),
                                ("copy", slot_copy[0]), ("copy cpu", slot_copy[1]),
                                ("rest", whole[0] - slot_copy[0]), ("share", share),
                                ("wait", wait), ("host", share - wait)):
                rows.setdefault(name, []).append(value)
        if args.profile:
            requests = encode(n)
            profile = cProfile.Profile()
            profile.runcall(lambda: [relay(i) for i in range(n)])
            pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    finally:
        server.stop(0)   # the slot pool (page-locked on cuda) goes with the process

    def cell(name: str) -> str:
        values = rows[name]
        return (f"{statistics.median(values):.0f} [{min(values):.0f}–{max(values):.0f}]"
                if len(values) > 1 else f"{values[0]:.0f}")
    calls = f" (host calls: {backend.host_path})" if args.backend == "cuda" else ""
    print(f"\n{args.backend}{calls}, B = {args.batch} float32, one thread, {args.repeats} "
          f"blocks of {n} requests: median [range]")
    print("| part | wall µs/request | CPU µs/request |")
    print("|---|---|---|")
    print(f"| slot copy + prepare + apply + serialise | {cell('whole')} | {cell('whole cpu')} |")
    print(f"| slot copy alone (the front's share) | {cell('copy')} | {cell('copy cpu')} |")
    print(f"| the whole less the slot copy alone | {cell('rest')} | |")
    print(f"| the learner's share, timed around it | {cell('share')} | |")
    if args.backend == "cuda":
        print(f"| of which the step's wait for the device (stream sync) | {cell('wait')} | |")
        print(f"| the learner's host work (share less that wait) | {cell('host')} | |")


if __name__ == "__main__":
    main()
