"""The small interface every backend implements; the learner holds the logic.

A backend owns the learner state (host or device memory) and does the
arithmetic of docs/design.md §1–§2.  A step is two-phase: :meth:`Backend.propose`
computes the candidate state and the outputs without touching the current
state; the learner then calls :meth:`Backend.commit` or :meth:`Backend.discard`.
Before its turn, a batch may already be sent on its way to the device with
:meth:`Backend.upload` (outside the learner's lock, so copies overlap other steps).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import numpy as np

from duelq.server.core.batch import Batch, PackedBatch
from duelq.server.core.config import LearnerConfig
from duelq.server.core.state import LearnerState, Params


@dataclass
class StepOutputs:
    """What one proposed step reports (host values).

    Read-only by convention; not frozen, being built per request (docs/benchmarks.md)."""

    loss: float               # (1/B) Σ w·huber(δ)
    td_errors: np.ndarray     # [B] float32, δ = Q_θ(h_t)[a] − y, before the update
    priorities: np.ndarray    # [B] float32, |δ| + ε
    q_taken_mean: float       # mean over the batch of Q_θ(h_t)[a]
    grad_norm: float          # global L2 norm of the gradient before clipping
    finite: bool              # TD errors, gradients and every new tensor are finite
    entropy: float | None     # the batch's action entropy when step_entropy_slot is set
    inputs_valid: bool = True  # every input value passes docs/design.md §7 (see checks_values)


class Upload(abc.ABC):
    """A batch on its way to the device (:meth:`Backend.upload`); close it if unused."""

    @abc.abstractmethod
    def close(self) -> None:
        """Give the staging space back (idempotent; propose closes what it uses)."""


class Backend(abc.ABC):
    """Owns the state; implements the arithmetic."""

    name: str    # "reference" | "cuda"
    device: str  # human-readable device name
    checks_values = False
    """True: propose checks every input value as it reads it (StepOutputs.inputs_valid), so
    validation on the host checks only dtypes and shapes (``validate_batch(check_values=False)``);
    such a backend also takes a :class:`PackedBatch` as it is."""
    feature_dtypes: tuple[np.dtype, ...] = ()
    """16-bit feature dtypes propose takes as they are (widening them itself); others are
    widened to float32 on the host first."""

    def __init__(self, config: LearnerConfig, state: LearnerState):
        self.config = config

    @property
    @abc.abstractmethod
    def step(self) -> int:
        """Steps applied so far (== weights version)."""

    @abc.abstractmethod
    def snapshot(self) -> LearnerState:
        """A host copy of the whole current state."""

    @abc.abstractmethod
    def load(self, state: LearnerState) -> None:
        """Replace the whole state (checkpoint resume)."""

    @abc.abstractmethod
    def weights(self, target: bool = False) -> Params:
        """Host float32 copy of θ (or θ⁻)."""

    @abc.abstractmethod
    def q_values(self, h: np.ndarray, target: bool = False) -> np.ndarray:
        """[B, H] float32 → [B, N] float32 Q-values under θ (or θ⁻)."""

    def upload(self, batch: Batch | PackedBatch) -> Upload | None:
        """Start copying a validated batch to the device before its step (thread-safe; may
        run while another step does). None: nothing to do, or no staging space free now."""
        return None

    def pin(self, region: np.ndarray) -> None:
        """A hint: packed batches will lie in host memory ``region``; a device backend may
        page-lock it and copy from it directly.  Default: nothing."""

    @abc.abstractmethod
    def propose(self, batch: Batch | PackedBatch, upload: Upload | None = None
                ) -> StepOutputs:
        """Compute step ``self.step + 1`` on a validated batch (sent ahead by ``upload``
        when given); keep it pending."""

    @abc.abstractmethod
    def commit(self) -> None:
        """Make the pending step the current state."""

    @abc.abstractmethod
    def discard(self) -> None:
        """Drop the pending step; the current state stays bit-identical."""

    @abc.abstractmethod
    def entropy(self, actions: np.ndarray, slot: int, alpha: float) -> tuple[float, float]:
        """Fold the entropy of validated ``actions`` [M] int32 into ISV ``slot``.

        Returns (entropy in nats, new EMA value).
        """

    @abc.abstractmethod
    def read_isv(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Values [K] float32 and observed flags [K] bool of validated slot indices."""
