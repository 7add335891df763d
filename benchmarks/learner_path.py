"""Host time of the learner process's relay path per request: one thread, no gRPC.

    python3 benchmarks/learner_path.py [--backend cuda] [--batch 1024] [--requests 1000]
                                       [--repeats 5] [--host-calls native|python] [--profile]
                                       [--unpacked]

Builds a server's service on ``--backend`` (``null``: steps with no arithmetic, values
left unchecked on the host as on cuda) and, for each request, does what the learner
process of ``--front-process`` does with it once a front has packed its arrays into a slot
of a (page-locked on cuda) slot pool (server/packing.py's Packer, as the fronts do since
round 13, its large arrays written past the cache since round 16): ``relay_prepare_packed``
(the descriptor, the key, the checks left, the copy towards the device), ``apply_train``
(idempotency key, step, response in wire bytes where the build has them) and serialise the
response: the learner's share, timed around those three.  ``--unpacked``: the fronts'
copies are the requests' bytes as they came, and ``relay_prepare`` parses and decodes them
(before round 13).  Requests carry distinct keys, as from an actor (their batches cycle
through 256 distinct ones).  benchmarks/relay_path.py runs the same share on the relay's
thread with fronts feeding it; the difference is the relay's own work and what the fronts'
copies and the relay's system calls cost the thread beside them.

Each repeat times two blocks of ``--requests`` (in turn first), which differ only in
where the front's copies are made:
* ahead: every request of the block is copied (packed) into a slot of its own before the
  block, so the learner's thread runs with only its own work in its caches, as in the
  server, where the fronts copy on their own cores (there they still share the last-level
  cache and the memory's bandwidth with it, so this is the lower bound);
* inline: each request is copied into one of 8 slots just before its share, on the same
  thread (this script's only mode until round 10): the copy's megabyte then evicts the
  learner's working set, which on the H200 hosts made the host work 1.5–1.9× as long.
The pool has max(``--requests``, 8) slots, each a multiple of 4 KiB as the server's are:
≈ 1 GB at B = 1024 (page-locked on cuda), besides the block's requests (another ≈ 1 GB).
Reports wall µs per request (the median and the range over ``--repeats``; one host's
figures drift by tens of per cent from block to block) and how many requests the learner
took packed, the front's slot copies alone (packed: with the packing's own lookups) and,
on cuda, the step's wait for the device (each step is waited for before the next
request is read, so nothing overlaps it) and the host work, the share less that wait;
--profile adds cProfile's top entries over the shares of one more block (copies ahead).
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import pstats
import statistics
import time

import numpy as np

from duelq.client.client import encode_batch_wire
from duelq.server.bench.actors import make_batch
from duelq.server.config import LearnerConfig
from duelq.server.bench.servers import serve_for_paths
from duelq.server.relay import SlotPool

INLINE_SLOTS = 8   # slots the inline copies cycle through
WARM = 300         # requests before the timing
BATCHES = 256      # distinct batches the requests cycle through
KEY_GROWTH = 16    # bytes a request may outgrow the first one by (its seq's varint)
PAGE = 4096        # slot sizes are multiples of it, so every slot starts as aligned


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="cuda", choices=("cuda", "reference", "null"))
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--requests", type=int, default=1000, help="per block")
    parser.add_argument("--repeats", type=int, default=5, help="timed blocks of each kind")
    parser.add_argument("--host-calls", default="auto", choices=("auto", "native", "python"),
                        help="cuda: a step's driver calls through server/native.c or Python")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--unpacked", action="store_true",
                        help="slots hold the requests' bytes as they came, not packed")
    args = parser.parse_args()
    if args.requests < 1 or args.repeats < 1:
        parser.error("--requests and --repeats must be ≥ 1")
    config = LearnerConfig()
    server = serve_for_paths(config, args.backend, args.host_calls)
    service, backend = server.service, server.learner.backend
    # As the server answers: in wire bytes since round 16 (older builds: the message).
    answer = {"encoded": True} if "encoded" in inspect.signature(
        service.apply_train).parameters else {}
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
    warm = encode(WARM)
    pool = SlotPool(max(n, INLINE_SLOTS), -(-(len(warm[0]) + KEY_GROWTH) // PAGE) * PAGE)
    backend.register_host(pool.bytes)
    if not args.unpacked:   # a build from before round 13 has no packing.py
        from duelq.server.packing import Packer
        try:   # the fronts' slot writes, past the cache since round 16
            from duelq.server.native import stream_copy
            packer, by_address = Packer(stream_copy()), True
        except ImportError:   # an older build: plain copies
            packer, by_address = Packer(), False
    packed = 0   # requests the learner took packed

    def copy(slot: int, data: bytes) -> bytes:
        """The front's copy of request ``data`` into ``slot``: what its frame then carries
        (a packed request's descriptor and key; else nothing)."""
        if args.unpacked:
            pool.write(slot, data)
            return b""
        descriptor = (packer.pack(data, pool.array(slot), pool.address(slot)) if by_address
                      else packer.pack(data, pool.array(slot)))
        if descriptor is None:
            raise SystemExit(f"a B = {args.batch} request does not pack into a slot")
        return descriptor

    def share(slot: int, data: bytes, frame: bytes) -> float:
        """Seconds of the learner's share of the request ``data`` in ``slot`` (``frame``:
        what its frame carried)."""
        nonlocal packed
        start = time.perf_counter()
        if frame:
            job = service.relay_prepare_packed(frame, pool.slot(slot, pool.size),
                                               pool.address(slot))
            packed += 1
        else:
            job = service.relay_prepare(pool.slot(slot, len(data)), False, pool.address(slot))
        with job:
            service.apply_train(job, None, **answer).SerializeToString()
        return time.perf_counter() - start

    def block(ahead: bool, profile: cProfile.Profile | None = None) -> tuple[float, float]:
        """A block of n new requests: (share, wait) in µs per request; ``profile``, if
        given, runs around the shares alone."""
        requests = encode(n)
        frames = [copy(i, data) for i, data in enumerate(requests)] if ahead else []
        waited, inside = getattr(backend, "sync_seconds", 0.0), 0.0
        if profile is not None:
            profile.enable()
        for i, data in enumerate(requests):
            slot = i if ahead else i % INLINE_SLOTS
            inside += share(slot, data, frames[i] if ahead else copy(slot, data))
        if profile is not None:
            profile.disable()
        wait = getattr(backend, "sync_seconds", 0.0) - waited
        return 1e6 * inside / n, 1e6 * wait / n

    def copies_alone() -> float:
        """µs per request of the front's slot copies alone."""
        requests = encode(n)
        start = time.perf_counter()
        for i, data in enumerate(requests):
            copy(i % INLINE_SLOTS, data)
        return 1e6 * (time.perf_counter() - start) / n
    rows: dict[str, list[float]] = {}   # figure → one value per block
    try:
        for i, data in enumerate(warm):
            share(i % INLINE_SLOTS, data, copy(i % INLINE_SLOTS, data))
        del warm
        for repeat in range(args.repeats):
            for kind in (("ahead", "inline"), ("inline", "ahead"))[repeat % 2]:
                spent, wait = block(kind == "ahead")
                for name, value in (("share", spent), ("wait", wait), ("host", spent - wait)):
                    rows.setdefault(f"{name} {kind}", []).append(value)
            rows.setdefault("copy", []).append(copies_alone())
        if args.profile:
            profile = cProfile.Profile()
            block(True, profile)
            pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    finally:
        server.stop(0)   # the slot pool (page-locked on cuda) goes with the process

    def cell(name: str) -> str:
        values = rows[name]
        return (f"{statistics.median(values):.0f} [{min(values):.0f}–{max(values):.0f}]"
                if len(values) > 1 else f"{values[0]:.0f}")
    calls = f" (host calls: {backend.host_path})" if args.backend == "cuda" else ""
    taken = WARM + (2 * args.repeats + args.profile) * n
    print(f"\n{args.backend}{calls}, B = {args.batch} float32, {packed} of {taken} requests "
          f"packed, one thread, {args.repeats} blocks of {n} requests each way: "
          f"median [range] µs/request")
    print("| part | the front's copies ahead | copies inline, same thread |")
    print("|---|---|---|")
    print(f"| the learner's share, timed around it | {cell('share ahead')} "
          f"| {cell('share inline')} |")
    if args.backend == "cuda":
        print(f"| of which the step's wait for the device (stream sync) | {cell('wait ahead')} "
              f"| {cell('wait inline')} |")
        print(f"| the learner's host work (share less that wait) | {cell('host ahead')} "
              f"| {cell('host inline')} |")
    print(f"| the front's slot copy alone | | {cell('copy')} |")


if __name__ == "__main__":
    main()
