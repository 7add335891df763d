"""Learner configuration: one dataclass, one field per knob of docs/design.md §1–§2."""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from duelq.server.core.errors import InvalidArgument, check_setting

#: The default named ISV slots; names and indices are configuration.
DEFAULT_ISV_SLOTS: dict[str, int] = {
    "policy_entropy_ema": 420,
    "action_entropy_ema": 583,
}


@dataclass(frozen=True)
class LearnerConfig:
    """Everything that defines a learner; validated on construction.

    A field that fails its check raises :class:`InvalidArgument` naming it.
    """

    hidden_dim: int = 128
    """H, feature width of ``h_t``/``h_tp1`` (count, 1 to 4096)."""
    n_actions: int = 11
    """N, number of discrete actions (count, 2 to 1024)."""
    optimizer: str = "adam"
    """``"adam"`` (PyTorch's formula, bias-corrected) or ``"sgd"`` (plain)."""
    lr: float = 1e-4
    """Learning rate (step size per unit gradient, > 0)."""
    beta1: float = 0.9
    """Adam first-moment decay (dimensionless, in [0, 1))."""
    beta2: float = 0.999
    """Adam second-moment decay (dimensionless, in [0, 1))."""
    adam_eps: float = 1e-8
    """Adam denominator epsilon (> 0)."""
    huber_kappa: float = 1.0
    """κ, the Huber loss's quadratic-to-linear threshold (TD-error units, > 0)."""
    double_dqn: bool = False
    """Pick the target action with the online net (double DQN) instead of θ⁻."""
    max_grad_norm: float = 0.0
    """Clip the global gradient L2 norm to this (gradient units); 0 turns clipping off."""
    tau: float = 0.005
    """Target soft-update rate τ (dimensionless, in (0, 1]; 1 is a hard copy)."""
    target_update_period: int = 1
    """Update θ⁻ every this many steps (steps, ≥ 1)."""
    priority_eps: float = 1e-6
    """ε in the returned PER priorities |δ| + ε (TD-error units, ≥ 0; > 0 with the replay
    buffer on, or a row of zero priority would never be drawn again)."""
    isv_size: int = 1024
    """Number of float32 slots in the ISV bus (count, ≥ 1)."""
    isv_slots: Mapping[str, int] = field(default_factory=lambda: dict(DEFAULT_ISV_SLOTS))
    """Slot names → indices into the ISV (each in [0, isv_size), distinct)."""
    step_entropy_slot: str = ""
    """If set, every train step also folds its batch's action entropy into this slot."""
    step_entropy_alpha: float = 0.05
    """EMA rate α for ``step_entropy_slot`` (dimensionless, in (0, 1])."""
    seed: int = 0
    """Seed of the initial weights (PyTorch nn.Linear's U(±1/√H) init, NumPy PCG64)."""
    replay_capacity: int = 0
    """C, transitions the server-side replay buffer holds (count, ≤ 2^30); 0 turns it off.
    A full buffer overwrites its oldest row."""
    replay_dtype: str = "float32"
    """Dtype the replay buffer stores h_t and h_tp1 in: float32, float16 or bfloat16 (a
    16-bit buffer takes inserts of its own dtype only: nothing is rounded; a float32 one
    widens 16-bit inserts exactly)."""
    replay_alpha: float = 0.6
    """α: rows are drawn with probability priority^α / Σ priority^α (in [0, 1]; 0 = uniform)."""
    replay_beta: float = 0.4
    """β of the first draw: importance weights (min priority^α / priority^α)^β (in [0, 1])."""
    replay_beta_steps: int = 0
    """Draws over which β anneals linearly to 1 (draws, ≥ 0); 0 keeps β constant."""
    replay_batch_size: int = 256
    """B of a learner step drawn from the replay (rows, in [1, 65536])."""
    replay_min_size: int = 256
    """Rows the replay buffer must hold before it trains (rows, in [1, replay_capacity])."""
    replay_ratio: float = 0.0
    """Target replay ratio, rows sampled per row inserted (≥ 0): the server trains from
    the buffer by itself while sampled + B ≤ ratio × inserted; 0 trains on request only."""
    replay_seed: int = 0
    """Key of the replay's counter-based random stream (Philox4x32-10; in [0, 2^64))."""

    def __post_init__(self) -> None:
        need = functools.partial(check_setting, self)

        def finite(name: str) -> float:
            value = getattr(self, name)
            need(isinstance(value, (int, float)) and not isinstance(value, bool)
                 and math.isfinite(value), name, "must be a finite number")
            return float(value)

        def integer(name: str) -> int:
            value = getattr(self, name)
            need(isinstance(value, int) and not isinstance(value, bool), name, "must be an integer")
            return value

        need(integer("hidden_dim") >= 1, "hidden_dim", "must be ≥ 1")
        need(integer("hidden_dim") <= 4096, "hidden_dim", "must be ≤ 4096")
        need(integer("n_actions") >= 2, "n_actions", "must be ≥ 2")
        need(integer("n_actions") <= 1024, "n_actions", "must be ≤ 1024")
        need(self.optimizer in ("adam", "sgd"), "optimizer", "must be 'adam' or 'sgd'")
        need(finite("lr") > 0, "lr", "must be > 0")
        need(0 <= finite("beta1") < 1, "beta1", "must be in [0, 1)")
        need(0 <= finite("beta2") < 1, "beta2", "must be in [0, 1)")
        need(finite("adam_eps") > 0, "adam_eps", "must be > 0")
        need(finite("huber_kappa") > 0, "huber_kappa", "must be > 0")
        need(isinstance(self.double_dqn, bool), "double_dqn", "must be a bool")
        need(finite("max_grad_norm") >= 0, "max_grad_norm", "must be ≥ 0 (0 = off)")
        need(0 < finite("tau") <= 1, "tau", "must be in (0, 1]")
        need(integer("target_update_period") >= 1, "target_update_period", "must be ≥ 1")
        need(finite("priority_eps") >= 0, "priority_eps", "must be ≥ 0")
        need(integer("isv_size") >= 1, "isv_size", "must be ≥ 1")
        need(integer("seed") >= 0, "seed", "must be ≥ 0")
        need(0 < finite("step_entropy_alpha") <= 1, "step_entropy_alpha", "must be in (0, 1]")
        need(0 <= integer("replay_capacity") <= 1 << 30, "replay_capacity",
             "must be in [0, 2^30] (0 = off)")
        need(self.replay_dtype in ("float32", "float16", "bfloat16"), "replay_dtype",
             "must be 'float32', 'float16' or 'bfloat16'")
        need(0 <= finite("replay_alpha") <= 1, "replay_alpha", "must be in [0, 1]")
        need(0 <= finite("replay_beta") <= 1, "replay_beta", "must be in [0, 1]")
        need(integer("replay_beta_steps") >= 0, "replay_beta_steps", "must be ≥ 0 (0 = constant)")
        need(1 <= integer("replay_batch_size") <= 65536, "replay_batch_size",
             "must be in [1, 65536]")
        need(integer("replay_min_size") >= 1, "replay_min_size", "must be ≥ 1")
        need(finite("replay_ratio") >= 0, "replay_ratio", "must be ≥ 0 (0 = train on request)")
        need(0 <= integer("replay_seed") < 1 << 64, "replay_seed", "must be in [0, 2^64)")
        if self.replay_capacity:
            need(self.replay_min_size <= self.replay_capacity, "replay_min_size",
                 f"must be ≤ replay_capacity={self.replay_capacity}")
            need(self.priority_eps > 0, "priority_eps",
                 "must be > 0 with the replay buffer on (a zero priority is never drawn again)")
        slots = dict(self.isv_slots)
        for name, index in slots.items():
            need(isinstance(name, str) and name != "", "isv_slots", "names must be non-empty strings")
            need(isinstance(index, int) and 0 <= index < self.isv_size, "isv_slots",
                 f"index of {name!r} must be in [0, isv_size={self.isv_size})")
        need(len(set(slots.values())) == len(slots), "isv_slots", "indices must be distinct")
        need(self.step_entropy_slot == "" or self.step_entropy_slot in slots,
             "step_entropy_slot", "must be '' or a name in isv_slots")
        object.__setattr__(self, "isv_slots", slots)

    def slot_index(self, slot: str | int, field: str = "slot") -> int:
        """Resolve a slot name or index to an index; unknown ones raise InvalidArgument
        naming ``field``."""
        if isinstance(slot, str):
            if slot not in self.isv_slots:
                raise InvalidArgument(field, f"unknown ISV slot name {slot!r}; "
                                      f"known: {sorted(self.isv_slots)}")
            return self.isv_slots[slot]
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.isv_size:
            raise InvalidArgument(field, f"ISV index must be an integer in "
                                  f"[0, {self.isv_size}), got {slot!r}")
        return slot

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict of every field."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "LearnerConfig":
        """Inverse of :meth:`to_dict`; unknown keys raise InvalidArgument."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise InvalidArgument("config", f"unknown fields {unknown}")
        return cls(**values)
