"""Actors that learn a gymnasium task whose optimum is known, through a duelq learner.

The tasks are tabular (deterministic FrozenLake and CliffWalking) with one-hot features,
so the linear dueling head can represent Q* exactly, and :func:`check_policy` compares the
learned Q with Q* from value iteration on the task's own transition table.  An actor acts
ε-greedily with weights it pulls from the learner every ``sync_every`` steps (Acme's
variable-client pattern) and feeds the learner one of two ways (a :class:`Feed`):

- :class:`ActorReplay` keeps an :class:`NStepReplay`, sends prioritised batches and writes
  the returned priorities back (TrainStep);
- :class:`ServerReplay` sends each n-step transition once (InsertStream) and asks for one
  step drawn from the server's replay buffer where the other would send a batch
  (TrainReplay).  The actor, not the server's ``replay_ratio`` loop, paces the steps: with
  one actor the inserts and steps reach the server in a fixed order, and the server's
  draws follow from ``replay_seed`` and the inserts, so a run is reproducible; the loop's
  runs would draw from whatever rows had arrived by then.

The learner is reached through callables, so the same actor drives a remote
:class:`~duelq.client.LearnerClient` or an in-process learner: the feed's, and
``pull() -> Params``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol

import numpy as np

from duelq.server.core.batch import Batch
from duelq.server.core.reference import q_values
from duelq.server.core.state import Params

from duelq.client.replay import NStepReplay, NStepReturns
from duelq.wire.types import Transitions

MAX_EPISODE_STEPS = 100


@dataclass(frozen=True)
class Task:
    """A tabular gymnasium task with a known optimum, and the settings that learn it."""

    optimal_return: float             # undiscounted return of an optimal greedy episode
    learner: Mapping[str, Any]        # LearnerConfig settings that learn it
    actor: Mapping[str, Any]          # ActorConfig settings that learn it


#: The supported tasks (their deterministic variants).  CliffWalking's −100 of the cliff
#: needs a squared loss (κ = 100) to be learned in a few thousand steps.
TASKS = {
    "FrozenLake-v1": Task(1.0, {"optimizer": "sgd", "lr": 0.5, "tau": 0.05},
                          {"env_steps": 3000, "eps_decay_steps": 2500}),
    "CliffWalking-v1": Task(-13.0, {"optimizer": "sgd", "lr": 1.0, "tau": 0.05,
                                    "huber_kappa": 100.0},
                            {"env_steps": 12000, "eps_decay_steps": 6000}),
}

PullFn = Callable[[], Params]


def make_env(env_id: str):
    """The gymnasium env ``env_id`` (deterministic variant), with a time limit."""
    if env_id not in TASKS:
        raise ValueError(f"unsupported env {env_id!r}; choose from {sorted(TASKS)}")
    import gymnasium as gym  # optional dependency: pip install 'duelq[demo]'
    return gym.make(env_id, is_slippery=False, max_episode_steps=MAX_EPISODE_STEPS)


def env_dims(env_id: str) -> tuple[int, int]:
    """(hidden_dim, n_actions) a learner needs for ``env_id``'s one-hot features."""
    env = make_env(env_id)
    return int(env.observation_space.n), int(env.action_space.n)


def one_hot(obs: int, n: int) -> np.ndarray:
    h = np.zeros(n, np.float32)  # [H]
    h[obs] = 1.0
    return h


@dataclass
class ActorConfig:
    """Knobs of one actor (:meth:`of` gives a task's own).

    One-step returns: an n-step return without an off-policy correction learns the values
    of the ε-greedy policy that collected it, not Q*.  ε stays at 0.2 so that every
    reachable state's every action keeps being tried.
    """

    env_id: str = "FrozenLake-v1"
    env_steps: int = 3000          # environment steps this actor takes
    batch_size: int = 64           # transitions per training batch
    train_every: int = 1           # env steps between training batches
    warmup: int = 200              # env steps before the first batch
    sync_every: int = 20           # env steps between weight pulls
    n_step: int = 1
    gamma: float = 0.9             # short horizon: clear action gaps in the tabular task
    capacity: int = 20000
    eps_start: float = 1.0         # ε-greedy schedule, linear over eps_decay_steps
    eps_end: float = 0.2
    eps_decay_steps: int = 2500
    seed: int = 0

    @staticmethod
    def of(env_id: str, **settings) -> "ActorConfig":
        """The settings that learn ``env_id``, with ``settings`` over them."""
        return ActorConfig(env_id=env_id, **{**TASKS[env_id].actor, **settings})


@dataclass
class ActorReport:
    episodes: int = 0
    batches: int = 0      # learner steps this actor asked for
    returns: list[float] = field(default_factory=list)  # undiscounted, per finished episode


#: The two feeds, by their ``duelq demo --feed`` names, and the summary's words for them.
FEEDS = {"batches": "batches from the actors' replays",
         "replay": "drawn from the server's replay buffer"}


class Feed(Protocol):
    """How an actor's experience reaches the learner."""

    def add(self, h: np.ndarray, action: int, reward: float, h_next: np.ndarray,
            terminated: bool, truncated: bool) -> None:
        """Record one environment step."""

    def train(self, rng: np.random.Generator) -> bool:
        """One learner step on this actor's behalf; False while there is nothing to draw."""


class ActorReplay:
    """The actor's own prioritised replay: a sampled batch per step, its priorities written
    back.  ``train(batch) -> priorities [B]``."""

    def __init__(self, cfg: ActorConfig, train: Callable[[Batch], np.ndarray]):
        self.replay = NStepReplay(cfg.capacity, env_dims(cfg.env_id)[0], n_step=cfg.n_step,
                                  gamma=cfg.gamma)
        self._train, self._batch_size = train, cfg.batch_size

    def add(self, h, action, reward, h_next, terminated, truncated) -> None:
        self.replay.add(h, action, reward, h_next, terminated, truncated)

    def train(self, rng: np.random.Generator) -> bool:
        batch, idx = self.replay.sample(self._batch_size, rng)
        self.replay.update_priorities(idx, self._train(batch))
        return True


class ServerReplay:
    """The server's replay buffer: each n-step transition inserted once, one step drawn
    from the buffer per :meth:`train` once it holds ``min_size`` rows (its replay_min_size).
    ``insert(rows) -> rows the buffer holds after it``; ``train()`` runs one step."""

    def __init__(self, cfg: ActorConfig, insert: Callable[[Transitions], int],
                 train: Callable[[], None], min_size: int):
        self.returns = NStepReturns(cfg.n_step, cfg.gamma)
        self._insert, self._train, self._min_size = insert, train, min_size
        self.size = 0   # rows in the buffer after this actor's last insert

    def add(self, h, action, reward, h_next, terminated, truncated) -> None:
        rows = self.returns.add(h, action, reward, h_next, terminated, truncated)
        if rows is not None:
            self.size = self._insert(rows)

    def train(self, rng: np.random.Generator) -> bool:
        if self.size < self._min_size:
            return False
        self._train()
        return True


def run_actor(cfg: ActorConfig, feed: Feed, pull: PullFn,
              on_batch: Callable[[], None] | None = None,
              stop: threading.Event | None = None) -> ActorReport:
    """Run one ε-greedy actor for ``cfg.env_steps`` environment steps, or until ``stop``."""
    env = make_env(cfg.env_id)
    n_obs, n_actions = int(env.observation_space.n), int(env.action_space.n)
    rng = np.random.default_rng(cfg.seed)
    report = ActorReport()
    params = pull()
    obs, _ = env.reset(seed=cfg.seed)
    episode_return = 0.0
    for t in range(cfg.env_steps):
        if stop is not None and stop.is_set():
            break
        eps = max(cfg.eps_end, cfg.eps_start - (cfg.eps_start - cfg.eps_end) * t / cfg.eps_decay_steps)
        h = one_hot(obs, n_obs)
        if rng.random() < eps:
            action = int(rng.integers(n_actions))
        else:
            action = int(np.argmax(q_values(params, h[None])[0]))
        obs, reward, terminated, truncated, _ = env.step(action)
        episode_return += float(reward)
        feed.add(h, action, float(reward), one_hot(obs, n_obs), terminated, truncated)
        if terminated or truncated:
            report.returns.append(episode_return)
            report.episodes += 1
            episode_return = 0.0
            obs, _ = env.reset()
        if t >= cfg.warmup and t % cfg.train_every == 0 and feed.train(rng):
            report.batches += 1
            if on_batch is not None:
                on_batch()
        if t % cfg.sync_every == 0:
            params = pull()
    return report


def greedy_return(env_id: str, params: Params) -> float:
    """Undiscounted return of one episode of the greedy policy under ``params``."""
    env = make_env(env_id)
    n_obs = int(env.observation_space.n)
    obs, _ = env.reset(seed=0)
    total, done = 0.0, False
    while not done:
        action = int(np.argmax(q_values(params, one_hot(obs, n_obs)[None])[0]))
        obs, reward, terminated, truncated, _ = env.step(action)
        total += float(reward)
        done = terminated or truncated
    return total


@dataclass(frozen=True)
class PolicyCheck:
    """The learned Q against Q* over the states reachable from the start."""

    states: int          # reachable non-terminal states
    optimal: int         # of them, where the greedy action is an optimal one
    q_error: float       # max |Q − Q*| over their every action
    gamma: float

    @property
    def all_optimal(self) -> bool:
        return self.optimal == self.states


def optimal_q(env_id: str, gamma: float, tolerance: float = 1e-10) -> np.ndarray:
    """Q* [S, A] of ``env_id`` by value iteration on its transition table (gymnasium's
    toy-text ``P[s][a] = [(probability, next state, reward, terminated), …]``)."""
    table = make_env(env_id).unwrapped.P
    S, A = len(table), len(table[0])
    q = np.zeros((S, A))                                                 # [S, A]
    while True:
        v = q.max(axis=1)                                                # [S]
        new = np.array([[sum(p * (r + (0.0 if end else gamma * v[s2]))
                             for p, s2, r, end in table[s][a]) for a in range(A)]
                        for s in range(S)])
        if np.abs(new - q).max() < tolerance:
            return new
        q = new


def reachable_states(env_id: str) -> list[int]:
    """The non-terminal states reachable from the start state, in order."""
    env = make_env(env_id)
    table = env.unwrapped.P
    start, _ = env.reset(seed=0)
    seen, todo = {int(start)}, [int(start)]
    while todo:
        s = todo.pop()
        for outcomes in table[s].values():
            for p, s2, _, end in outcomes:
                if p > 0 and not end and int(s2) not in seen:
                    seen.add(int(s2))
                    todo.append(int(s2))
    return sorted(seen)


def check_policy(env_id: str, params: Params, gamma: float) -> PolicyCheck:
    """The greedy policy of ``params`` against Q* at discount ``gamma``: in how many
    reachable states its action is optimal (ties with the best allowed), and how far Q is."""
    q_star = optimal_q(env_id, gamma)                                    # [S, A]
    states = reachable_states(env_id)
    n_obs = q_star.shape[0]
    q = q_values(params, np.eye(n_obs, dtype=np.float32)[states]).astype(np.float64)  # [R, A]
    best = q_star[states].max(axis=1)                                    # [R]
    chosen = q_star[states, q.argmax(axis=1)]                            # [R]
    return PolicyCheck(states=len(states), optimal=int((chosen >= best - 1e-9).sum()),
                       q_error=float(np.abs(q - q_star[states]).max()), gamma=gamma)
