"""A training batch and the checks every batch passes before any backend sees it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from duelq.server.core.config import LearnerConfig
from duelq.wire.types import BFLOAT16, FIELD_DTYPES, Batch, wrong_dtype
from duelq.server.core.errors import InvalidArgument, ResourceExhausted



def packed_layout(rows: int, hidden_dim: int, itemsize: int,
                  has_weights: bool) -> tuple[tuple[int, ...], int]:
    """The step kernel's packed input layout: the byte offsets of h_t, h_tp1 (each [B, H] in
    the features' own dtype, of ``itemsize`` bytes), actions (int32), rewards, dones,
    discounts and, when present, weights (float32), each [B], in that order with no gaps,
    and the layout's length in 32-bit words (2·B·H·itemsize is a multiple of 4)."""
    features = rows * hidden_dim * itemsize
    vectors = 5 if has_weights else 4
    offsets = (0, features) + tuple(2 * features + 4 * rows * i for i in range(vectors))
    return offsets, 2 * features // 4 + vectors * rows


@dataclass
class PackedBatch:
    """A batch already in the packed input layout (:func:`packed_layout`) in host memory,
    as a front process writes it into a relay buffer (server/fronts/packing.py): a device backend
    that checks values itself (``Backend.checks_values``) copies its words as they are.

    Its dtypes and shapes passed the front's checks, all but those against this learner's
    config (``hidden_dim``, the batch size limit); :meth:`Learner.prepare_packed` makes
    those.  :meth:`batch` gives the same arrays as a :class:`Batch` of views.

    Read-only by convention; not frozen, being built per request (docs/benchmarks.md)."""

    size: int               # B
    hidden_dim: int         # H
    dtype: np.dtype         # the features' (FEATURE_DTYPES)
    has_weights: bool
    words: int              # 32-bit words of the layout
    data: memoryview        # its bytes (at least 4 · words)
    address: int            # host address of data's first byte

    def batch(self) -> Batch:
        """The arrays, as views of :attr:`data`."""
        B, H = self.size, self.hidden_dim
        offsets, _ = packed_layout(B, H, self.dtype.itemsize, self.has_weights)
        h_t, h_tp1 = (np.frombuffer(self.data, self.dtype, B * H, at).reshape(B, H)
                      for at in offsets[:2])
        actions = np.frombuffer(self.data, np.int32, B, offsets[2])
        vectors = [np.frombuffer(self.data, np.float32, B, at) for at in offsets[3:]]
        return Batch(h_t, h_tp1, actions, *vectors)


_DTYPE_NAMES: dict[np.dtype, str] = {}   # dtype.name is a Python property in NumPy: cached


def _array(name: str, value, dtypes: tuple[str, ...]) -> np.ndarray:
    """``value`` when it is a numpy array of one of ``dtypes`` (names, FIELD_DTYPES')."""
    if not isinstance(value, np.ndarray):
        raise InvalidArgument(name, f"must be a numpy array, got {type(value).__name__}")
    dtype = value.dtype
    got = _DTYPE_NAMES.get(dtype)
    if got is None:
        got = _DTYPE_NAMES.setdefault(dtype, dtype.name)
    if got not in dtypes:
        raise InvalidArgument(name, wrong_dtype(dtypes, got))
    return value


#: A 16-bit float's exponent bits: all set in an Inf or a NaN, and only there.  Testing
#: them is exact and faster than np.isfinite, which widens each element first.
_EXPONENT_BITS = {np.dtype(np.float16): 0x7C00, BFLOAT16: 0x7F80}


def _finite(name: str, a: np.ndarray) -> None:
    bits = _EXPONENT_BITS.get(a.dtype)
    if bits is not None:
        finite = (a.view(np.uint16) & bits).max(initial=0) != bits
    else:
        finite = np.isfinite(a).all()
    if not finite:
        bad = int(np.flatnonzero(~np.isfinite(a.reshape(-1)))[0])
        raise InvalidArgument(name, f"contains NaN or Inf (first at flat index {bad})")


def validate_actions(actions, n_actions: int, name: str = "actions",
                     max_len: int | None = None, *, check_range: bool = True) -> np.ndarray:
    """Check a 1-D actions buffer (int32 or uint8); return it as int32.  ``check_range=False``
    leaves the range to the caller."""
    a = _array(name, actions, FIELD_DTYPES["actions"])
    if a.ndim != 1:
        raise InvalidArgument(name, f"must be 1-D, got shape {a.shape}")
    if a.shape[0] == 0:
        raise InvalidArgument(name, "is empty")
    if max_len is not None and a.shape[0] > max_len:
        raise ResourceExhausted(f"{name}: length {a.shape[0]} exceeds the limit {max_len}")
    if not check_range:
        return a.astype(np.int32, copy=False)
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
    a = _array(name, h, FIELD_DTYPES["h"])
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


def validate_batch(batch: Batch, config: LearnerConfig, max_batch_size: int, *,
                   check_values: bool = True, keep: tuple = ()) -> Batch:
    """Check every field of ``batch`` (docs/design.md §7); return a float32/int32 copy-free view.

    Raises InvalidArgument naming the first bad field, or ResourceExhausted when
    B exceeds ``max_batch_size``.  ``check_values=False`` checks dtypes and shapes only
    and leaves the values (features and rewards finite, actions in range, dones 0/1,
    discounts in [0, 1], weights finite and ≥ 0) to a backend that checks them on the
    device as it reads them (:attr:`Backend.checks_values`); the learner calls this again
    with the checks on to name the culprit when the backend finds one.  Features whose
    dtype is in ``keep`` stay in it when both have the same one (a backend that widens them
    itself); otherwise they are widened to float32.
    """
    if not isinstance(batch, Batch):
        raise InvalidArgument("batch", f"must be a Batch, got {type(batch).__name__}")
    actions = validate_actions(batch.actions, config.n_actions, max_len=max_batch_size,
                               check_range=check_values)
    B = actions.shape[0]
    if getattr(batch.h_t, "dtype", None) != getattr(batch.h_tp1, "dtype", None):
        keep = ()  # one dtype per batch on the device: mixed ones are widened
    h_t = validate_features(batch.h_t, config.hidden_dim, "h_t", rows=B,
                            finite=check_values, keep=keep)
    h_tp1 = validate_features(batch.h_tp1, config.hidden_dim, "h_tp1", rows=B,
                              finite=check_values, keep=keep)

    def vector(name: str, value) -> np.ndarray:
        a = _array(name, value, FIELD_DTYPES[name])
        if a.shape != (B,):
            raise InvalidArgument(name, f"shape must be [{B}], got {list(a.shape)}")
        a = a.astype(np.float32, copy=False)
        if check_values:
            _finite(name, a)
        return a

    def first(name: str, a: np.ndarray, bad: np.ndarray, rule: str) -> None:
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise InvalidArgument(name, f"{rule}; element {i} is {a[i]}")

    rewards = vector("rewards", batch.rewards)
    dones = vector("dones", batch.dones)
    if check_values:
        first("dones", dones, (dones != 0) & (dones != 1), "must be 0 or 1")
    discounts = vector("discounts", batch.discounts)
    if check_values:  # finite (checked above): no NaN to miss
        first("discounts", discounts, (discounts < 0) | (discounts > 1), "must be in [0, 1]")
    weights = None if batch.weights is None else vector("weights", batch.weights)
    if check_values and weights is not None:
        first("weights", weights, weights < 0, "must be ≥ 0")
    return Batch(h_t, h_tp1, actions, rewards, dones, discounts, weights)
