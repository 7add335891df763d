"""The server-side prioritised replay buffer (docs/design.md, "The server-side replay"):
storage, proportional sampling, importance weights, priority write-back, in NumPy.

This module is the readable specification and the oracle of the CUDA kernels
(kernels/replay.cu, server/core/cuda_replay.py): both draw the same random numbers and walk
the same tree with the same additions in the same order, so they sample the same rows.

**Storage.** C rows (``replay_capacity``), each (h_t [H], h_tp1 [H] in ``replay_dtype``,
action, reward, done, discount) with a priority p > 0.  An insert writes its rows at the
cursor, which wraps: a full buffer overwrites its oldest rows.  A row inserted without a
priority gets the largest priority written so far (1 before any).

**The tree.** Leaf i holds p_i^α as float32 (0 for an empty row), computed as
``(float) pow((double) p, α)``.  Above the leaves, 32-ary levels: a node's sum (float64)
is the sum of its 32 children as a warp's xor butterfly leaves it in lane 0
(:func:`butterfly_sums`), its min (float32) the least positive child (+inf for none).
Level k has ceil(C / 32^k) nodes, padded to whole groups of 32; the root is the first level
of one node.  A node is a pure function of its children, so a tree rebuilt from its leaves
has the same bits as one kept up to date.

**Sampling.** Draw d (0, 1, 2, … over the buffer's life) of B rows: row b takes the uniform
u_b ∈ [0, 1) of :func:`uniforms`, the mass u_b · total, and walks down from the root: among a
node's 32 children it takes the first positive child whose inclusive prefix sum (a warp's
Hillis–Steele scan, :func:`inclusive_scan`) exceeds the mass, or the last positive child
when none does, and subtracts the prefix before that child.  Every child taken is positive,
so the leaf reached is a stored row, with probability p^α / Σ p^α.

**Importance weights.** w_b = (min leaf / leaf_b)^β, in float64 then float32: the paper's
(C_used · P(i))^(−β) divided by the largest weight in the buffer, that of the smallest
priority.  β of draw d: :func:`beta_at`.

**Write-back.** After a step, each sampled row's priority becomes the step's |δ| + ε (at
most FLT_MAX); a row drawn twice in one batch takes its last occurrence in batch order.  A
step that is refused (non-finite) changes nothing but consumes its draw.

The float64 ``pow`` of leaves and weights is the one operation the host's libm and CUDA may
round differently (in the last bit of the float64, which the float32 result hides but for
about one value in 10^8); everything else is exact and ordered alike.
"""

from __future__ import annotations

import abc
import hashlib
import json
import struct
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from duelq.server.core.backend import Backend, Upload
from duelq.server.core.batch import PackedBatch, validate_batch
from duelq.server.core.config import LearnerConfig
from duelq.server.core.errors import InvalidArgument, ReplayNotReady
from duelq.wire.types import BFLOAT16, FEATURE_DTYPES, Batch, ReplayInfo, Transitions

FANOUT = 32                 # children per tree node: a warp's lanes
FLT_MAX = float(np.finfo(np.float32).max)
PHILOX_M = (0xD2511F53, 0xCD9E8D57)   # Philox4x32 round multipliers
PHILOX_W = (0x9E3779B9, 0xBB67AE85)   # Philox4x32 key schedule (Weyl) increments
PHILOX_ROUNDS = 10
STORAGE_DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
                  "bfloat16": BFLOAT16}
_WORD = 0xFFFFFFFF


# ---- random numbers ------------------------------------------------------------------

def philox4x32(counters: np.ndarray, key: tuple[int, int]) -> np.ndarray:
    """Philox4x32-10 (Salmon et al. 2011, Random123's ``philox4x32_R`` with R = 10) of
    ``counters`` [n, 4] uint32 under ``key`` (k0, k1): [n, 4] uint32."""
    x = np.asarray(counters, np.uint32).astype(np.uint64)   # [n, 4], products fit 64 bits
    k0, k1 = np.uint64(key[0] & _WORD), np.uint64(key[1] & _WORD)
    m0, m1, word = np.uint64(PHILOX_M[0]), np.uint64(PHILOX_M[1]), np.uint64(_WORD)
    for r in range(PHILOX_ROUNDS):
        if r:
            k0 = (k0 + np.uint64(PHILOX_W[0])) & word
            k1 = (k1 + np.uint64(PHILOX_W[1])) & word
        p0, p1 = m0 * x[:, 0], m1 * x[:, 2]
        x = np.stack([(p1 >> np.uint64(32)) ^ x[:, 1] ^ k0, p1 & word,
                      (p0 >> np.uint64(32)) ^ x[:, 3] ^ k1, p0 & word], axis=1)
    return x.astype(np.uint32)


def uniforms(seed: int, draw: int, count: int) -> np.ndarray:
    """[count] float64 uniforms in [0, 1) of draw ``draw``: row b's from Philox4x32-10 with key
    (seed low, seed high) and counter (b // 2, draw low, draw high, 0), words 0–1 for an even
    b and 2–3 for an odd one, as 53 bits the way NumPy makes a double: (a >> 5, b >> 6)."""
    pairs = (count + 1) // 2
    counters = np.zeros((pairs, 4), np.uint32)
    counters[:, 0] = np.arange(pairs, dtype=np.uint32)
    counters[:, 1], counters[:, 2] = draw & _WORD, (draw >> 32) & _WORD
    words = philox4x32(counters, (seed & _WORD, seed >> 32)).reshape(-1, 2)[:count]  # [count, 2]
    high = (words[:, 0] >> 5).astype(np.float64)
    low = (words[:, 1] >> 6).astype(np.float64)
    return (high * 67108864.0 + low) / 9007199254740992.0   # exact: (a·2^26 + b) / 2^53


def after_insert(cursor: int, size: int, inserted: int, n: int, capacity: int
                 ) -> tuple[int, int, int]:
    """(cursor, size, inserted) once n rows went in at the cursor: a ring, so a full buffer
    overwrites its oldest rows."""
    return (cursor + n) % capacity, min(size + n, capacity), inserted + n


def beta_at(config: LearnerConfig, draw: int) -> float:
    """β of draw ``draw``: replay_beta, annealed linearly to 1 over replay_beta_steps draws."""
    beta, steps = config.replay_beta, config.replay_beta_steps
    return beta if steps == 0 else beta + (1.0 - beta) * min(1.0, draw / steps)


# ---- the tree ------------------------------------------------------------------------

def level_nodes(capacity: int, k: int) -> int:
    """Nodes of tree level k (0: the leaves, one per row): ceil(C / 32^k)."""
    return -(-capacity // FANOUT ** k)


def tree_levels(capacity: int) -> list[int]:
    """Entries of each level, leaves first: level k below the root holds its
    :func:`level_nodes` padded to 32 times the level above's, the children of that level;
    the root level holds 1."""
    sizes, k = [], 1
    while True:
        nodes = level_nodes(capacity, k)
        sizes.append(nodes * FANOUT)
        if nodes == 1:
            return sizes + [1]
        k += 1


def tree_layout(capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """What kernels/replay.cu's ``tree_offset`` and ``tree_nodes`` hold (the host writes them
    after compiling it with -DCAPACITY and -DTREE_DEPTH = D): for levels k = 1..D, at index
    k, their first entries in the concatenated sums and mins arrays and their node counts;
    index 0 holds 0 and C.  [D + 1] int64 each."""
    entries = tree_levels(capacity)[1:]                                    # levels 1..D
    offsets = np.concatenate([[0], np.cumsum([0] + entries[:-1])]).astype(np.int64)
    nodes = np.array([level_nodes(capacity, k) for k in range(len(entries) + 1)], np.int64)
    return offsets, nodes


def butterfly_sums(children: np.ndarray) -> np.ndarray:
    """Sums of consecutive groups of 32 float64 values ([n·32] → [n]) as a warp's xor
    butterfly (offsets 16, 8, 4, 2, 1) leaves them in lane 0."""
    s = np.asarray(children, np.float64).reshape(-1, FANOUT)
    width = FANOUT
    while width > 1:
        width //= 2
        s = s[:, :width] + s[:, width:]
    return s[:, 0]


def positive_mins(children: np.ndarray) -> np.ndarray:
    """Least positive value of consecutive groups of 32 float32 values ([n·32] → [n]); +inf
    for a group with none."""
    c = np.asarray(children, np.float32).reshape(-1, FANOUT)
    return np.where(c > 0, c, np.float32(np.inf)).min(axis=1)


def inclusive_scan(children: np.ndarray) -> np.ndarray:
    """Inclusive prefix sums along the last axis of [n, 32] float64 values in a warp's
    Hillis–Steele order: five rounds, each adding the value 1, 2, 4, 8, 16 lanes lower."""
    s = np.array(children, np.float64)
    shift = 1
    while shift < FANOUT:
        t = s.copy()
        t[:, shift:] = s[:, shift:] + s[:, :-shift]
        s, shift = t, 2 * shift
    return s


def leaf_values(priorities: np.ndarray, alpha: float) -> np.ndarray:
    """p^α for priorities p [n] float32: ``(float) pow((double) p, α)`` [n] float32."""
    return np.power(np.asarray(priorities, np.float32).astype(np.float64),
                    np.float64(alpha)).astype(np.float32)


def importance_weights(leaves: np.ndarray, min_leaf: float, beta: float) -> np.ndarray:
    """(min leaf / leaf)^β for drawn leaves [B] float32, in float64 then float32."""
    ratio = np.float64(np.float32(min_leaf)) / np.asarray(leaves, np.float32).astype(np.float64)
    return np.power(ratio, np.float64(beta)).astype(np.float32)


class SumTree:
    """The 32-ary sum and min tree over the leaves p^α (the module's docstring)."""

    def __init__(self, capacity: int):
        sizes = tree_levels(capacity)
        self.capacity = capacity
        self.leaves = np.zeros(sizes[0], np.float32)                 # level 0, [32·n_1]
        self.sums = [np.zeros(n, np.float64) for n in sizes[1:]]     # levels 1..D
        self.mins = [np.full(n, np.inf, np.float32) for n in sizes[1:]]

    @property
    def depth(self) -> int:
        """D, the levels above the leaves."""
        return len(self.sums)

    @property
    def total(self) -> float:
        """Σ p^α over the stored rows (the root's sum)."""
        return float(self.sums[-1][0])

    @property
    def min(self) -> np.float32:
        """The least stored p^α (the root's min; +inf when empty)."""
        return self.mins[-1][0]

    def update(self, rows: np.ndarray) -> None:
        """Recompute the ancestors of leaves ``rows``, level by level."""
        nodes = np.unique(np.asarray(rows, np.int64))
        for k in range(self.depth):
            nodes = np.unique(nodes // FANOUT)
            self._recompute(k, nodes)

    def rebuild(self) -> None:
        """Recompute every node from the leaves."""
        for k in range(self.depth):
            self._recompute(k, np.arange(level_nodes(self.capacity, k + 1)))

    def _recompute(self, k: int, nodes: np.ndarray) -> None:
        """Nodes ``nodes`` of level k + 1 from their children at level k."""
        at = (nodes[:, None] * FANOUT + np.arange(FANOUT)).reshape(-1)   # [n·32]
        if k == 0:
            sums, mins = self.leaves[at].astype(np.float64), self.leaves[at]
        else:
            sums, mins = self.sums[k - 1][at], self.mins[k - 1][at]
        self.sums[k][nodes] = butterfly_sums(sums)
        self.mins[k][nodes] = positive_mins(mins)

    def descend(self, mass: np.ndarray) -> np.ndarray:
        """The leaf each mass [B] float64 in [0, total) falls in: [B] int64."""
        mass = np.array(mass, np.float64)
        node = np.zeros(mass.shape[0], np.int64)
        rows = np.arange(mass.shape[0])
        for k in reversed(range(self.depth)):          # children at level k (0: the leaves)
            at = node[:, None] * FANOUT + np.arange(FANOUT)               # [B, 32]
            c = self.leaves[at].astype(np.float64) if k == 0 else self.sums[k - 1][at]
            prefix = inclusive_scan(c)                                    # [B, 32]
            positive = c > 0
            candidates = positive & (mass[:, None] < prefix)
            last = FANOUT - 1 - positive[:, ::-1].argmax(axis=1)
            j = np.where(candidates.any(axis=1), candidates.argmax(axis=1), last)
            mass = mass - np.where(j > 0, prefix[rows, np.maximum(j - 1, 0)], 0.0)
            node = node * FANOUT + j
        return node


# ---- state ---------------------------------------------------------------------------

@dataclass
class ReplayState:
    """Everything a resumed replay buffer needs to continue bit-identically (host copies).

    The tree is not here: it is rebuilt from ``leaves``, to the same bits."""

    h_t: np.ndarray          # [C, H] replay_dtype
    h_tp1: np.ndarray        # [C, H] replay_dtype
    actions: np.ndarray      # [C] int32
    rewards: np.ndarray      # [C] float32
    dones: np.ndarray        # [C] float32, 0/1
    discounts: np.ndarray    # [C] float32
    priorities: np.ndarray   # [C] float32, > 0 for a stored row, 0 for an empty one
    leaves: np.ndarray       # [C] float32, priority^α as the backend computed it
    cursor: int              # the row the next insert writes first
    size: int                # rows stored
    inserted: int            # rows inserted over the buffer's life
    sampled: int             # rows drawn by applied steps
    draws: int               # batches drawn (the random counter), refused steps' included
    max_priority: float      # the largest priority written so far (a float32 value)

    ARRAYS = ("h_t", "h_tp1", "actions", "rewards", "dones", "discounts", "priorities",
              "leaves")
    COUNTERS = ("cursor", "size", "inserted", "sampled", "draws")
    META_KEY = "duelq.replay"

    @staticmethod
    def empty(config: LearnerConfig) -> "ReplayState":
        C, H = config.replay_capacity, config.hidden_dim
        dtype = STORAGE_DTYPES[config.replay_dtype]
        zeros = lambda: np.zeros(C, np.float32)  # noqa: E731
        return ReplayState(
            h_t=np.zeros((C, H), dtype), h_tp1=np.zeros((C, H), dtype),
            actions=np.zeros(C, np.int32), rewards=zeros(), dones=zeros(), discounts=zeros(),
            priorities=zeros(), leaves=zeros(), cursor=0, size=0, inserted=0, sampled=0,
            draws=0, max_priority=1.0)

    def copy(self) -> "ReplayState":
        return replace(self, **{name: getattr(self, name).copy() for name in self.ARRAYS})

    def checksum(self) -> str:
        """SHA-256 over every byte and counter: equal iff bit-identical."""
        digest = hashlib.sha256()
        for name in self.ARRAYS:
            digest.update(np.ascontiguousarray(getattr(self, name)).tobytes())
        digest.update(repr([getattr(self, n) for n in self.COUNTERS]).encode())
        digest.update(np.float32(self.max_priority).tobytes())
        return digest.hexdigest()

    def to_bytes(self) -> bytes:
        """A safetensors file: the arrays (16-bit features as their uint16 bits) and the
        counters as JSON metadata."""
        tensors = {name: np.ascontiguousarray(getattr(self, name)) for name in self.ARRAYS}
        for name in ("h_t", "h_tp1"):
            if tensors[name].dtype.itemsize == 2:
                tensors[name] = tensors[name].view(np.uint16)
        meta = {n: getattr(self, n) for n in self.COUNTERS}
        meta["max_priority"] = float(np.float32(self.max_priority))
        import safetensors.numpy   # here: the learner core imports on a bare GPU image
        return safetensors.numpy.save(tensors, metadata={self.META_KEY: json.dumps(meta)})

    @classmethod
    def from_bytes(cls, data: bytes, config: LearnerConfig) -> "ReplayState":
        """Read :meth:`to_bytes`'s output for a buffer configured as ``config``, strictly:
        raises ValueError saying what does not fit."""
        import safetensors.numpy
        try:
            tensors = safetensors.numpy.load(bytes(data))
            meta = _metadata(data).get(cls.META_KEY)
        except Exception as exc:  # noqa: BLE001 — safetensors' errors and kin
            raise ValueError(f"not a readable replay buffer ({exc})") from exc
        if meta is None:
            raise ValueError("no replay buffer metadata")
        try:
            counters = json.loads(meta)
            values = {n: counters[n] for n in cls.COUNTERS}
            max_priority = float(counters["max_priority"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"malformed replay buffer metadata ({exc!r})") from exc
        dtype = STORAGE_DTYPES[config.replay_dtype]
        if set(tensors) != set(cls.ARRAYS):
            raise ValueError(f"arrays {sorted(tensors)}, expected {sorted(cls.ARRAYS)}")
        for name in ("h_t", "h_tp1"):   # 16-bit features travel as their bits
            if dtype.itemsize == 2 and tensors[name].dtype == np.uint16:
                tensors[name] = tensors[name].view(dtype)
        state = cls(**tensors, **values, max_priority=max_priority)
        problem = state.problem(config)
        if problem:
            raise ValueError(problem)
        return state

    def problem(self, config: LearnerConfig) -> str | None:
        """What makes this state impossible for a buffer configured as ``config``, or None."""
        C, H = config.replay_capacity, config.hidden_dim
        for name in self.ARRAYS:
            a, shape = getattr(self, name), (C, H) if name in ("h_t", "h_tp1") else (C,)
            dtype = (STORAGE_DTYPES[config.replay_dtype] if len(shape) == 2
                     else np.dtype(np.int32) if name == "actions" else np.dtype(np.float32))
            if not isinstance(a, np.ndarray) or a.dtype != dtype or a.shape != shape:
                got = f"{a.dtype}{list(a.shape)}" if isinstance(a, np.ndarray) else repr(a)
                return (f"{name} is {got}, expected {dtype}{list(shape)} (replay_capacity={C}, "
                        f"hidden_dim={H}, replay_dtype={config.replay_dtype})")
        for name in self.COUNTERS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                return f"{name} must be an integer ≥ 0, got {value!r}"
        if self.size > C or self.cursor >= C or (self.size < C and self.cursor != self.size):
            return (f"cursor {self.cursor} and size {self.size} are impossible in a buffer "
                    f"of {C} rows")
        if self.inserted < self.size:
            return f"inserted {self.inserted} is below size {self.size}"
        stored = np.arange(C) < self.size
        if not (np.all(self.priorities[stored] > 0) and np.all(self.leaves[stored] > 0)
                and np.all(np.isfinite(self.priorities[stored]))
                and np.all(np.isfinite(self.leaves[stored]))
                and not self.priorities[~stored].any() and not self.leaves[~stored].any()):
            return "priorities and leaves must be positive and finite for stored rows, 0 after"
        if not 0 < self.max_priority <= FLT_MAX:   # the buffer keeps it as a float32
            return (f"max_priority must be positive and finite as a float32, got "
                    f"{self.max_priority!r}")
        if self.size:
            try:
                validate_batch(self.batch(np.flatnonzero(stored)), config, C,
                               keep=(self.h_t.dtype,))
            except InvalidArgument as exc:
                return f"a stored row fails its check: {exc}"
        return None

    def batch(self, rows: np.ndarray, weights: np.ndarray | None = None) -> Batch:
        """Rows ``rows`` as a learner batch (features in the buffer's dtype)."""
        return Batch(self.h_t[rows], self.h_tp1[rows], self.actions[rows], self.rewards[rows],
                     self.dones[rows], self.discounts[rows], weights)


def _metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of safetensors bytes (an 8-byte little-endian header length,
    then the JSON header)."""
    (length,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(bytes(data[8:8 + length]))
    return header.get("__metadata__") or {}


# ---- inputs and outputs ----------------------------------------------------------------

def validate_transitions(t: Transitions, config: LearnerConfig, max_rows: int, *,
                         check_values: bool = True) -> Transitions:
    """Check every field of an insert: a batch's checks (docs/design.md §7), ``priorities``
    those of weights and > 0, features of a 16-bit buffer in its own dtype; at most
    ``max_rows`` rows.  ``check_values=False`` checks dtypes and shapes only (for a buffer
    that checks the values on the device: :attr:`ReplayBuffer.checks_values`).  Returns the
    rows as the buffer stores them, but that 16-bit features bound for a float32 buffer
    stay 16-bit (the buffer widens them as it stores them, exactly).  Raises InvalidArgument
    naming the first bad field, or ResourceExhausted past ``max_rows``."""
    if not isinstance(t, Transitions):
        raise InvalidArgument("transitions", f"must be Transitions, got {type(t).__name__}")
    storage = STORAGE_DTYPES[config.replay_dtype]
    if storage.itemsize == 2:
        for name in ("h_t", "h_tp1"):
            dtype = getattr(getattr(t, name), "dtype", None)
            if dtype is not None and dtype != storage:
                raise InvalidArgument(name, f"dtype must be {config.replay_dtype}, as the "
                                            f"replay buffer stores it (replay_dtype), got {dtype}")
    try:
        batch = validate_batch(Batch(t.h_t, t.h_tp1, t.actions, t.rewards, t.dones,
                                     t.discounts, t.priorities), config, max_rows,
                               check_values=check_values, keep=FEATURE_DTYPES)
    except InvalidArgument as exc:
        if exc.field != "weights":
            raise
        raise InvalidArgument("priorities", exc.problem.replace("≥ 0", "> 0")) from None
    priorities = batch.weights
    if check_values and priorities is not None and not np.all(priorities > 0):
        bad = int(np.flatnonzero(~(priorities > 0))[0])
        raise InvalidArgument("priorities", f"must be > 0; element {bad} is {priorities[bad]}")
    return Transitions(batch.h_t, batch.h_tp1, batch.actions, batch.rewards, batch.dones,
                       batch.discounts, priorities)


@dataclass(frozen=True)
class Draw:
    """The rows of one draw and their importance weights."""

    rows: np.ndarray      # [B] int64, row indices into the buffer
    weights: np.ndarray   # [B] float32, (min leaf / leaf)^β


@dataclass
class ReplayRun:
    """What :meth:`ReplayBuffer.train` did.

    Read-only by convention; not frozen, being built per request (docs/benchmarks.md)."""

    steps: int                 # steps applied
    refused: bool              # the next step was refused (non-finite, or an input that
                               # fails its check): its draw consumed, the run stopped there
    losses: np.ndarray         # [steps] float64, each applied step's mean loss
    q_taken_means: np.ndarray  # [steps] float64
    grad_norms: np.ndarray     # [steps] float64, before clipping


class RunningReplay:
    """A run that :meth:`ReplayBuffer.start` began: :meth:`wait` for the device (no lock
    needed), then :meth:`finish` (under the learner's lock) for its counters and report."""

    def __init__(self, finish: Callable[[], ReplayRun],
                 wait: Callable[[], None] = lambda: None):
        self.wait = wait
        self._finish: Callable[[], ReplayRun] | None = finish
        self._run: ReplayRun | None = None
        self._error: BaseException | None = None

    def finish(self) -> ReplayRun:
        """Wait for the run, apply its counters (once), and return what it did; if that
        failed, raise its error, at this call and every later one."""
        if self._finish is not None:
            finish, self._finish = self._finish, None
            try:
                self._run = finish()
            except BaseException as exc:
                self._error = exc
        if self._error is not None:
            raise self._error
        return self._run


def replay_bytes(config: LearnerConfig) -> int:
    """Memory a buffer of ``config`` takes: rows, priorities, leaves and the tree's levels."""
    C, H = config.replay_capacity, config.hidden_dim
    row = 2 * H * STORAGE_DTYPES[config.replay_dtype].itemsize + 4 * 6  # vectors, p, leaf
    return C * row + 12 * sum(tree_levels(C)[1:])


# ---- the buffer ------------------------------------------------------------------------

class ReplayBuffer(abc.ABC):
    """A replay buffer beside a learner's backend: inserts, trains from itself, reports.

    Not thread-safe but for :meth:`upload` and :meth:`checked`: the learner calls the rest
    under its lock (and, while a run it started is unfinished, only :meth:`insert`)."""

    checks_values = False
    """True: :meth:`upload` also checks the rows' values on the device (:meth:`checked`), so
    the host checks only their dtypes and shapes first."""

    def __init__(self, config: LearnerConfig, backend: Backend):
        self.config, self.backend = config, backend

    @property
    @abc.abstractmethod
    def counters(self) -> dict[str, int]:
        """cursor, size, inserted, sampled, draws."""

    def upload(self, t: Transitions | PackedBatch) -> Upload | None:
        """Start copying rows whose dtypes and shapes passed (or the words a front process
        packed them in) to the device before their insert, and checking their values there
        (thread-safe, as :meth:`Backend.upload`).  None: nothing to do, or no staging space
        free now."""
        return None

    def checked(self, upload: Upload) -> bool:
        """(With :attr:`checks_values`.)  Whether every value of the rows that ``upload``
        carries passed the device's check, waiting for it (on False the learner checks them
        on the host, to name the field)."""
        raise NotImplementedError

    @abc.abstractmethod
    def insert(self, t: Transitions, upload: Upload | None = None) -> None:
        """Store validated rows at the cursor (:func:`validate_transitions`), sent ahead by
        ``upload`` when given."""

    @abc.abstractmethod
    def train(self, steps: int) -> ReplayRun:
        """Up to ``steps`` learner steps drawn from the buffer, each written back before the
        next draw; stops at the first refused one.  The caller checks the size first."""

    def start(self, steps: int) -> RunningReplay:
        """:meth:`train`, begun: until the run is finished, only :meth:`insert` may be
        called, and its rows go in after the run's steps.  This one trains at once."""
        run = self.train(steps)
        return RunningReplay(lambda: run)

    @abc.abstractmethod
    def snapshot(self) -> ReplayState:
        """A host copy of the whole buffer."""

    @abc.abstractmethod
    def load(self, state: ReplayState) -> None:
        """Replace the whole buffer (a checkpoint's, already checked against the config)."""

    @property
    def size(self) -> int:
        return self.counters["size"]

    def ready(self) -> None:
        """Raise ReplayNotReady while the buffer holds fewer than replay_min_size rows."""
        if self.size < self.config.replay_min_size:
            raise ReplayNotReady(f"the replay buffer holds {self.size} rows; it trains from "
                                 f"replay_min_size={self.config.replay_min_size}")

    def due_steps(self) -> int:
        """Steps that replay_ratio asks for now: while sampled + B ≤ ratio × inserted
        (0 when the ratio is off or the buffer is below replay_min_size)."""
        c, ratio, B = self.counters, self.config.replay_ratio, self.config.replay_batch_size
        if ratio <= 0 or c["size"] < self.config.replay_min_size:
            return 0
        return max(0, int((ratio * c["inserted"] - c["sampled"]) // B))

    def info(self) -> ReplayInfo:
        c, config = self.counters, self.config
        return ReplayInfo(
            capacity=config.replay_capacity, size=c["size"], inserted=c["inserted"],
            sampled=c["sampled"], draws=c["draws"], cursor=c["cursor"],
            ratio=c["sampled"] / c["inserted"] if c["inserted"] else 0.0,
            target_ratio=config.replay_ratio, beta=beta_at(config, c["draws"]),
            batch_size=config.replay_batch_size, min_size=config.replay_min_size,
            dtype=config.replay_dtype)


class ReferenceReplay(ReplayBuffer):
    """The buffer in host memory, stepped through any backend's propose/commit/discard."""

    def __init__(self, config: LearnerConfig, backend: Backend):
        super().__init__(config, backend)
        self.state = ReplayState.empty(config)
        self.tree = SumTree(config.replay_capacity)

    @property
    def counters(self) -> dict[str, int]:
        return {name: getattr(self.state, name) for name in ReplayState.COUNTERS}

    def insert(self, t: Transitions, upload: Upload | None = None) -> None:
        s, C, n = self.state, self.config.replay_capacity, t.size
        rows = (s.cursor + np.arange(n)) % C                             # [n]
        if t.priorities is None:
            priorities = np.full(n, s.max_priority, np.float32)
        else:
            priorities = t.priorities.astype(np.float32)
            s.max_priority = float(max(np.float32(s.max_priority), priorities.max()))
        for name in ("h_t", "h_tp1", "actions", "rewards", "dones", "discounts"):
            getattr(s, name)[rows] = getattr(t, name)
        s.priorities[rows] = priorities
        s.leaves[rows] = self.tree.leaves[rows] = leaf_values(priorities, self.config.replay_alpha)
        s.cursor, s.size, s.inserted = after_insert(s.cursor, s.size, s.inserted, n, C)
        self.tree.update(rows)

    def draw(self) -> Draw:
        """The rows and weights of the next draw (the buffer is not changed)."""
        B, d = self.config.replay_batch_size, self.state.draws
        mass = uniforms(self.config.replay_seed, d, B) * self.tree.total   # [B]
        rows = self.tree.descend(mass)                                     # [B]
        beta = beta_at(self.config, d)
        return Draw(rows, importance_weights(self.tree.leaves[rows], self.tree.min, beta))

    def write_back(self, rows: np.ndarray, priorities: np.ndarray) -> None:
        """Priorities [B] of drawn ``rows`` [B]; a row drawn twice takes its last one."""
        s = self.state
        p = np.fmin(np.asarray(priorities, np.float32), np.float32(FLT_MAX))   # [B]
        _, first_from_end = np.unique(rows[::-1], return_index=True)
        last = rows.shape[0] - 1 - first_from_end                     # last occurrences
        s.priorities[rows[last]] = p[last]
        s.leaves[rows[last]] = self.tree.leaves[rows[last]] = leaf_values(
            p[last], self.config.replay_alpha)
        s.max_priority = float(max(np.float32(s.max_priority), p.max()))
        self.tree.update(rows)

    def train(self, steps: int) -> ReplayRun:
        stats, refused = [], False
        for _ in range(steps):
            draw = self.draw()
            out = self.backend.propose(self.state.batch(draw.rows, draw.weights))
            self.state.draws += 1
            if not (out.finite and out.inputs_valid):
                self.backend.discard()
                refused = True
                break
            self.backend.commit()
            self.write_back(draw.rows, out.priorities)
            self.state.sampled += draw.rows.shape[0]
            stats.append((out.loss, out.q_taken_mean, out.grad_norm))
        columns = np.array(stats, np.float64).reshape(-1, 3)
        return ReplayRun(len(stats), refused, *columns.T.copy())

    def snapshot(self) -> ReplayState:
        return self.state.copy()

    def load(self, state: ReplayState) -> None:
        self.state = state.copy()
        self.tree = SumTree(self.config.replay_capacity)
        self.tree.leaves[:self.config.replay_capacity] = self.state.leaves
        self.tree.rebuild()

