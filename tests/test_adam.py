"""Adam is torch.optim.Adam's: the moment updates bit for bit, and 100 steps at lr 0.1 within
1e-6 (relative) of torch.optim.Adam in float32, on the reference and, marked gpu, on the
device.

The trajectory test keeps every row's TD error far past κ (rewards 1e4, discounts 0), so the
gradient is the same at every step whatever θ is, and the two sides differ only in their
optimizer arithmetic: 1 − β formed in float32 from a float32 β (1 − 0.999 → 0.00099998713)
drifts the weights by 6e-6 of their size here.
"""

from __future__ import annotations

import numpy as np
import pytest

from duelq.server.core.batch import Batch
from duelq.server.core.learner import Learner, cuda_usable
from duelq.server.core.reference import adam_moments
from duelq.server.core.state import LearnerState

from helpers import small_config

torch = pytest.importorskip("torch")

CONFIG = small_config(lr=0.1)
STEPS = 100


@pytest.mark.parametrize("beta1, beta2", [(0.9, 0.999), (0.5, 0.99), (0.3, 0.6), (0.0, 0.0)])
def test_moment_updates_are_torchs_bit_for_bit(beta1, beta2):
    """m.lerp_(g, 1 − β1) and v.mul_(β2).addcmul_(g, g, value=1 − β2), both branches of
    lerp (1 − β1 below and above ½), on 10⁵ + 3 elements (torch's vector body and tail)."""
    rng = np.random.default_rng(int(beta1 * 10))
    n = 100_003
    m, g = (rng.standard_normal(n, dtype=np.float32) for _ in range(2))
    v = np.abs(rng.standard_normal(n, dtype=np.float32))
    want_m = torch.tensor(m).lerp_(torch.tensor(g), 1 - beta1).numpy()
    want_v = torch.tensor(v).mul_(beta2).addcmul_(torch.tensor(g), torch.tensor(g),
                                                  value=1 - beta2).numpy()
    got_m, got_v = adam_moments(m, v, g, beta1, beta2)
    assert got_m.dtype == got_v.dtype == np.float32
    assert got_m.tobytes() == want_m.tobytes() and got_v.tobytes() == want_v.tobytes()


def clipped_batch(rng: np.random.Generator, B: int = 16) -> Batch:
    """Positive features, one action, rewards 1e4 and no bootstrap: every |δ| ≫ κ for 100
    steps, so ∂L/∂θ does not depend on θ (and no sum in it cancels)."""
    H = CONFIG.hidden_dim
    return Batch(h_t=rng.uniform(0.5, 1.5, (B, H)).astype(np.float32),
                 h_tp1=rng.uniform(0.5, 1.5, (B, H)).astype(np.float32),
                 actions=np.full(B, 1, np.int32), rewards=np.full(B, 1e4, np.float32),
                 dones=np.zeros(B, np.float32), discounts=np.zeros(B, np.float32),
                 weights=rng.uniform(0.5, 1.5, B).astype(np.float32))


def torch_adam(state: LearnerState, batch: Batch, steps: int) -> dict[str, np.ndarray]:
    """θ, Adam's m and v after ``steps`` steps of torch.optim.Adam on ``batch``, float32,
    the gradient by autograd; each concatenated over the four tensors."""
    theta = [torch.tensor(a, requires_grad=True) for a in state.params.arrays()]
    opt = torch.optim.Adam(theta, lr=CONFIG.lr, betas=(CONFIG.beta1, CONFIG.beta2),
                           eps=CONFIG.adam_eps)
    h, r, w = (torch.tensor(x) for x in (batch.h_t, batch.rewards, batch.weights))
    act = torch.tensor(batch.actions, dtype=torch.int64)
    for _ in range(steps):
        V, A = h @ theta[0] + theta[1], h @ theta[2] + theta[3]
        q = V[:, None] + A - A.mean(dim=1, keepdim=True)
        q_taken = q.gather(1, act[:, None])[:, 0]
        huber = torch.nn.functional.huber_loss(q_taken, r, reduction="none",
                                               delta=CONFIG.huber_kappa)
        loss = (w * huber).sum() / len(r)
        opt.zero_grad()
        loss.backward()
        opt.step()

    def flat(tensors):
        return np.concatenate([t.detach().numpy().ravel() for t in tensors])
    return {"params": flat(theta), "adam_m": flat(opt.state[p]["exp_avg"] for p in theta),
            "adam_v": flat(opt.state[p]["exp_avg_sq"] for p in theta)}


def assert_adam_like_torch(backend: str) -> None:
    rng = np.random.default_rng(11)
    batch = clipped_batch(rng)
    learner = Learner(CONFIG, backend=backend)
    start = learner.snapshot()
    for _ in range(STEPS):
        learner.step(batch)
    got, want = learner.snapshot(), torch_adam(start, batch, STEPS)
    assert np.abs(got.params.w_a - start.params.w_a).min() > 5   # the weights travelled
    for group, expected in want.items():
        ours = np.concatenate([a.ravel() for a in getattr(got, group).arrays()])
        relative = np.linalg.norm(ours - expected) / np.linalg.norm(expected)
        assert relative <= 1e-6, f"{group}: {relative:.2e} from torch.optim.Adam"


def test_reference_steps_as_torch_adam_in_float32():
    assert_adam_like_torch("reference")


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_usable()[0], reason=f"no usable GPU: {cuda_usable()[1]}")
def test_the_kernel_steps_as_torch_adam_in_float32():
    assert_adam_like_torch("cuda")
