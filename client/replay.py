"""Actor-side n-step prioritised replay that produces duelq training batches.

Transitions are stored as n-step returns: ``r = Σ_{k<n} γᵏ r_{t+k}``, ``h_tp1`` the
features n steps later, ``discount = γⁿ`` (γᵏ when the episode ended after k < n steps,
with ``done = 1``).  Sampling is proportional to ``priority^α`` with importance weights
``(M·P)^(−β) / max``, as in Schaul et al. (2016); the server's returned priorities
(``|δ| + ε``) are written back with :meth:`NStepReplay.update_priorities`.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from duelq.wire.types import Batch


class NStepReplay:
    """A ring buffer of n-step transitions with proportional prioritised sampling."""

    def __init__(self, capacity: int, hidden_dim: int, *, n_step: int = 3, gamma: float = 0.99,
                 alpha: float = 0.6, beta: float = 0.4):
        if capacity < 1 or hidden_dim < 1 or n_step < 1:
            raise ValueError("capacity, hidden_dim and n_step must be ≥ 1")
        if not 0 <= gamma <= 1 or alpha < 0 or beta < 0:
            raise ValueError("need 0 ≤ gamma ≤ 1, alpha ≥ 0, beta ≥ 0")
        self.capacity, self.n_step, self.gamma = capacity, n_step, gamma
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
        self._pending: deque[tuple[np.ndarray, int, float]] = deque()  # (h, a, r) of this episode

    def __len__(self) -> int:
        return self.size

    def add(self, h: np.ndarray, action: int, reward: float, h_next: np.ndarray,
            terminated: bool, truncated: bool = False) -> None:
        """Record one environment step; emits n-step transitions as they complete.

        ``terminated`` ends the return (done = 1); ``truncated`` (a time limit) ends the
        episode but keeps bootstrapping from ``h_next``.
        """
        self._pending.append((np.asarray(h, np.float32), int(action), float(reward)))
        if terminated or truncated:
            while self._pending:
                self._emit(h_next, done=terminated)
        elif len(self._pending) == self.n_step:
            self._emit(h_next, done=False)

    def _emit(self, h_last: np.ndarray, done: bool) -> None:
        """Turn the oldest pending step into a transition that bootstraps from ``h_last``."""
        ret = sum(self.gamma ** k * r for k, (_, _, r) in enumerate(self._pending))
        h, a, _ = self._pending.popleft()
        k = len(self._pending) + 1  # steps between h and h_last
        i = self._next
        self.h_t[i], self.h_tp1[i], self.actions[i] = h, h_last, a
        self.rewards[i], self.dones[i], self.discounts[i] = ret, float(done), self.gamma ** k
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
