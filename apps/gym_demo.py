"""``duelq demo --env FrozenLake-v1``: actors learn a real task whose optimum is known.

Each actor thread owns a :class:`LearnerClient` and runs
:func:`duelq.apps.gym_actor.run_actor`: ε-greedy with pulled weights, and per environment
step after the warm-up one learner step, fed as ``--feed`` says: ``batches``, a prioritised
replay in the actor, one TrainStep per batch with the server's priorities written back; or
``replay``, each transition inserted once into the server's replay buffer and one
TrainReplay step drawn from it (reproducible with one actor; see
:class:`~duelq.apps.gym_actor.ServerReplay`).  A monitor
thread evaluates the greedy policy of the current weights as training goes.  The summary
checks the final weights against Q* from value iteration: in how many reachable states
the greedy action is optimal, and the largest |Q − Q*|; a PNG shows return and loss over
learner steps.  Ctrl-C stops the actors early and still reports.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from duelq.client import LearnerClient, Transitions
from duelq.client.client import ServerInfo
from duelq.apps.demo import INTERRUPTED, progress, run_actors
from duelq.apps.gym_actor import (FEEDS, TASKS, ActorConfig, ActorReplay, PolicyCheck,
                                  ServerReplay, check_policy, env_dims, greedy_return,
                                  run_actor)

from duelq.server.core.config import LearnerConfig


@dataclass
class EnvTrace:
    losses: dict[int, float] = field(default_factory=dict)          # step → loss
    greedy: list[tuple[int, float]] = field(default_factory=list)   # (step, greedy return)
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(frozen=True)
class EnvResult:
    env_id: str
    greedy_return: float
    optimum: float
    check: PolicyCheck
    steps: int
    env_steps: int    # per actor
    episodes: int
    seconds: float
    interrupted: bool

    @property
    def optimal(self) -> bool:
        return self.greedy_return >= self.optimum and self.check.all_optimal


def replay_settings(env_id: str) -> dict[str, float]:
    """The server-side replay that ``--feed replay`` gives the learner: as large as an
    actor's own replay, steps of the actors' batch size, training as soon as a batch is in
    (the actors' warm-up holds the first step back, as with ``--feed batches``).  Its
    importance weights are scaled by the smallest priority in the whole buffer (the
    paper's), not in the batch as :class:`NStepReplay`'s, so ``priority_eps`` is 0.01: at
    1e-6 the learned rows' near-zero priorities shrink every step's weights and the
    learning rate with them, leaving |Q − Q*| near 0.2 instead of 0.01."""
    actor = ActorConfig.of(env_id)
    return {"replay_capacity": actor.capacity, "replay_batch_size": actor.batch_size,
            "replay_min_size": actor.batch_size, "priority_eps": 0.01}


def env_config(env_id: str, config: LearnerConfig, defaults: LearnerConfig,
               feed: str = "batches") -> LearnerConfig:
    """``config`` sized for ``env_id``, with the task's learner settings (and with ``feed``
    replay, :func:`replay_settings`) where it kept ``defaults``."""
    H, N = env_dims(env_id)
    settings = {**TASKS[env_id].learner, **(replay_settings(env_id) if feed == "replay" else {})}
    preset = {k: v for k, v in settings.items() if getattr(config, k) == getattr(defaults, k)}
    return dataclasses.replace(config, hidden_dim=H, n_actions=N, **preset)


@contextlib.contextmanager
def inserts(client: LearnerClient) -> Iterator[Callable[[Transitions], int]]:
    """An actor's one InsertStream (opened at the first insert): ``insert(rows)`` returns
    once the server has stored them, with the rows its buffer then holds, so a TrainReplay
    after it can draw them.  A stream for all of them costs a third of a call each."""
    rows: queue.SimpleQueue = queue.SimpleQueue()
    acks = client.insert_stream(iter(rows.get, None), window=1)

    def insert(transitions: Transitions) -> int:
        rows.put(transitions)
        return next(acks).size
    try:
        yield insert
    finally:
        acks.close()   # the stored rows stay; the stream is cancelled


def train_on_env(target: str, env_id: str, *, actors: int, env_steps: int = 0,
                 seed: int = 0, token: str | None = None, feed: str = "batches",
                 replay_min_size: int = 1) -> tuple[EnvResult, EnvTrace]:
    """Run ``actors`` threads of ``env_steps`` environment steps (0: the task's own)
    against ``target``, feeding it as ``feed`` says (with ``replay``, the server's buffer
    trains from ``replay_min_size`` rows)."""
    trace, done, stop = EnvTrace(), threading.Event(), threading.Event()
    failures: list[str] = []
    config = ActorConfig.of(env_id, **({"env_steps": env_steps} if env_steps else {}))
    bars = [progress(config.env_steps - config.warmup, i) for i in range(actors)]
    episodes: list[int] = []

    def record(step: int, loss: float) -> None:
        with trace.lock:
            trace.losses[step] = loss

    def actor(i: int) -> None:
        with LearnerClient(target, token=token) as client, inserts(client) as insert:
            def train_step(batch):
                result = client.train_step(batch)
                record(result.step, result.loss)
                return result.priorities

            def train_replay() -> None:
                result = client.train_replay(1)
                record(result.step, result.loss)
            source = (ServerReplay(config, insert, train_replay, replay_min_size)
                      if feed == "replay" else ActorReplay(config, train_step))
            report = run_actor(dataclasses.replace(config, seed=seed + i), source,
                               lambda: client.get_weights().params, on_batch=bars[i].update,
                               stop=stop)
            episodes.append(report.episodes)

    def monitor() -> None:
        try:
            with LearnerClient(target, token=token) as client:
                while not done.wait(0.25):
                    w = client.get_weights()
                    ret = greedy_return(env_id, w.params)
                    with trace.lock:
                        trace.greedy.append((w.step, ret))
        except Exception as exc:  # noqa: BLE001 — reported, exit 1
            failures.append(f"monitor: {exc}")

    start = time.perf_counter()
    watcher = threading.Thread(target=monitor, name="monitor")
    watcher.start()
    try:
        interrupted = run_actors(actors, actor, stop, failures)
    finally:
        done.set()
        watcher.join()
        for bar in bars:
            bar.close()
    if failures:
        raise RuntimeError("; ".join(failures))
    with LearnerClient(target, token=token) as client:
        final = client.get_weights()
    result = EnvResult(env_id, greedy_return(env_id, final.params),
                       TASKS[env_id].optimal_return,
                       check_policy(env_id, final.params, config.gamma), final.step,
                       config.env_steps, sum(episodes), time.perf_counter() - start,
                       interrupted)
    trace.greedy.append((final.step, result.greedy_return))
    return result, trace


def save_env_plot(trace: EnvTrace, result: EnvResult, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    steps, returns = zip(*sorted(trace.greedy))
    top.step(steps, returns, where="post", lw=2, label="greedy policy")
    top.axhline(result.optimum, color="tab:green", ls="--", label="optimum")
    top.set_ylabel("return")
    top.legend(loc="lower right")
    top.set_title(title)
    s = np.array(sorted(trace.losses))
    bottom.plot(s, [trace.losses[k] for k in s], ".", ms=2, alpha=0.4)
    bottom.set_yscale("log")
    bottom.set_ylabel("Huber loss")
    bottom.set_xlabel("learner step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_env_demo(args: argparse.Namespace, where: str, info: ServerInfo) -> int:
    """The ``--env`` demo against a ready server; the exit code."""
    if (info.hidden_dim, info.n_actions) != env_dims(args.env):
        print(f"duelq demo: the server's head is H={info.hidden_dim}, "
              f"N={info.n_actions}; {args.env} needs H, N = {env_dims(args.env)}")
        return 1
    if args.feed == "replay" and not info.config.get("replay_capacity"):
        print("duelq demo: --feed replay needs a server with its replay buffer on "
              "(duelq serve --replay-capacity C)")
        return 1
    print(f"duelq demo: {args.actors} actors learn {args.env} → {args.target} "
          f"(backend {info.backend} on {info.device}; feed: {args.feed})", flush=True)
    try:
        result, trace = train_on_env(args.target, args.env, actors=args.actors,
                                     env_steps=args.env_steps, seed=args.demo_seed,
                                     token=args.token or None, feed=args.feed,
                                     replay_min_size=info.config.get("replay_min_size", 1))
    except RuntimeError as exc:
        print(f"duelq demo: failed: {exc}")
        return 1
    plot = Path(args.plot).resolve()
    save_env_plot(trace, result, plot, f"duelq demo: {result.env_id}, {args.actors} actors, "
                                       f"feed {args.feed}, backend {info.backend}")
    check = result.check
    verdict = "reaches the optimum" if result.optimal else "does NOT reach the optimum yet"
    print("\n".join([
        f"duelq demo: {result.env_id} on backend {info.backend} ({info.device}, {where})"
        + (" (interrupted)" if result.interrupted else ""),
        f"  {args.actors} actors × {result.env_steps} env steps: {result.episodes} episodes, "
        f"{result.steps} learner steps ({FEEDS[args.feed]}) in {result.seconds:.1f} s",
        f"  greedy action optimal in {check.optimal}/{check.states} reachable states "
        f"(Q* by value iteration, γ = {check.gamma:g}); max |Q − Q*| = {check.q_error:.3f}",
        f"  greedy policy return {result.greedy_return:g} (optimum {result.optimum:g}): "
        f"{verdict}",
        f"  return and loss curves: {plot}",
    ]))
    return INTERRUPTED if result.interrupted else 0
