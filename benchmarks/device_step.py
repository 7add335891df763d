"""Device time of one learner step: duelq's cooperative kernel vs the same step in PyTorch.

    python3 benchmarks/device_step.py [--sizes 256 1024 4096 16384] [--reps 30]

Every variant runs on one CUDA stream and is timed the same way: a spin kernel first
holds the stream while the host queues K calls, then CUDA events around those K calls
give device time without host gaps; the figure is the median over reps of elapsed / K.
"wall" is the sustained rate when the host launches back to back (synchronised at the
end), and "propose" the full round trip of CudaBackend.propose (H2D, kernel, D2H, sync).
Results are checked against the float64 reference before they are timed. The entropy
kernel is timed at M = 16384 against the seeds' kernel (benchmarks/seed_action_entropy.cu).
Prints a table last; writes $OUT/device_step.json when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import cupy as cp
import numpy as np

from duelq.server.core import reference
from duelq.server.core.batch import Batch
from duelq.server.core.config import LearnerConfig
from duelq.server.core.cuda import CudaBackend
from duelq.server.core.state import LearnerState

HERE = Path(__file__).resolve().parent
SPIN = cp.RawKernel(r"""
extern "C" __global__ void spin(long long cycles) {
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
}""", "spin")


class Timer:
    """Times a zero-argument function that enqueues work on ``stream`` (see module doc)."""

    def __init__(self, k: int, reps: int):
        self.k, self.reps = k, reps
        rt = cp.cuda.runtime
        self.clock_hz = 1e3 * rt.deviceGetAttribute(rt.cudaDevAttrClockRate, cp.cuda.Device().id)

    def wall_us(self, stream: cp.cuda.Stream, enqueue) -> float:
        """Host launches back to back, synchronised at the end: µs per call."""
        stream.synchronize()
        t0 = time.perf_counter()
        for _ in range(self.k):
            enqueue()
        stream.synchronize()
        return 1e6 * (time.perf_counter() - t0) / self.k

    def device_us(self, stream: cp.cuda.Stream, enqueue) -> float:
        """Median device µs per call, the queue filled behind a spin kernel."""
        host_s = self.wall_us(stream, enqueue) * self.k * 1e-6  # also a warm-up
        spin_cycles = np.int64(3 * host_s * self.clock_hz + 2e5)
        start, end = cp.cuda.Event(), cp.cuda.Event()
        times = []
        for _ in range(self.reps):
            SPIN((1,), (1,), (spin_cycles,), stream=stream)
            start.record(stream)
            for _ in range(self.k):
                enqueue()
            end.record(stream)
            end.synchronize()
            times.append(1e3 * cp.cuda.get_elapsed_time(start, end) / self.k)
        return statistics.median(times)


def random_batch(rng, B: int, H: int, N: int) -> Batch:
    return Batch(h_t=rng.standard_normal((B, H)).astype(np.float32),
                 h_tp1=rng.standard_normal((B, H)).astype(np.float32),
                 actions=rng.integers(0, N, B).astype(np.int32),
                 rewards=rng.standard_normal(B).astype(np.float32),
                 dones=(rng.random(B) < 0.2).astype(np.float32),
                 discounts=rng.uniform(0.5, 1.0, B).astype(np.float32),
                 weights=rng.uniform(0.0, 2.0, B).astype(np.float32))


def check(name: str, got: float, want: float, rtol: float = 1e-3) -> None:
    if not abs(got - want) <= rtol * abs(want) + 1e-6:
        raise SystemExit(f"check failed: {name}: got {got}, want {want}")


class TorchStep:
    """The same step in PyTorch: autograd, torch.optim.Adam, Polyak update (float32, GPU)."""

    def __init__(self, torch, config: LearnerConfig, state: LearnerState, batch: Batch,
                 capturable: bool):
        self.torch, self.config = torch, config
        dev = "cuda"
        self.theta = [torch.tensor(a, device=dev, requires_grad=True)
                      for a in state.params.arrays()]
        self.target = [torch.tensor(a, device=dev) for a in state.target.arrays()]
        self.opt = torch.optim.Adam(self.theta, lr=config.lr, betas=(config.beta1, config.beta2),
                                    eps=config.adam_eps, capturable=capturable)
        t = lambda a, dt=torch.float32: torch.tensor(a, device=dev, dtype=dt)  # noqa: E731
        self.h_t, self.h_tp1 = t(batch.h_t), t(batch.h_tp1)           # [B, H]
        self.actions = t(batch.actions, torch.int64)                  # [B]
        self.rewards, self.dones, self.discounts, self.weights = (
            t(x) for x in (batch.rewards, batch.dones, batch.discounts, batch.weights))  # [B]

    def q(self, p, h):  # [B, H] → [B, N]
        V, A = h @ p[0] + p[1], h @ p[2] + p[3]
        return V[:, None] + A - A.mean(dim=1, keepdim=True)

    def body(self):
        """Forward, backward, Adam, Polyak; returns the loss tensor."""
        torch = self.torch
        with torch.no_grad():
            q_next = self.q(self.target, self.h_tp1)
            a_star = q_next.argmax(dim=1)
            q_star = q_next.gather(1, a_star[:, None])[:, 0]
            y = self.rewards + self.discounts * (1 - self.dones) * q_star
        q_taken = self.q(self.theta, self.h_t).gather(1, self.actions[:, None])[:, 0]
        huber = torch.nn.functional.huber_loss(q_taken, y, reduction="none",
                                               delta=self.config.huber_kappa)
        loss = (self.weights * huber).sum() / len(self.rewards)
        loss.backward()
        self.opt.step()
        with torch.no_grad():
            torch._foreach_lerp_(self.target, [p.detach() for p in self.theta], self.config.tau)
        return loss

    def eager(self):
        self.opt.zero_grad(set_to_none=True)
        return self.body()

    def graph(self):
        """Capture one step in a CUDA graph (after warm-up); returns its replay function."""
        torch = self.torch
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                self.eager()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        self.opt.zero_grad(set_to_none=True)
        with torch.cuda.graph(graph):
            self.static_loss = self.body()
        return graph.replay


def bench_step(B: int, timer: Timer, torch, rng) -> dict:
    config = LearnerConfig()  # H=128, N=11, Adam, τ=0.005 every step
    state = LearnerState.initial(config)
    batch = random_batch(rng, B, config.hidden_dim, config.n_actions)
    _, want = reference.train_step(state, batch, config, np.float64)

    backend = CudaBackend(config, state)
    got = backend.propose(batch)
    backend.discard()
    check(f"duelq loss B={B}", got.loss, want.loss)
    check(f"duelq grad_norm B={B}", got.grad_norm, want.grad_norm)
    assert np.allclose(got.td_errors, want.td_errors, rtol=1e-3, atol=1e-4)
    row = {"B": B, "blocks": backend.grid(B)[0], "row_tile": backend.step_kernel(B).row_tile}

    stream = backend.stream  # every variant runs on this one stream
    backend.stage(batch)
    launch = lambda: backend.launch(B, True)  # noqa: E731
    row["duelq_us"] = timer.device_us(stream, launch)
    row["duelq_wall_us"] = timer.wall_us(stream, launch)
    samples = []
    for _ in range(timer.reps):
        t0 = time.perf_counter()
        backend.propose(batch)
        backend.discard()
        samples.append(1e6 * (time.perf_counter() - t0))
    row["propose_us"] = statistics.median(samples)

    if torch is not None:
        ext = torch.cuda.ExternalStream(stream.ptr)
        with torch.cuda.stream(ext):
            eager = TorchStep(torch, config, state, batch, capturable=False)
            check(f"torch eager loss B={B}", eager.eager().item(), want.loss)
            row["torch_eager_us"] = timer.device_us(stream, eager.eager)
            row["torch_eager_wall_us"] = timer.wall_us(stream, eager.eager)
            captured = TorchStep(torch, config, state, batch, capturable=True)
            replay = captured.graph()
            row["torch_graph_us"] = timer.device_us(stream, replay)
            row["torch_graph_wall_us"] = timer.wall_us(stream, replay)
    return row


def bench_row_tiles(timer: Timer, rng, sizes=(1024, 16384), tiles=(8, 16, 32)) -> dict:
    """Step device time for a few ROW_TILE choices (the shape of the grid)."""
    config = LearnerConfig()
    state = LearnerState.initial(config)
    out = {}
    for B in sizes:
        batch = random_batch(rng, B, config.hidden_dim, config.n_actions)
        _, want = reference.train_step(state, batch, config, np.float64)
        for tile in tiles:
            backend = CudaBackend(config, state, row_tile=tile)
            check(f"B={B} row_tile={tile} loss", backend.propose(batch).loss, want.loss)
            backend.discard()
            backend.stage(batch)
            out[f"B{B}/tile{tile}"] = {
                "blocks": backend.grid(B)[0],
                "us": timer.device_us(backend.stream, lambda: backend.launch(B, True))}
    return out


def bench_entropy(timer: Timer, rng, M: int = 16384) -> dict:
    config = LearnerConfig()
    N, slot = config.n_actions, config.isv_slots["action_entropy_ema"]
    actions_host = rng.choice(N, size=M, p=rng.dirichlet(np.ones(N))).astype(np.int32)
    want = reference.action_entropy(actions_host, N)
    backend = CudaBackend(config, LearnerState.initial(config))
    check("duelq entropy", backend.entropy(actions_host, slot, 0.1)[0], want)
    stream = backend.stream
    with stream:
        actions = cp.asarray(actions_host)
    ours = timer.device_us(stream, lambda: backend.launch_entropy(actions, slot, 0.1))

    text = (HERE / "seed_action_entropy.cu").read_text().replace("#include <stdint.h>", "")
    seed = cp.RawKernel(text, "action_entropy_per_step")
    isv = cp.zeros(config.isv_size, cp.float32)
    args = (isv, np.int32(slot), np.float32(0.5), actions, np.int32(M))
    with stream:
        seed((1,), (N,), args, stream=stream)
        check("seed entropy", float(isv[slot].get(stream=stream)), want)
    seed_us = timer.device_us(stream, lambda: seed((1,), (N,), args, stream=stream))
    return {"M": M, "duelq_us": ours, "seed_us": seed_us}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024, 4096, 16384])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--k", type=int, default=20, help="calls per timed window")
    args = parser.parse_args()
    try:
        import torch
        torch.cuda.init()
    except ImportError:
        torch = None
    rng = np.random.default_rng(0)
    timer = Timer(args.k, args.reps)
    device = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"]
    device = device.decode() if isinstance(device, bytes) else device

    rows = []
    for B in args.sizes:
        row = bench_step(B, timer, torch, rng)
        rows.append(row)
        print(json.dumps(row), flush=True)
    tiles = bench_row_tiles(timer, rng)
    print("row tiles:", json.dumps(tiles), flush=True)
    entropy = bench_entropy(timer, rng)
    print("entropy:", json.dumps(entropy), flush=True)

    result = {"device": device, "config": LearnerConfig().to_dict(), "k": args.k,
              "reps": args.reps, "step": rows, "row_tiles": tiles, "entropy": entropy}
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "device_step.json").write_text(json.dumps(result, indent=1))
    print_table(result)


def print_table(r: dict) -> None:
    def f(x):
        return "—" if x is None else f"{x:.1f}"

    def ratio(a, b):
        return "—" if a is None or b is None else f"{a / b:.1f}×"

    print(f"\n## duelq device benchmark — {r['device']}, H=128 N=11 Adam, Polyak τ=0.005 "
          f"(µs per step, median of {r['reps']} × {r['k']})")
    print("| B | duelq | torch graph | torch eager | graph/duelq | eager/duelq "
          "| duelq wall | torch eager wall | duelq propose() |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in r["step"]:
        print(f"| {row['B']} | {f(row['duelq_us'])} | {f(row.get('torch_graph_us'))} "
              f"| {f(row.get('torch_eager_us'))} "
              f"| {ratio(row.get('torch_graph_us'), row['duelq_us'])} "
              f"| {ratio(row.get('torch_eager_us'), row['duelq_us'])} "
              f"| {f(row['duelq_wall_us'])} | {f(row.get('torch_eager_wall_us'))} "
              f"| {f(row['propose_us'])} |")
    e = r["entropy"]
    print(f"| entropy M={e['M']} | {f(e['duelq_us'])} | seed {f(e['seed_us'])} | | "
          f"seed/duelq {ratio(e['seed_us'], e['duelq_us'])} | | | | |")
    tiles = ", ".join(f"{t} {v['us']:.1f} µs ({v['blocks']} blocks)"
                      for t, v in r["row_tiles"].items())
    print(f"ROW_TILE sweep: {tiles}")


if __name__ == "__main__":
    main()
