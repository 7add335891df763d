"""Actor-side n-step transitions, and a prioritised replay of them that produces duelq
training batches.

:class:`NStepReturns` turns environment steps into n-step transitions: ``r = Σ_{k<n} γᵏ
r_{t+k}``, ``h_tp1`` the features n steps later, ``discount = γⁿ`` (γᵏ when the episode
ended after k < n steps, with ``done = 1``).  Its rows go to the server's replay buffer
(``LearnerClient.insert``) or to :class:`NStepReplay`, whose sampling is proportional to
``priority^α`` with importance weights ``(M·P)^(−β) / max``, as in Schaul et al. (2016);
the server's returned priorities (``|δ| + ε``) are written back with
:meth:`NStepReplay.update_priorities`.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from duelq.wire.types import Batch, Transitions


class NStepReturns:
    """The n-step transitions of one actor's environment steps, emitted as they complete."""

    def __init__(self, n_step: int, gamma: float):
        if n_step < 1:
            raise ValueError("n_step must be ≥ 1")
        if not 0 <= gamma <= 1:
            raise ValueError("need 0 ≤ gamma ≤ 1")
        self.n_step, self.gamma = n_step, gamma
        self._pending: deque[tuple[np.ndarray, int, float]] = deque()  # (h, a, r) of this episode

    def add(self, h: np.ndarray, action: int, reward: float, h_next: np.ndarray,
            terminated: bool, truncated: bool = False) -> Transitions | None:
        """Record one environment step; the transitions it completes (None if none).

        ``terminated`` ends the return (done = 1) and completes every pending step;
        ``truncated`` (a time limit) ends the episode too but keeps bootstrapping from
        ``h_next``.
        """
        self._pending.append((np.asarray(h, np.float32), int(action), float(reward)))
        if terminated or truncated:
            count = len(self._pending)
        elif len(self._pending) == self.n_step:
            count = 1
        else:
            return None
        rows = [self._emit() for _ in range(count)]
        h_t, actions, rewards, discounts = zip(*rows)
        return Transitions(
            h_t=np.stack(h_t),                                                  # [n, H]
            h_tp1=np.repeat(np.asarray(h_next, np.float32)[None], count, 0),    # [n, H]
            actions=np.array(actions, np.int32), rewards=np.array(rewards, np.float32),
            dones=np.full(count, float(terminated), np.float32),
            discounts=np.array(discounts, np.float32))

    def _emit(self) -> tuple[np.ndarray, int, float, float]:
        """(h, action, return, discount) of the oldest pending step, up to the latest state
        (its h_tp1)."""
        ret = sum(self.gamma ** k * r for k, (_, _, r) in enumerate(self._pending))
        h, a, _ = self._pending.popleft()
        k = len(self._pending) + 1  # steps between h and the latest state
        return h, a, ret, self.gamma ** k


class NStepReplay:
    """A ring buffer of n-step transitions with proportional prioritised sampling."""

    def __init__(self, capacity: int, hidden_dim: int, *, n_step: int = 3, gamma: float = 0.99,
                 alpha: float = 0.6, beta: float = 0.4):
        if capacity < 1 or hidden_dim < 1:
            raise ValueError("capacity and hidden_dim must be ≥ 1")
        if alpha < 0 or beta < 0:
            raise ValueError("need alpha ≥ 0, beta ≥ 0")
        self.returns = NStepReturns(n_step, gamma)
        self.capacity = capacity
        self.alpha, self.beta = alpha, beta
        self.h_t = np.zeros((capacity, hidden_dim), np.float32)    # [C, H]
        self.h_tp1 = np.zeros((capacity, hidden_dim), np.float32)  # [C, H]
        self.actions = np.zeros(capacity, np.int32)                # [C]
        self.rewards = np.zeros(capacity, np.float32)              # [C]
        self.dones = np.zeros(capacity, np.float32)                # [C]
        self.discounts = np.zeros(capacity, np.float32)            # [C]
        self.priorities = np.zeros(capacity, np.float64)           # [C]
        self._next = 0
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def add(self, h: np.ndarray, action: int, reward: float, h_next: np.ndarray,
            terminated: bool, truncated: bool = False) -> None:
        """Record one environment step (as :meth:`NStepReturns.add`); stores the n-step
        transitions it completes, each with the largest priority so far."""
        rows = self.returns.add(h, action, reward, h_next, terminated, truncated)
        for r in range(rows.size if rows is not None else 0):
            i = self._next
            self.h_t[i], self.h_tp1[i] = rows.h_t[r], rows.h_tp1[r]
            self.actions[i], self.rewards[i] = rows.actions[r], rows.rewards[r]
            self.dones[i], self.discounts[i] = rows.dones[r], rows.discounts[r]
            self.priorities[i] = self.priorities[:self.size].max() if self.size else 1.0
            self._next = (i + 1) % self.capacity
            self.size = min(self.size + 1, self.capacity)

    def sample(self, batch_size: int, rng: np.random.Generator) -> tuple[Batch, np.ndarray]:
        """A prioritised batch and the buffer indices it came from."""
        if self.size == 0:
            raise ValueError("cannot sample from an empty replay buffer")
        p = self.priorities[:self.size] ** self.alpha
        p /= p.sum()
        idx = rng.choice(self.size, size=batch_size, p=p)             # [B]
        weights = (self.size * p[idx]) ** (-self.beta)
        weights = (weights / weights.max()).astype(np.float32)        # [B]
        return Batch(h_t=self.h_t[idx], h_tp1=self.h_tp1[idx], actions=self.actions[idx],
                     rewards=self.rewards[idx], dones=self.dones[idx],
                     discounts=self.discounts[idx], weights=weights), idx

    def update_priorities(self, indices: np.ndarray, priorities: np.ndarray) -> None:
        """Write back the learner's ``|δ| + ε`` for sampled ``indices``."""
        self.priorities[indices] = np.asarray(priorities, np.float64)
