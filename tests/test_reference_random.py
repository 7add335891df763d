"""The reference step on fresh random inputs: finite differences, float32 vs float64,
and PyTorch autograd + torch.optim.Adam as an independent oracle."""

from __future__ import annotations

import numpy as np
import pytest

from duelq.server.core import LearnerState, Params
from duelq.server.core.reference import loss_and_grads, train_step

from helpers import random_batch, small_config


def f64_state(config, rng) -> LearnerState:
    """Initial state with θ⁻ ≠ θ, in float64."""
    s = LearnerState.initial(config)
    target = s.params.map(lambda a: a + rng.normal(scale=0.05, size=a.shape))
    return LearnerState(params=s.params.astype(np.float64), target=target.astype(np.float64),
                        adam_m=s.adam_m.astype(np.float64), adam_v=s.adam_v.astype(np.float64),
                        step=0, isv=s.isv.astype(np.float64), isv_observed=s.isv_observed)


@pytest.mark.parametrize("double_dqn", [False, True])
def test_gradients_match_central_finite_differences(double_dqn):
    rng = np.random.default_rng(1)
    cfg = small_config(hidden_dim=5, n_actions=4, double_dqn=double_dqn, huber_kappa=0.8)
    s = f64_state(cfg, rng)
    batch = random_batch(rng, 9, 5, 4)
    _, _, _, grads = loss_and_grads(s.params, s.target, batch, cfg, np.float64)
    eps = 1e-6
    for name, g in zip(("w_v", "b_v", "w_a", "b_a"), grads.arrays()):
        p = getattr(s.params, name)
        for idx in np.ndindex(p.shape):
            def loss_at(delta):
                q = p.copy()
                q[idx] += delta
                moved = Params(**{**{n: getattr(s.params, n) for n in ("w_v", "b_v", "w_a", "b_a")},
                                  name: q})
                return loss_and_grads(moved, s.target, batch, cfg, np.float64)[0]
            fd = (loss_at(eps) - loss_at(-eps)) / (2 * eps)
            assert g[idx] == pytest.approx(fd, rel=1e-5, abs=1e-8), (name, idx)


@pytest.mark.parametrize("B", [1, 7, 256, 4096])
def test_float32_path_matches_float64_path(B):
    rng = np.random.default_rng(B)
    cfg = small_config(hidden_dim=32, n_actions=6, max_grad_norm=0.5, lr=1e-2,
                       step_entropy_slot="action_entropy_ema")
    state64 = f64_state(cfg, rng)
    state32 = LearnerState(*(g.astype(np.float32) for g in (state64.params, state64.target,
                                                            state64.adam_m, state64.adam_v)),
                           step=0, isv=state64.isv.astype(np.float32),
                           isv_observed=state64.isv_observed.copy())
    for _ in range(3):
        batch = random_batch(rng, B, 32, 6)
        state32, out32 = train_step(state32, batch, cfg, np.float32)
        state64, out64 = train_step(state64, batch, cfg, np.float64)
        assert out32.loss == pytest.approx(out64.loss, rel=1e-4)
        np.testing.assert_allclose(out32.td_errors, out64.td_errors, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(out32.priorities, out64.priorities, rtol=1e-4, atol=1e-5)
        assert out32.q_taken_mean == pytest.approx(out64.q_taken_mean, rel=1e-4, abs=1e-5)
        assert out32.entropy == pytest.approx(out64.entropy, rel=1e-6)
    assert state32.params.w_v.dtype == np.float32
    for g32, g64 in zip((state32.params, state32.target, state32.adam_m, state32.adam_v),
                        (state64.params, state64.target, state64.adam_m, state64.adam_v)):
        for a32, a64 in zip(g32.arrays(), g64.arrays()):
            scale = np.abs(a64).max() + 1e-12
            assert np.abs(a32 - a64).max() / scale < 1e-4
    np.testing.assert_allclose(state32.isv, state64.isv, rtol=1e-6)


def torch_steps(state: LearnerState, batches, cfg):
    """The same steps written in PyTorch: autograd, clip_grad_norm_, optim.Adam/SGD, Polyak."""
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    names = ("w_v", "b_v", "w_a", "b_a")
    theta = {n: torch.tensor(getattr(state.params, n), dtype=torch.float64, requires_grad=True)
             for n in names}
    target = {n: torch.tensor(getattr(state.target, n), dtype=torch.float64) for n in names}
    params = [theta[n] for n in names]
    opt = (torch.optim.Adam(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps)
           if cfg.optimizer == "adam" else torch.optim.SGD(params, lr=cfg.lr))

    def q(p, h):
        A = h @ p["w_a"] + p["b_a"]
        return (h @ p["w_v"] + p["b_v"])[:, None] + A - A.mean(dim=1, keepdim=True)

    outs = []
    for t, b in enumerate(batches, start=1):
        T = {k: torch.tensor(getattr(b, k), dtype=torch.float64)
             for k in ("h_t", "h_tp1", "rewards", "dones", "discounts", "weights")}
        a = torch.tensor(b.actions, dtype=torch.long)
        with torch.no_grad():
            q_next = q(target, T["h_tp1"])
            a_star = (q(theta, T["h_tp1"]) if cfg.double_dqn else q_next).argmax(dim=1)
            y = T["rewards"] + T["discounts"] * (1 - T["dones"]) * q_next.gather(1, a_star[:, None])[:, 0]
        q_taken = q(theta, T["h_t"]).gather(1, a[:, None])[:, 0]
        per_sample = F.huber_loss(q_taken, y, reduction="none", delta=cfg.huber_kappa)
        loss = (T["weights"] * per_sample).mean()
        opt.zero_grad()
        loss.backward()
        if cfg.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        opt.step()
        with torch.no_grad():
            if t % cfg.target_update_period == 0:
                for n in names:
                    target[n].add_(cfg.tau * (theta[n] - target[n]))
        outs.append((loss.item(), (q_taken - y).detach().numpy()))
    as_params = lambda d: Params(*(d[n].detach().numpy() for n in names))  # noqa: E731
    moments = [opt.state[p] for p in params]
    return as_params(theta), as_params(target), moments, outs


@pytest.mark.parametrize("optimizer, double_dqn, period", [("adam", False, 1), ("adam", True, 3),
                                                            ("sgd", False, 2)])
def test_full_steps_match_pytorch_autograd(optimizer, double_dqn, period):
    rng = np.random.default_rng(7)
    cfg = small_config(hidden_dim=12, n_actions=5, optimizer=optimizer, double_dqn=double_dqn,
                       target_update_period=period, tau=0.3, lr=3e-3, max_grad_norm=0.2,
                       huber_kappa=0.5)
    state = f64_state(cfg, rng)
    batches = [random_batch(rng, 64, 12, 5) for _ in range(6)]
    theta, target, moments, outs = torch_steps(state, batches, cfg)
    for b, (t_loss, t_delta) in zip(batches, outs):
        state, out = train_step(state, b, cfg, np.float64)
        assert out.loss == pytest.approx(t_loss, rel=1e-10)
        np.testing.assert_allclose(out.td_errors, t_delta, rtol=1e-6, atol=1e-7)
    for mine, theirs in ((state.params, theta), (state.target, target)):
        for a, b in zip(mine.arrays(), theirs.arrays()):
            np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)
    if optimizer == "adam":
        for m, v, st in zip(state.adam_m.arrays(), state.adam_v.arrays(), moments):
            np.testing.assert_allclose(m, st["exp_avg"].numpy(), rtol=1e-9, atol=1e-15)
            np.testing.assert_allclose(v, st["exp_avg_sq"].numpy(), rtol=1e-9, atol=1e-18)
