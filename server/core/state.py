"""The whole learner state as one record: θ, θ⁻, optimizer moments, step, ISV."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields, replace

import numpy as np

from duelq.server.core.config import LearnerConfig
from duelq.wire.types import Params


def initial_params(config: LearnerConfig) -> Params:
    """PyTorch nn.Linear's default init, U(−1/√H, 1/√H), reproducible from ``config.seed``."""
    rng = np.random.Generator(np.random.PCG64(config.seed))
    bound = 1.0 / np.sqrt(config.hidden_dim)
    H, N = config.hidden_dim, config.n_actions

    def u(*shape):
        return rng.uniform(-bound, bound, size=shape).astype(np.float32)

    return Params(w_v=u(H), b_v=u(1), w_a=u(H, N), b_a=u(N))


@dataclass(frozen=True)
class LearnerState:
    """Everything a resumed learner needs to continue bit-identically.

    The weights version equals ``step``: θ changes exactly once per applied step.
    """

    params: Params          # θ
    target: Params          # θ⁻
    adam_m: Params          # Adam first moments (zeros under SGD)
    adam_v: Params          # Adam second moments (zeros under SGD)
    step: int               # steps applied so far
    isv: np.ndarray         # [S] float32 slot values
    isv_observed: np.ndarray  # [S] bool, whether a slot's EMA has been bootstrapped

    @staticmethod
    def initial(config: LearnerConfig) -> "LearnerState":
        params = initial_params(config)
        zeros = Params.zeros(config.hidden_dim, config.n_actions)
        return LearnerState(
            params=params,
            target=params.copy(),  # θ⁻ = θ at start
            adam_m=zeros,
            adam_v=zeros.copy(),
            step=0,
            isv=np.zeros(config.isv_size, np.float32),
            isv_observed=np.zeros(config.isv_size, bool),
        )

    def copy(self) -> "LearnerState":
        """A deep copy (no array shared with ``self``)."""
        return replace(
            self,
            **{f.name: getattr(self, f.name).copy()
               for f in fields(self) if isinstance(getattr(self, f.name), Params)},
            isv=self.isv.copy(), isv_observed=self.isv_observed.copy())

    def checksum(self) -> str:
        """SHA-256 over every byte of the state: equal iff bit-identical."""
        digest = hashlib.sha256()
        for group in (self.params, self.target, self.adam_m, self.adam_v):
            for a in group.arrays():
                digest.update(np.ascontiguousarray(a).tobytes())
        digest.update(self.isv.tobytes())
        digest.update(self.isv_observed.tobytes())
        digest.update(str(self.step).encode())
        return digest.hexdigest()
