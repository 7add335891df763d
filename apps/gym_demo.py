"""``duelq demo --env FrozenLake-v1``: actors learn a real task whose optimum is known.

Each actor thread owns a :class:`LearnerClient` and runs
:func:`duelq.client.gym_actor.run_actor`: ε-greedy with pulled weights, an
n-step prioritised replay, one TrainStep per batch with the server's priorities
written back.  A monitor thread evaluates the greedy policy of the current
weights as training goes; the summary compares its final return with the
task's known optimum and a PNG shows return and loss over learner steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from duelq.client import LearnerClient
from duelq.client.client import ServerInfo
from duelq.apps.gym_actor import (OPTIMAL_RETURN, ActorConfig, env_dims, greedy_return,
                                    run_actor)

from duelq.server.core.config import LearnerConfig

#: Learner settings that learn the tabular task in a couple of thousand steps; applied
#: to every knob the command line left at its default.
PRESET = {"optimizer": "sgd", "lr": 0.5, "tau": 0.05}


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
    steps: int
    episodes: int
    seconds: float

    @property
    def optimal(self) -> bool:
        return self.greedy_return >= self.optimum


def env_config(env_id: str, config: LearnerConfig, defaults: LearnerConfig) -> LearnerConfig:
    """``config`` sized for ``env_id``, with :data:`PRESET` where it kept ``defaults``."""
    H, N = env_dims(env_id)
    preset = {k: v for k, v in PRESET.items() if getattr(config, k) == getattr(defaults, k)}
    return dataclasses.replace(config, hidden_dim=H, n_actions=N, **preset)


def train_on_env(target: str, env_id: str, *, actors: int, env_steps: int, seed: int = 0,
                 token: str | None = None, progress: bool = True) -> tuple[EnvResult, EnvTrace]:
    """Run ``actors`` threads of ``env_steps`` environment steps against ``target``."""
    trace, done = EnvTrace(), threading.Event()
    failures: list[str] = []
    batches = env_steps - ActorConfig.warmup
    bars = [tqdm(total=batches, desc=f"actor {i}", position=i, unit="batch",
                 mininterval=0.25, disable=not progress) for i in range(actors)]

    def actor(i: int) -> None:
        with LearnerClient(target, token=token) as client:
            def train(batch):
                result = client.train_step(batch)
                with trace.lock:
                    trace.losses[result.step] = result.loss
                return result.priorities
            report = run_actor(ActorConfig(env_id=env_id, env_steps=env_steps, seed=seed + i),
                               train, lambda: client.get_weights().params,
                               on_batch=bars[i].update)
            episodes.append(report.episodes)

    def monitor() -> None:
        with LearnerClient(target, token=token) as client:
            while not done.wait(0.25):
                w = client.get_weights()
                ret = greedy_return(env_id, w.params)
                with trace.lock:
                    trace.greedy.append((w.step, ret))

    def guarded(fn, *a):
        try:
            fn(*a)
        except Exception as exc:  # noqa: BLE001 — reported, exit 1
            failures.append(f"{threading.current_thread().name}: {exc}")

    episodes: list[int] = []
    start = time.perf_counter()
    workers = [threading.Thread(target=guarded, args=(actor, i), name=f"actor-{i}")
               for i in range(actors)]
    watcher = threading.Thread(target=guarded, args=(monitor,), name="monitor")
    for t in workers + [watcher]:
        t.start()
    for t in workers:
        t.join()
    done.set()
    watcher.join()
    for bar in bars:
        bar.close()
    if failures:
        raise RuntimeError("; ".join(failures))
    with LearnerClient(target, token=token) as client:
        final = client.get_weights()
    result = EnvResult(env_id, greedy_return(env_id, final.params), OPTIMAL_RETURN[env_id],
                       final.step, sum(episodes), time.perf_counter() - start)
    trace.greedy.append((final.step, result.greedy_return))
    return result, trace


def save_env_plot(trace: EnvTrace, result: EnvResult, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    steps, returns = zip(*trace.greedy)
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


def run_env_demo(args: argparse.Namespace, info: ServerInfo) -> int:
    """The ``--env`` branch of ``duelq demo`` against a ready server; the exit code."""
    backend, device = info.backend, info.device
    if (info.hidden_dim, info.n_actions) != env_dims(args.env):
        print(f"duelq demo: the server's head is H={info.hidden_dim}, "
              f"N={info.n_actions}; {args.env} needs H, N = {env_dims(args.env)}")
        return 1
    try:
        result, trace = train_on_env(args.target, args.env, actors=args.actors,
                                     env_steps=args.env_steps, seed=args.demo_seed,
                                     token=args.token or None)
    except RuntimeError as exc:
        print(f"duelq demo: failed: {exc}")
        return 1
    plot = Path(args.plot).resolve()
    save_env_plot(trace, result, plot, f"duelq demo: {result.env_id}, {args.actors} actors, "
                                       f"backend {backend}")
    verdict = "reaches the optimum" if result.optimal else "does NOT reach the optimum yet"
    print("\n".join([
        f"duelq demo: {result.env_id} on backend {backend} ({device})",
        f"  {args.actors} actors × {args.env_steps} env steps: {result.episodes} episodes, "
        f"{result.steps} learner steps in {result.seconds:.1f} s",
        f"  greedy policy return {result.greedy_return:g} (optimum {result.optimum:g}): "
        f"{verdict}",
        f"  return and loss curves: {plot}",
    ]))
    return 0
