"""Device time of one step drawn from the server-side replay against the plain learner step.

    python3 benchmarks/replay_step.py [--capacity 1000000] [--sizes 256 1024 4096] [--reps 30]

A replay step is three launches (replay_sample, learner_step, replay_commit: the draw, the
step, the write-back and the tree update), timed as a run of CALL_STEPS enqueues them (the
C call of server/core/cuda_replay.py, not waited for); the plain step is learner_step
alone on the same gathered batch; "draw alone" and "commit alone" time replay_sample and
replay_commit by themselves, the commit also on other block counts than tree_blocks picks.
All are timed as benchmarks/device_step.py times a step (the queue filled behind a spin
kernel, CUDA events around K calls, the median over reps). "host run" is the wall time
per step of Learner.train_replay(512) from the host, syncs included. The buffer holds
``--capacity`` random float32 rows of H = 128 (N = 11) with random priorities; each size's
first run is checked to apply every step before anything is timed. Prints a table; writes
$OUT/replay_step.json when OUT is set.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import time
from pathlib import Path

import numpy as np
from cupy_backends.cuda.api import driver

from device_step import Timer

from duelq.server.core.cuda import THREADS
from duelq.server.core.cuda_replay import CALL_STEPS

from duelq.server.core.config import LearnerConfig
from duelq.server.core.learner import Learner
from duelq.wire.types import Transitions


def filled(capacity: int, B: int, rng: np.random.Generator) -> Learner:
    config = LearnerConfig(replay_capacity=capacity, replay_batch_size=B, replay_min_size=1)
    learner = Learner(config, backend="cuda", max_batch_size=65536)
    H, N = config.hidden_dim, config.n_actions
    for start in range(0, capacity, 65536):
        n = min(65536, capacity - start)
        learner.insert(Transitions(
            h_t=rng.standard_normal((n, H), np.float32),
            h_tp1=rng.standard_normal((n, H), np.float32),
            actions=rng.integers(0, N, n, dtype=np.int32),
            rewards=rng.standard_normal(n, np.float32),
            dones=(rng.random(n) < 0.1).astype(np.float32),
            discounts=np.full(n, 0.97, np.float32),
            priorities=rng.uniform(0.01, 2.0, n).astype(np.float32)))
    return learner


def measure(capacity: int, B: int, timer: Timer, rng: np.random.Generator) -> dict:
    learner = filled(capacity, B, rng)
    replay, backend = learner.replay, learner.backend
    run = learner.train_replay(3)
    assert (run.steps, run.refused) == (3, False), run
    G = backend.grid(B)[0]
    draws = iter(range(10 ** 9))

    def replay_run() -> None:   # CALL_STEPS steps, enqueued as a run is, not waited for
        backend._native.replay_run(ctypes.addressof(replay._prepare(CALL_STEPS, G)))

    def plain_step() -> None:
        backend.launch(B, True, replay._gathered, replay._kind)

    def draw() -> None:
        replay.draw_alone(next(draws))

    def commit(blocks: int) -> None:   # the last step's outputs, committed again
        replay._commit_args.barrier = replay._barriers(replay._tree_barriers)
        driver.launchCooperativeKernel(
            replay._commit.kernel.ptr, blocks, 1, 1, THREADS, 1, 1, 0, backend.stream.ptr,
            ctypes.addressof(replay._commit_params))

    with backend.stream:
        replay_us = Timer(1, timer.reps).device_us(backend.stream, replay_run) / CALL_STEPS
        plain_us = timer.device_us(backend.stream, plain_step)
        draw_us = timer.device_us(backend.stream, draw)
        commit_us = timer.device_us(backend.stream, lambda: commit(replay._blocks(B)))
        sweep = {blocks: timer.device_us(backend.stream, lambda blocks=blocks: commit(blocks))
                 for blocks in sorted({16, 32, 64, backend.max_blocks})}
    start = time.perf_counter()
    run = learner.train_replay(64 * 8)
    run_us = 1e6 * (time.perf_counter() - start) / max(run.steps, 1)
    return {"capacity": capacity, "batch": B, "replay_us": replay_us, "plain_us": plain_us,
            "ratio": replay_us / plain_us, "run_us": run_us,
            "draw_us": draw_us, "commit_us": commit_us, "commit_by_blocks": sweep}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity", type=int, default=1_000_000)
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--k", type=int, default=64, help="steps per timed group")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    timer = Timer(args.k, args.reps)
    rows = [measure(args.capacity, B, timer, rng) for B in args.sizes]
    print(f"## replay step, {args.capacity} rows, H = 128, N = 11 (device µs per step)")
    print("| B | replay step | plain step | replay / plain | draw alone | commit alone "
          "| host run, µs/step |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['replay_us']:.1f} | {r['plain_us']:.1f} | "
              f"{r['ratio']:.2f} | {r['draw_us']:.1f} | {r['commit_us']:.1f} | "
              f"{r['run_us']:.1f} |")
    for r in rows:
        print(f"commit alone by blocks, B = {r['batch']}: " + ", ".join(
            f"{g}: {us:.1f} µs" for g, us in r["commit_by_blocks"].items()))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "replay_step.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
