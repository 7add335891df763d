"""A training batch and the checks every batch passes before any backend sees it."""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from .config import LearnerConfig
from .errors import InvalidArgument, ResourceExhausted

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
FEATURE_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), BFLOAT16)


@dataclass(frozen=True)
class Batch:
    """One learner step's inputs, numpy arrays (see DESIGN §2).

    ``weights`` may be None (all ones).  Features may be float16 or bfloat16
    (``ml_dtypes``); :func:`validate_batch` widens them to float32 unless the
    backend takes them as they are.
    """

    h_t: np.ndarray        # [B, H] features of s_t
    h_tp1: np.ndarray      # [B, H] features of s_{t+n}
    actions: np.ndarray    # [B] int32 in [0, N)
    rewards: np.ndarray    # [B] float32, n-step discounted return
    dones: np.ndarray      # [B] float32 0/1
    discounts: np.ndarray  # [B] float32 γⁿ in [0, 1]
    weights: np.ndarray | None = None  # [B] float32 ≥ 0, importance-sampling weights

    @property
    def size(self) -> int:
        return int(np.shape(self.actions)[0]) if np.ndim(self.actions) else 0


def _array(name: str, value) -> np.ndarray:
    if not isinstance(value, np.ndarray):
        raise InvalidArgument(name, f"must be a numpy array, got {type(value).__name__}")
    return value


def _finite(name: str, a: np.ndarray) -> None:
    if not np.isfinite(a).all():
        bad = int(np.flatnonzero(~np.isfinite(a.reshape(-1)))[0])
        raise InvalidArgument(name, f"contains NaN or Inf (first at flat index {bad})")


def validate_actions(actions, n_actions: int, name: str = "actions",
                     max_len: int | None = None) -> np.ndarray:
    """Check a 1-D integer actions buffer; return it as int32."""
    a = _array(name, actions)
    if a.ndim != 1:
        raise InvalidArgument(name, f"must be 1-D, got shape {a.shape}")
    if a.shape[0] == 0:
        raise InvalidArgument(name, "is empty")
    if max_len is not None and a.shape[0] > max_len:
        raise ResourceExhausted(f"{name}: length {a.shape[0]} exceeds the limit {max_len}")
    if a.dtype.kind not in "iu":
        raise InvalidArgument(name, f"must have an integer dtype, got {a.dtype}")
    lo, hi = int(a.min()), int(a.max())
    if lo < 0 or hi >= n_actions:
        bad = int(np.flatnonzero((a < 0) | (a >= n_actions))[0])
        raise InvalidArgument(name, f"must be in [0, {n_actions}); element {bad} is {int(a[bad])}")
    return a.astype(np.int32, copy=False)


def validate_features(h, hidden_dim: int, name: str, rows: int | None = None, *,
                      finite: bool = True, keep: tuple = ()) -> np.ndarray:
    """Check a [B, H] feature matrix (values finite unless ``finite`` is False: the caller
    checks them elsewhere); return it C-contiguous, in its dtype if that is in ``keep``,
    else widened to float32."""
    a = _array(name, h)
    if a.dtype not in FEATURE_DTYPES:
        raise InvalidArgument(name, f"dtype must be float32, float16 or bfloat16, "
                                    f"got {a.dtype}")
    if a.ndim != 2 or a.shape[1] != hidden_dim:
        raise InvalidArgument(name, f"shape must be [B, {hidden_dim}], got {list(a.shape)}")
    if rows is not None and a.shape[0] != rows:
        raise InvalidArgument(name, f"has {a.shape[0]} rows, expected B={rows}")
    if a.shape[0] == 0:
        raise InvalidArgument(name, "has no rows (B = 0)")
    a = np.ascontiguousarray(a, dtype=None if a.dtype in keep else np.float32)  # exact
    if finite:
        _finite(name, a)
    return a


def check_features_finite(batch: Batch) -> None:
    """Raise InvalidArgument naming the first non-finite feature value of ``batch``."""
    _finite("h_t", batch.h_t)
    _finite("h_tp1", batch.h_tp1)


def validate_batch(batch: Batch, config: LearnerConfig, max_batch_size: int, *,
                   finite_features: bool = True, keep: tuple = ()) -> Batch:
    """Check every field of ``batch`` (DESIGN §6); return a float32/int32 copy-free view.

    Raises InvalidArgument naming the first bad field, or ResourceExhausted when
    B exceeds ``max_batch_size``.  ``finite_features=False`` leaves the finiteness of
    h_t and h_tp1 to the caller (a backend that checks it on the device).  Features
    whose dtype is in ``keep`` stay in it when both have the same one (a backend that
    widens them itself); otherwise they are widened to float32.
    """
    if not isinstance(batch, Batch):
        raise InvalidArgument("batch", f"must be a Batch, got {type(batch).__name__}")
    actions = validate_actions(batch.actions, config.n_actions, max_len=max_batch_size)
    B = actions.shape[0]
    if getattr(batch.h_t, "dtype", None) != getattr(batch.h_tp1, "dtype", None):
        keep = ()  # one dtype per batch on the device: mixed ones are widened
    h_t = validate_features(batch.h_t, config.hidden_dim, "h_t", rows=B,
                            finite=finite_features, keep=keep)
    h_tp1 = validate_features(batch.h_tp1, config.hidden_dim, "h_tp1", rows=B,
                              finite=finite_features, keep=keep)

    def vector(name: str, value) -> np.ndarray:
        a = _array(name, value)
        if a.dtype not in FEATURE_DTYPES and a.dtype.kind not in "iub":
            raise InvalidArgument(name, f"must be float32/float16 (or integer/bool for 0/1), "
                                  f"got {a.dtype}")
        if a.shape != (B,):
            raise InvalidArgument(name, f"shape must be [{B}], got {list(a.shape)}")
        a = a.astype(np.float32, copy=False)
        _finite(name, a)
        return a

    rewards = vector("rewards", batch.rewards)
    dones = vector("dones", batch.dones)
    binary = (dones == 0) | (dones == 1)  # what np.isin(dones, (0, 1)) says, 3× faster
    if not binary.all():
        bad = int(np.flatnonzero(~binary)[0])
        raise InvalidArgument("dones", f"must be 0 or 1; element {bad} is {dones[bad]}")
    discounts = vector("discounts", batch.discounts)
    if discounts.min() < 0 or discounts.max() > 1:  # finite (checked above): no NaN to miss
        bad = int(np.flatnonzero((discounts < 0) | (discounts > 1))[0])
        raise InvalidArgument("discounts", f"must be in [0, 1]; element {bad} is {discounts[bad]}")
    weights = None
    if batch.weights is not None:
        weights = vector("weights", batch.weights)
        if weights.min() < 0:
            bad = int(np.flatnonzero(weights < 0)[0])
            raise InvalidArgument("weights", f"must be ≥ 0; element {bad} is {weights[bad]}")
    return Batch(h_t, h_tp1, actions, rewards, dones, discounts, weights)
