"""NumPy reference backend: the exact math of docs/design.md §1–§2, top to bottom.

It serves requests in float32 where no GPU is present and is the oracle the
CUDA kernels are tested against (in float64, ``dtype=np.float64``).
"""

from __future__ import annotations

import numpy as np

from duelq.server.core.backend import Backend, StepOutputs, Upload
from duelq.server.core.batch import Batch
from duelq.server.core.config import LearnerConfig
from duelq.server.core.state import LearnerState, Params


def q_values(p: Params, h: np.ndarray) -> np.ndarray:
    """Dueling Q-values: Q[a] = V + A[a] − mean_a' A[a']."""
    V = h @ p.w_v + p.b_v[0]                     # [B]
    A = h @ p.w_a + p.b_a                        # [B, N]
    return V[:, None] + A - A.mean(axis=1, keepdims=True)  # [B, N]


def huber(x: np.ndarray, kappa: float) -> np.ndarray:
    """½x² for |x| ≤ κ, else κ(|x| − ½κ)."""
    ax = np.abs(x)
    return np.where(ax <= kappa, 0.5 * x * x, kappa * (ax - 0.5 * kappa))


def action_entropy(actions: np.ndarray, n_actions: int) -> float:
    """Entropy in nats of the empirical action distribution of ``actions`` [M]."""
    counts = np.bincount(actions, minlength=n_actions)  # [N]
    p = counts[counts > 0] / actions.shape[0]
    return float(0.0 - (p * np.log(p)).sum())  # 0 − Σ: one action gives +0.0, not −0.0


def ema_update(isv: np.ndarray, observed: np.ndarray, slot: int, value: float,
               alpha: float) -> None:
    """In place: bootstrap a slot on its first observation, else blend with rate α."""
    dtype = isv.dtype.type
    if observed[slot]:
        isv[slot] = dtype(1.0 - alpha) * isv[slot] + dtype(alpha) * dtype(value)
    else:
        isv[slot] = dtype(value)
        observed[slot] = True


def fma(a, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """a·b + c rounded once to ``c``'s dtype, as the fused multiply-add of torch's optimizer
    kernels: float32 goes through float64, where the product is exact (the sum's second
    rounding matters only in a rare double-rounding tie); float64 is computed plainly."""
    if c.dtype == np.float32:
        wide = np.multiply(a, b, dtype=np.float64)
        wide += c
        return wide.astype(np.float32)
    return a * b + c


def lerp(start: np.ndarray, end: np.ndarray, weight) -> np.ndarray:
    """torch.lerp: start + weight·(end − start), from the nearer end (ATen's formula)."""
    if abs(weight) < 0.5:
        return fma(weight, end - start, start)
    return fma(weight - 1, end - start, end)


def adam_moments(m: np.ndarray, v: np.ndarray, g: np.ndarray, beta1: float, beta2: float
                 ) -> tuple[np.ndarray, np.ndarray]:
    """torch.optim.Adam's moment updates in ``g``'s dtype: m.lerp_(g, 1 − β1) and
    v.mul_(β2).addcmul_(g, g, value=1 − β2), each 1 − β rounded once from its exact value."""
    dtype = g.dtype.type
    w1, w2 = dtype(1 - beta1), dtype(1 - beta2)
    return lerp(m, g, w1), fma(w2 * g, g, v * dtype(beta2))


def loss_and_grads(theta: Params, target: Params, batch: Batch, config: LearnerConfig,
                   dtype=np.float32) -> tuple[float, np.ndarray, np.ndarray, Params]:
    """docs/design.md §1 steps 1–5: (loss, δ [B], Q_θ(h_t)[a] [B], ∂L/∂θ) for θ, θ⁻ in
    ``dtype``."""
    # Aligned (a copy of an array viewed at an odd offset of request bytes): NumPy's matmul
    # uses BLAS only on aligned arrays, so the bits do not depend on where the batch lay.
    cast = lambda a: np.require(a, dtype, "A")  # noqa: E731
    h_t, h_tp1 = cast(batch.h_t), cast(batch.h_tp1)          # [B, H]
    actions = batch.actions                                   # [B] int32
    rewards, dones, discounts = cast(batch.rewards), cast(batch.dones), cast(batch.discounts)
    w = cast(batch.weights) if batch.weights is not None else np.ones_like(rewards)  # [B]
    B, N = h_t.shape[0], config.n_actions
    rows = np.arange(B)
    kappa = dtype(config.huber_kappa)

    # 1. Target action, ties to the lowest index (np.argmax).
    q_next_target = q_values(target, h_tp1)                   # [B, N]
    q_next_select = q_values(theta, h_tp1) if config.double_dqn else q_next_target
    a_star = np.argmax(q_next_select, axis=1)                 # [B]

    # 2. Bellman target, no gradient through it.
    y = rewards + discounts * (1 - dones) * q_next_target[rows, a_star]  # [B]

    # 3. TD error at the taken action.
    q_t = q_values(theta, h_t)                                # [B, N]
    q_taken = q_t[rows, actions]                              # [B]
    delta = q_taken - y                                       # [B]

    # 4. Importance-weighted Huber loss.
    loss = (w * huber(delta, kappa)).sum() / dtype(B)

    # 5. Gradients: dL/dQ at the taken action, then through the dueling mean.
    g = w * np.clip(delta, -kappa, kappa) / dtype(B)          # [B]
    onehot = np.zeros((B, N), dtype)
    onehot[rows, actions] = 1
    dA = g[:, None] * (onehot - dtype(1.0 / N))               # [B, N], rows sum to 0
    grads = Params(w_v=h_t.T @ g, b_v=g.sum(keepdims=True),   # [H], [1]
                   w_a=h_t.T @ dA, b_a=dA.sum(axis=0))        # [H, N], [N]
    return float(loss), delta, q_taken, grads


def train_step(state: LearnerState, batch: Batch, config: LearnerConfig,
               dtype=np.float32) -> tuple[LearnerState, StepOutputs]:
    """One learner step (docs/design.md §1 steps 1–9); returns the new state and outputs.

    Pure: ``state`` is not modified.  Every tensor is computed in ``dtype``.
    """
    theta, target = state.params.astype(dtype), state.target.astype(dtype)
    loss, delta, q_taken, grads = loss_and_grads(theta, target, batch, config, dtype)

    # 6. Optional clipping by global norm.
    grad_norm = np.sqrt(sum((a.astype(np.float64) ** 2).sum() for a in grads.arrays()))
    if config.max_grad_norm > 0:
        scale = dtype(min(1.0, config.max_grad_norm / (grad_norm + 1e-6)))
        grads = grads.map(lambda a: a * scale)

    # 7. Optimizer (PyTorch's Adam with bias correction, or plain SGD).
    t = state.step + 1
    m, v = state.adam_m.astype(dtype), state.adam_v.astype(dtype)
    if config.optimizer == "adam":   # torch.optim.Adam's _single_tensor_adam, op for op
        moments = [adam_moments(m_, v_, g_, config.beta1, config.beta2)
                   for m_, v_, g_ in zip(m.arrays(), v.arrays(), grads.arrays())]
        m, v = Params(*(mv[0] for mv in moments)), Params(*(mv[1] for mv in moments))
        step_size = dtype(config.lr / (1 - config.beta1 ** t))
        sqrt_bc2 = dtype((1 - config.beta2 ** t) ** 0.5)
        eps = dtype(config.adam_eps)
        denom = v.map(lambda v_: np.sqrt(v_) / sqrt_bc2 + eps)
        update = m.zip(denom, lambda m_, d_: step_size * m_ / d_)
    else:
        update = grads.map(lambda g_: dtype(config.lr) * g_)
    new_theta = theta.zip(update, lambda p, u: p - u)

    # 8. Target update from the new θ, every target_update_period steps.
    new_target = target
    if t % config.target_update_period == 0:
        tau = dtype(config.tau)
        new_target = target.zip(new_theta, lambda p_, q_: p_ + tau * (q_ - p_))

    # Optional: fold this batch's action entropy into an ISV slot.
    isv, observed, entropy = state.isv.astype(dtype), state.isv_observed.copy(), None
    if config.step_entropy_slot:
        entropy = action_entropy(batch.actions, config.n_actions)
        ema_update(isv, observed, config.isv_slots[config.step_entropy_slot], entropy,
                   config.step_entropy_alpha)

    finite = np.isfinite([loss, q_taken.mean()]).all() and np.isfinite(delta).all() and all(
        np.isfinite(a).all() for group in (grads, new_theta, new_target, m, v)
        for a in group.arrays())
    new_state = LearnerState(params=new_theta, target=new_target, adam_m=m, adam_v=v,
                             step=t, isv=isv, isv_observed=observed)
    # 9. Outputs.
    outputs = StepOutputs(
        loss=loss,
        td_errors=delta.astype(np.float32),
        priorities=(np.abs(delta) + dtype(config.priority_eps)).astype(np.float32),
        q_taken_mean=float(q_taken.mean()),
        grad_norm=float(grad_norm),
        finite=bool(finite),
        entropy=entropy,
    )
    return new_state, outputs


class ReferenceBackend(Backend):
    """Holds the state in host memory and steps it with :func:`train_step`."""

    name = "reference"
    device = "cpu (numpy)"

    def __init__(self, config: LearnerConfig, state: LearnerState, dtype=np.float32):
        super().__init__(config, state)
        self.dtype = dtype
        self._state = state.copy()
        self._pending: LearnerState | None = None

    @property
    def step(self) -> int:
        return self._state.step

    def snapshot(self) -> LearnerState:
        return self._state.copy()

    def load(self, state: LearnerState) -> None:
        self._state, self._pending = state.copy(), None

    def weights(self, target: bool = False) -> Params:
        return (self._state.target if target else self._state.params).astype(np.float32)

    def q_values(self, h: np.ndarray, target: bool = False) -> np.ndarray:
        p = self._state.target if target else self._state.params
        return q_values(p.astype(self.dtype), h.astype(self.dtype)).astype(np.float32)

    def propose(self, batch: Batch, upload: Upload | None = None) -> StepOutputs:
        with np.errstate(over="ignore", invalid="ignore"):  # overflow → finite=False
            self._pending, outputs = train_step(self._state, batch, self.config, self.dtype)
        return outputs

    def commit(self) -> None:
        assert self._pending is not None, "commit without a pending step"
        self._state, self._pending = self._pending, None

    def discard(self) -> None:
        self._pending = None

    def entropy(self, actions: np.ndarray, slot: int, alpha: float) -> tuple[float, float]:
        h = action_entropy(actions, self.config.n_actions)
        ema_update(self._state.isv, self._state.isv_observed, slot, h, alpha)
        return h, float(self._state.isv[slot])

    def read_isv(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self._state.isv[indices].copy(), self._state.isv_observed[indices].copy()
