"""The types both ends of the wire share: a training batch, the head's parameters, the
dtype contract.  The client and the server import this package and nothing of each other."""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
FEATURE_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), BFLOAT16)

#: The dtype contract: the dtypes each request tensor field takes, by name (learner.proto's
#: "Dtype …" line of the field; the server refuses any other with INVALID_ARGUMENT and the
#: client before sending).  ``h`` is ActRequest's; ``actions`` is also
#: ComputeEntropyRequest's.  The first of each is the one wider inputs narrow to.
FIELD_DTYPES: dict[str, tuple[str, ...]] = {
    "h_t": ("float32", "float16", "bfloat16"),
    "h_tp1": ("float32", "float16", "bfloat16"),
    "h": ("float32", "float16", "bfloat16"),
    "actions": ("int32", "uint8"),
    "rewards": ("float32", "float16"),
    "dones": ("float32", "bool", "uint8", "int32"),
    "discounts": ("float32",),
    "weights": ("float32",),
    "priorities": ("float32",),
}


def spell(names) -> str:
    """Dtype names as messages list them: "float32, float16 or bfloat16"."""
    names = list(names)
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def wrong_dtype(wanted, got: str) -> str:
    """The words of every dtype refusal: "dtype must be float32 or float16, got int32"."""
    return f"dtype must be {spell(wanted)}, got {got}"


PARAM_NAMES = ("w_v", "b_v", "w_a", "b_a")


@dataclass(frozen=True)
class Params:
    """Dueling-head parameters (or any tensor set of the same shapes: moments, grads)."""

    w_v: np.ndarray  # [H]     value weights
    b_v: np.ndarray  # [1]     value bias
    w_a: np.ndarray  # [H, N]  advantage weights, element c*N + a
    b_a: np.ndarray  # [N]     advantage biases

    def arrays(self) -> tuple[np.ndarray, ...]:
        return tuple(getattr(self, name) for name in PARAM_NAMES)

    def map(self, fn) -> "Params":
        """Apply ``fn`` to each tensor."""
        return Params(*(fn(a) for a in self.arrays()))

    def zip(self, other: "Params", fn) -> "Params":
        """Apply ``fn(mine, theirs)`` tensor by tensor."""
        return Params(*(fn(a, b) for a, b in zip(self.arrays(), other.arrays())))

    def astype(self, dtype) -> "Params":
        """A copy with every tensor converted to ``dtype``."""
        return self.map(lambda a: np.array(a, dtype=dtype))

    def copy(self) -> "Params":
        return self.map(np.copy)

    @staticmethod
    def zeros(hidden_dim: int, n_actions: int, dtype=np.float32) -> "Params":
        return Params(np.zeros(hidden_dim, dtype), np.zeros(1, dtype),
                      np.zeros((hidden_dim, n_actions), dtype), np.zeros(n_actions, dtype))


@dataclass
class Batch:
    """One learner step's inputs, numpy arrays (docs/design.md, the step).

    ``weights`` may be None (all ones).  Features may be float16 or bfloat16
    (``ml_dtypes``); :func:`validate_batch` widens them to float32 unless the
    backend takes them as they are.

    Read-only by convention; not frozen, being built per request (docs/benchmarks.md).
    """

    h_t: np.ndarray        # [B, H] features of s_t
    h_tp1: np.ndarray      # [B, H] features of s_{t+n}
    actions: np.ndarray    # [B] int32 in [0, N)
    rewards: np.ndarray    # [B] float32, n-step discounted return
    dones: np.ndarray      # [B] float32 0/1
    discounts: np.ndarray  # [B] float32 γⁿ in [0, 1]
    weights: np.ndarray | None = None  # [B] float32 ≥ 0, importance-sampling weights

    def arrays(self) -> tuple[np.ndarray, ...]:
        """The arrays in the packed input order (weights last, when present)."""
        head = (self.h_t, self.h_tp1, self.actions, self.rewards, self.dones, self.discounts)
        return head if self.weights is None else head + (self.weights,)

    @property
    def size(self) -> int:
        a = self.actions
        if type(a) is np.ndarray:   # the usual case, without NumPy's generic calls
            return a.shape[0] if a.ndim else 0
        return int(np.shape(a)[0]) if np.ndim(a) else 0


@dataclass
class Transitions:
    """Rows for the server's replay buffer: one n-step transition each, stored as it came
    (docs/design.md, the server-side replay).

    ``priorities`` may be None: each row then gets the largest priority seen so far.

    Read-only by convention; not frozen, being built per request (docs/benchmarks.md).
    """

    h_t: np.ndarray        # [n, H] features of s_t
    h_tp1: np.ndarray      # [n, H] features of s_{t+n}
    actions: np.ndarray    # [n] int32 in [0, N)
    rewards: np.ndarray    # [n] float32, n-step discounted return
    dones: np.ndarray      # [n] float32 0/1
    discounts: np.ndarray  # [n] float32 γⁿ in [0, 1]
    priorities: np.ndarray | None = None  # [n] float32 > 0, initial priorities

    @property
    def size(self) -> int:
        return int(np.shape(self.actions)[0]) if np.ndim(self.actions) else 0


@dataclass(frozen=True)
class ReplayInfo:
    """A replay buffer's figures (GetReplayInfoResponse in learner.proto)."""

    capacity: int
    size: int
    inserted: int
    sampled: int
    draws: int
    cursor: int
    ratio: float          # sampled / inserted (0 before any insert)
    target_ratio: float   # replay_ratio; 0: trains on request only
    beta: float           # β of the next draw
    batch_size: int
    min_size: int
    dtype: str
