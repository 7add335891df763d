"""``duelq demo --env FrozenLake-v1``: actors learn a real task whose optimum is known.

Each actor thread owns a :class:`LearnerClient` and runs
:func:`duelq.apps.gym_actor.run_actor`: ε-greedy with pulled weights, a prioritised
replay, one TrainStep per batch with the server's priorities written back.  A monitor
thread evaluates the greedy policy of the current weights as training goes.  The summary
checks the final weights against Q* from value iteration: in how many reachable states
the greedy action is optimal, and the largest |Q − Q*|; a PNG shows return and loss over
learner steps.  Ctrl-C stops the actors early and still reports.
"""

from __future__ import annotations

import argparse
import dataclasses
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from duelq.client import LearnerClient
from duelq.client.client import ServerInfo
from duelq.apps.demo import INTERRUPTED, progress, run_actors
from duelq.apps.gym_actor import (TASKS, ActorConfig, PolicyCheck, check_policy, env_dims,
                                  greedy_return, run_actor)

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


def env_config(env_id: str, config: LearnerConfig, defaults: LearnerConfig) -> LearnerConfig:
    """``config`` sized for ``env_id``, with the task's learner settings where it kept
    ``defaults``."""
    H, N = env_dims(env_id)
    preset = {k: v for k, v in TASKS[env_id].learner.items()
              if getattr(config, k) == getattr(defaults, k)}
    return dataclasses.replace(config, hidden_dim=H, n_actions=N, **preset)


def train_on_env(target: str, env_id: str, *, actors: int, env_steps: int = 0,
                 seed: int = 0, token: str | None = None) -> tuple[EnvResult, EnvTrace]:
    """Run ``actors`` threads of ``env_steps`` environment steps (0: the task's own)
    against ``target``."""
    trace, done, stop = EnvTrace(), threading.Event(), threading.Event()
    failures: list[str] = []
    config = ActorConfig.of(env_id, **({"env_steps": env_steps} if env_steps else {}))
    bars = [progress(config.env_steps - config.warmup, i) for i in range(actors)]
    episodes: list[int] = []

    def actor(i: int) -> None:
        with LearnerClient(target, token=token) as client:
            def train(batch):
                result = client.train_step(batch)
                with trace.lock:
                    trace.losses[result.step] = result.loss
                return result.priorities
            report = run_actor(dataclasses.replace(config, seed=seed + i), train,
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
    print(f"duelq demo: {args.actors} actors learn {args.env} → {args.target} "
          f"(backend {info.backend} on {info.device})", flush=True)
    try:
        result, trace = train_on_env(args.target, args.env, actors=args.actors,
                                     env_steps=args.env_steps, seed=args.demo_seed,
                                     token=args.token or None)
    except RuntimeError as exc:
        print(f"duelq demo: failed: {exc}")
        return 1
    plot = Path(args.plot).resolve()
    save_env_plot(trace, result, plot, f"duelq demo: {result.env_id}, {args.actors} actors, "
                                       f"backend {info.backend}")
    check = result.check
    verdict = "reaches the optimum" if result.optimal else "does NOT reach the optimum yet"
    print("\n".join([
        f"duelq demo: {result.env_id} on backend {info.backend} ({info.device}, {where})"
        + (" (interrupted)" if result.interrupted else ""),
        f"  {args.actors} actors × {result.env_steps} env steps: {result.episodes} episodes, "
        f"{result.steps} learner steps in {result.seconds:.1f} s",
        f"  greedy action optimal in {check.optimal}/{check.states} reachable states "
        f"(Q* by value iteration, γ = {check.gamma:g}); max |Q − Q*| = {check.q_error:.3f}",
        f"  greedy policy return {result.greedy_return:g} (optimum {result.optimum:g}): "
        f"{verdict}",
        f"  return and loss curves: {plot}",
    ]))
    return INTERRUPTED if result.interrupted else 0
