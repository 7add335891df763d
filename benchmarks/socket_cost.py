"""What the relay's system calls cost on this host (round 15).

    python3 benchmarks/socket_cost.py [--messages 4000] [--gap-us 110]

The learner's relay thread replies to a front with one ``sendmsg`` on a Unix socket pair
(server/relay.py); the front's reader usually sleeps in ``recv`` until then, so the send
also wakes it, and on a virtual machine a wake-up can cost more than the copy.  This times
``sendmsg`` of a B = 1024 reply (16 + 8192 bytes) and of a bare frame (16 bytes), one every
``--gap-us`` µs (about the relay's pace), to a reader process that:

* sleeps in ``recv`` (the front as it is),
* spins on ``recv(MSG_DONTWAIT)`` (never asleep: no wake-up, a whole core),
* looks with ``MSG_DONTWAIT`` and sleeps 50 µs in between (plus the kernel's timer slack,
  50 µs by default: no wake-up, little CPU);

with the reader's CPU share from its start to its end, then the learner side's other
calls: ``recv`` of a frame (as the relay reads, and into a buffer), an ``epoll`` look over
8 sockets, and a clock read.  Prints median and mean µs per call.
"""

from __future__ import annotations

import argparse
import os
import select
import socket
import statistics
import time

REPLY = 16 + 2 * 1024 * 4   # a REPLY frame and a B = 1024 response's two float32 vectors
POLL_S = 50e-6
MODES = ("sleeps in recv", "spins", f"looks, sleeping {POLL_S * 1e6:.0f} µs between")


def _reader(sock: socket.socket, mode: str) -> None:
    sock.setblocking(mode == MODES[0])
    buf = bytearray(1 << 17)
    while True:
        try:
            if sock.recv_into(buf) == 0:
                return
        except BlockingIOError:
            if mode == MODES[2]:
                time.sleep(POLL_S)


def _sends(size: int, mode: str, messages: int, gap_ns: int) -> tuple[list[int], float]:
    """(ns of each sendmsg, the reader's CPU share) for one reader mode."""
    ours, theirs = socket.socketpair()
    born = time.perf_counter_ns()
    pid = os.fork()
    if pid == 0:   # the reader
        ours.close()
        try:
            _reader(theirs, mode)
        finally:
            os._exit(0)
    theirs.close()
    frame, payload = bytes(16), bytes(size - 16)
    times = []
    for _ in range(messages):
        t = time.perf_counter_ns()
        ours.sendmsg((frame, payload))
        times.append(time.perf_counter_ns() - t)
        until = time.perf_counter_ns() + gap_ns
        while time.perf_counter_ns() < until:   # the relay's other work meanwhile
            pass
    ours.close()
    _, _, usage = os.wait4(pid, 0)
    return times, (usage.ru_utime + usage.ru_stime) / ((time.perf_counter_ns() - born) * 1e-9)


def _timed(call, messages: int, before=lambda: None) -> list[int]:
    times = []
    for _ in range(messages):
        before()
        t = time.perf_counter_ns()
        call()
        times.append(time.perf_counter_ns() - t)
    return times


def _row(name: str, times: list[int], extra: str = "") -> None:
    print(f"| {name} | {statistics.median(times) / 1e3:.2f} | {statistics.mean(times) / 1e3:.2f} "
          f"| {extra} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=4000, help="calls timed per row")
    parser.add_argument("--gap-us", type=float, default=110.0, help="between two sends")
    args = parser.parse_args()
    if args.messages < 1 or not 0 <= args.gap_us < 1e6:
        parser.error("--messages must be ≥ 1 and --gap-us in [0, 1e6)")
    n = args.messages
    print("| call | median µs | mean µs | the reader's CPU |\n|---|---|---|---|")
    for size in (REPLY, 16):
        for mode in MODES:
            times, cpu = _sends(size, mode, n, int(args.gap_us * 1000))
            _row(f"sendmsg {size} B, the reader {mode}", times, f"{100 * cpu:.0f} %")
    a, b = socket.socketpair()
    frame, buf = bytes(120), bytearray(1 << 16)   # a PACKED frame and its descriptor
    with a, b:
        _row("recv(65536) of a 120 B frame", _timed(lambda: b.recv(1 << 16), n,
                                                     lambda: a.send(frame)))
        _row("recv_into of a 120 B frame", _timed(lambda: b.recv_into(buf), n,
                                                   lambda: a.send(frame)))
    pairs = [socket.socketpair() for _ in range(8)]
    with select.epoll() as poll:
        for ours, _ in pairs:
            poll.register(ours.fileno(), select.EPOLLIN)
        pairs[3][1].send(b"x")   # one ready, as when a front has sent
        _row("epoll look over 8 sockets, one ready", _timed(lambda: poll.poll(0), n))
    for pair in pairs:
        for sock in pair:
            sock.close()
    _row("time.perf_counter()", _timed(time.perf_counter, n))


if __name__ == "__main__":
    main()
