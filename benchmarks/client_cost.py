"""CPU per message of an actor against the bare byte echo: a prebuilt payload vs encoding.

    python3 benchmarks/client_cost.py [--batch 1024] [--wire float32] [--messages 3000]
                                      [--tune-malloc]

Starts the bench's byte-echo server in a child process and streams to it from here with a
window of 8, as `duelq bench`'s echo actor does, three ways: one prebuilt request sent
again and again ("same", the echo actor), four prebuilt requests in turn ("rot4"), and
each request encoded by the client library from one of four batches ("fresh", what
TrainStream's client does before sending). Reports this process's CPU µs per message, the
main thread's CPU µs spent making each request, and minor page faults per message.
--tune-malloc fixes glibc's mmap and trim thresholds first (as the bench's malloc cells).
"""

from __future__ import annotations

import argparse
import queue
import resource
import time

import grpc
import numpy as np

from duelq.client.client import _batch_arrays, _wire_request, encode_batch_wire
from duelq.server.bench.actors import make_batch
from duelq.server.bench.servers import ECHO_PATH, REPLY_BYTES, ServerProcess, tune_malloc
from duelq.server.config import LearnerConfig
from duelq.server.server import ServerOptions

WINDOW = 8


def stream(call_of, make, n: int) -> tuple[float, float]:
    """Send ``n`` messages from ``make(i)``, WINDOW in flight: (CPU µs/message, make µs)."""
    feed: queue.SimpleQueue = queue.SimpleQueue()
    call = call_of(iter(feed.get, None), metadata=((REPLY_BYTES, "8300"),))
    for i in range(WINDOW):
        feed.put(make(i))
    making, sent, answered = 0.0, WINDOW, 0
    cpu = time.process_time()
    for _ in call:
        answered += 1
        if sent >= n:
            break
        t = time.thread_time()
        request = make(sent)
        making += time.thread_time() - t
        feed.put(request)
        sent += 1
    cpu = time.process_time() - cpu
    feed.put(None)      # half-close; the answers still in flight are not timed
    for _ in call:
        pass
    return 1e6 * cpu / answered, 1e6 * making / answered


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--wire", default="float32", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--messages", type=int, default=3000)
    parser.add_argument("--tune-malloc", action="store_true")
    args = parser.parse_args()
    tuned = args.tune_malloc and tune_malloc()
    server = ServerProcess(LearnerConfig(), ServerOptions(port=0), tune=False)
    try:
        rng = np.random.default_rng(0)
        batches = [make_batch(rng, args.batch, 128, 11, args.wire) for _ in range(4)]
        payloads = [encode_batch_wire(b, feature_dtype=args.wire, actor_id="a", seq=1)
                    for b in batches]
        size = 2 * len(payloads[0]) + (1 << 20)
        channel = grpc.insecure_channel(server.targets["echo"], options=[
            ("grpc.max_receive_message_length", size), ("grpc.max_send_message_length", size)])
        call_of = channel.stream_stream(ECHO_PATH)
        ways = {"same": lambda i: payloads[0], "rot4": lambda i: payloads[i % 4],
                "fresh": lambda i: _wire_request(_batch_arrays(batches[i % 4], args.wire),
                                                 "a", i + 1)}
        stream(call_of, ways["same"], 300)   # warm up
        rows = []
        for name, make in list(ways.items()) * 2:
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            cpu, making = stream(call_of, make, args.messages)
            faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
            rows.append((name, cpu, making, faults / args.messages))
        channel.close()
    finally:
        server.stop()
    print(f"\nB = {args.batch} {args.wire}, window {WINDOW}, malloc "
          f"{'tuned' if tuned else 'default'}")
    print("| request | CPU µs/message | making µs/message | minor faults/message |")
    print("|---|---|---|---|")
    for name, cpu, making, faults in rows:
        print(f"| {name} | {cpu:.0f} | {making:.0f} | {faults:.1f} |")


if __name__ == "__main__":
    main()
