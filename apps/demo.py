"""``duelq demo``: several actors train one learner over gRPC on a synthetic task.

The task is a contextual bandit with bootstrapped targets: a state's features
h are standard normal, taking action a pays ``h · R[:, a] + bias[a]`` plus
noise, and the episode continues with probability CONTINUE_PROB into an
independent next state.  Its optimal Q is linear in h, so the dueling head can
learn it exactly and the greedy policy's hit rate on the best action shows
that it did; ``bias`` favours a few actions, so the entropy of the actions
taken falls as ε decays and the policy sharpens.

Each actor thread owns a LearnerClient (the real client library): it pulls
weights every ``--sync-every`` batches (Acme's variable-client pattern), acts
ε-greedily with them, streams its batches through ``train_stream`` and folds
its actions' entropy into the ``action_entropy_ema`` ISV slot with
ComputeEntropy.  tqdm draws one progress bar per actor on a terminal; matplotlib
(Agg, no display needed) saves the loss curve as a PNG.  Ctrl-C stops the actors
after their batches in flight and still prints the summary and saves the plot.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
from tqdm import tqdm

from duelq.client import Batch, LearnerClient, errors
from duelq.client.client import ServerInfo

from duelq.server.core.config import LearnerConfig
from duelq.server.core.learner import cuda_usable
from duelq.server.fronts import start_server
from duelq.server.server import ServerOptions

log = logging.getLogger(__name__)

ENTROPY_SLOT = "action_entropy_ema"
INTERRUPTED = 130   # the exit code after Ctrl-C, as a shell's
CONTINUE_PROB, GAMMA, NOISE = 0.3, 0.5, 0.1


@dataclass
class Trace:
    """What the actors observed, shared under a lock; ``stop`` asks them to finish early."""

    losses: dict[int, float] = field(default_factory=dict)  # step → loss
    entropy: list[tuple[int, float]] = field(default_factory=list)  # (step, EMA)
    failures: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)


def run_actors(count: int, actor: Callable[[int], None], stop: threading.Event,
               failures: list[str]) -> bool:
    """Run ``actor(i)`` on ``count`` threads until they end; a failure is appended to
    ``failures``.  Ctrl-C sets ``stop`` and waits for the actors to wind down; returns
    whether it came."""
    def guarded(i: int) -> None:
        try:
            actor(i)
        except Exception as exc:  # noqa: BLE001 — reported in the summary, exit 1
            failures.append(f"actor {i}: {exc}")
    threads = [threading.Thread(target=guarded, args=(i,), name=f"actor-{i}")
               for i in range(count)]
    interrupted = False
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            try:
                t.join()
            except KeyboardInterrupt:
                interrupted = True
                stop.set()
                print("duelq demo: interrupted; letting the batches in flight finish",
                      file=sys.stderr)
    return interrupted


def progress(total: int, index: int) -> tqdm:
    """Actor ``index``'s progress bar, drawn only on a terminal (stderr)."""
    return tqdm(total=total, desc=f"actor {index}", position=index, leave=True,
                mininterval=0.25, unit="batch", disable=None)


class Task:
    """The synthetic task: reward weights R [H, N]."""

    def __init__(self, hidden_dim: int, n_actions: int, seed: int):
        rng = np.random.default_rng(seed)
        self.R = (rng.standard_normal((hidden_dim, n_actions))
                  / math.sqrt(hidden_dim)).astype(np.float32)        # [H, N]
        self.bias = np.linspace(-2.0, 2.0, n_actions, dtype=np.float32)  # [N]

    def states(self, rng: np.random.Generator, rows: int) -> np.ndarray:
        return rng.standard_normal((rows, self.R.shape[0]), dtype=np.float32)  # [B, H]

    def payoff(self, h: np.ndarray) -> np.ndarray:
        return h @ self.R + self.bias                        # [B, N]

    def best(self, h: np.ndarray) -> np.ndarray:
        return self.payoff(h).argmax(axis=1)                 # [B]

    def batch(self, rng: np.random.Generator, actions_of, rows: int) -> Batch:
        h_t = self.states(rng, rows)                         # [B, H]
        actions = actions_of(h_t).astype(np.int32)           # [B]
        rewards = self.payoff(h_t)[np.arange(rows), actions] \
            + NOISE * rng.standard_normal(rows, dtype=np.float32)  # [B]
        dones = (rng.random(rows) > CONTINUE_PROB).astype(np.float32)  # [B]
        return Batch(h_t=h_t, h_tp1=self.states(rng, rows), actions=actions,
                     rewards=rewards.astype(np.float32), dones=dones,
                     discounts=np.full(rows, GAMMA, np.float32))


def greedy(params, h: np.ndarray) -> np.ndarray:
    """argmax_a Q(h)[a] of the dueling head; the V and mean-A terms do not change it."""
    return (h @ params.w_a + params.b_a).argmax(axis=1)     # [B]


def actor(index: int, args: argparse.Namespace, task: Task, n_actions: int,
          trace: Trace, bar: tqdm) -> None:
    """One actor: pull weights, act ε-greedily, stream batches, report entropy."""
    rng = np.random.default_rng([args.demo_seed, index])
    with LearnerClient(args.target, token=args.token or None) as client:
        params = client.get_weights().params

        def batches():
            nonlocal params
            for i in range(args.steps):
                if trace.stop.is_set():
                    return
                if i and i % args.sync_every == 0:
                    params = client.get_weights().params
                epsilon = max(0.1, 1.0 - i / (0.6 * args.steps))

                def act(h):
                    explore = rng.random(h.shape[0]) < epsilon
                    return np.where(explore, rng.integers(0, n_actions, h.shape[0]),
                                    greedy(params, h))
                batch = task.batch(rng, act, args.batch_size)
                if i % args.sync_every == 0:
                    ema = client.compute_entropy(batch.actions, ENTROPY_SLOT, alpha=0.2).ema
                    with trace.lock:
                        trace.entropy.append((len(trace.losses), ema))
                yield batch

        for result in client.train_stream(batches(), window=args.window):
            with trace.lock:
                trace.losses[result.step] = result.loss
            bar.set_postfix(loss=f"{result.loss:.4f}", step=result.step, refresh=False)
            bar.update()


def save_plot(trace: Trace, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = np.array(sorted(trace.losses))
    losses = np.array([trace.losses[s] for s in steps])
    width = max(1, len(steps) // 50)
    smooth = np.convolve(losses, np.ones(width) / width, mode="valid")
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True,
                                      gridspec_kw={"height_ratios": [2, 1]})
    top.plot(steps, losses, ".", ms=2, alpha=0.3, label="loss per step")
    top.plot(steps[width - 1:], smooth, lw=2, label=f"mean of {width} steps")
    top.set_yscale("log")
    top.set_ylabel("Huber loss")
    top.legend()
    top.set_title(title)
    if trace.entropy:
        e_steps, emas = zip(*sorted(trace.entropy))
        bottom.plot(e_steps, emas, lw=1.5, color="tab:green")
    bottom.set_ylabel("action entropy EMA (nats)")
    bottom.set_xlabel("learner step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary(info: ServerInfo, where: str, args: argparse.Namespace, trace: Trace,
            seconds: float, hit_rate: float, isv_value: float, plot: Path | None) -> str:
    losses = np.array([trace.losses[s] for s in sorted(trace.losses)])
    steps = len(losses)
    n = info.n_actions
    if steps:
        tenth = max(1, steps // 10)
        first, last = losses[:tenth].mean(), losses[-tenth:].mean()
        trend = (f"  loss: first tenth {first:.4f} → last tenth {last:.4f} "
                 f"({(last / first - 1) * 100:+.0f}%)")
    else:
        trend = "  loss: no step finished"
    stopped = " (interrupted)" if trace.stop.is_set() else ""
    return "\n".join([
        f"duelq demo: backend {info.backend} on {info.device} ({where}){stopped}",
        f"  {args.actors} actors × {args.steps} batches of B={args.batch_size}: {steps} steps, "
        f"{steps * args.batch_size} transitions in {seconds:.1f} s "
        f"({steps * args.batch_size / seconds:,.0f} transitions/s, {steps / seconds:.0f} steps/s)",
        trend,
        f"  action entropy EMA (ISV {ENTROPY_SLOT}): {isv_value:.3f} nats "
        f"(uniform: ln {n} = {math.log(n):.3f})",
        f"  greedy policy picks the best action on {hit_rate:.0%} of fresh states "
        f"(chance: {1 / n:.0%})",
        f"  server step {info.step}, weights version {info.version}",
        f"  loss curve: {plot or 'none (no step finished)'}",
    ])


#: A demo's body, run against a ready server: (args, where the server is, its info) → exit.
DemoBody = Callable[[argparse.Namespace, str, ServerInfo], int]


def run_demo(args: argparse.Namespace, config: LearnerConfig, options: ServerOptions,
             body: DemoBody | None = None) -> int:
    """Start the server (or reach ``--target``) and run ``body`` (the synthetic demo by
    default) against it; the exit code: 0 when every actor finished, 1 otherwise, 130
    after Ctrl-C."""
    server = None
    if args.target:
        where = f"server at {args.target}"
    else:
        ok, why = cuda_usable()
        where = "in-process server" + ("" if ok or args.backend == "reference"
                                       else f"; no usable GPU: {why}")
        try:
            server = start_server(config, options, backend=args.backend)
        except (OSError, RuntimeError) as exc:
            print(f"duelq demo: cannot start the server: {exc}")
            return 1
    try:
        target = args.target or server.target
        try:
            with LearnerClient(target, token=args.token or None) as client:
                if args.target:   # should be up: a dead target fails at once, not at a timeout
                    client.info()
                client.wait_ready(timeout=args.ready_timeout)
                info = client.info()
        except errors.DuelqError as exc:
            print(f"duelq demo: {exc}")
            return 1
        args.target = target
        return (body or run_synthetic)(args, where, info)
    finally:
        if server is not None:
            server.stop(1.0)


def run_synthetic(args: argparse.Namespace, where: str, info: ServerInfo) -> int:
    """The synthetic task's demo against a ready server."""
    H, N = info.hidden_dim, info.n_actions
    print(f"duelq demo: {args.actors} actors → {args.target} "
          f"(backend {info.backend} on {info.device}, H={H}, N={N})", flush=True)
    task = Task(H, N, args.demo_seed)
    trace = Trace()
    bars = [progress(args.steps, i) for i in range(args.actors)]
    start = time.perf_counter()
    interrupted = run_actors(args.actors, lambda i: actor(i, args, task, N, trace, bars[i]),
                             trace.stop, trace.failures)
    seconds = time.perf_counter() - start
    for bar in bars:
        bar.close()
    if trace.failures:
        print("duelq demo: failed\n  " + "\n  ".join(trace.failures))
        return 1

    with LearnerClient(args.target, token=args.token or None) as client:
        probe = task.states(np.random.default_rng(args.demo_seed + 1), 2048)
        hit_rate = float((client.act(probe).actions == task.best(probe)).mean())
        isv_value = client.read_isv([ENTROPY_SLOT])[0].value
        info = client.info()
    plot = Path(args.plot).resolve() if trace.losses else None
    if plot is not None:
        save_plot(trace, plot, f"duelq demo: {args.actors} actors, backend {info.backend} "
                               f"on {info.device}")
    print(summary(info, where, args, trace, seconds, hit_rate, isv_value, plot))
    return INTERRUPTED if interrupted else 0
