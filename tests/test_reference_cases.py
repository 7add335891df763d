"""Named, hand-computable cases of the learner step (Dopamine's losses_test style).

The base case, computed on paper: H = 2 features, N = 2 actions,
θ = θ⁻ with w_v = [1, 0], b_v = 0, w_a = I, b_a = 0.

  h_t   = [1, 2]:  V = 1, A = [1, 2], mean A = 1.5  →  Q = [0.5, 1.5]
  h_tp1 = [2, 0]:  V = 2, A = [2, 0], mean A = 1    →  Q = [3.0, 1.0]  → a* = 0
  r = 1, γⁿ = 0.5, done = 0                         →  y = 1 + 0.5·3 = 2.5
  a = 1                                             →  δ = 1.5 − 2.5 = −1
  κ = 1, |δ| = 1 ≤ κ                                →  L = ½δ² = 0.5
  g = clip(δ)/B = −1;  ∂A = g·(onehot − ½) = [0.5, −0.5]
  ∂w_v = g·h_t = [−1, −2], ∂b_v = −1, ∂w_a = h_t ⊗ ∂A = [[0.5, −0.5], [1, −1]], ∂b_a = [0.5, −0.5]
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from duelq.server.core import Batch, LearnerConfig, LearnerState, Params
from duelq.server.core.reference import huber, loss_and_grads, q_values, train_step

F64 = np.float64


def paper_state(target: Params | None = None) -> LearnerState:
    theta = Params(w_v=np.array([1.0, 0.0], F64), b_v=np.array([0.0], F64),
                   w_a=np.eye(2, dtype=F64), b_a=np.zeros(2, F64))
    zeros = theta.map(np.zeros_like)
    return LearnerState(params=theta, target=target or theta.copy(), adam_m=zeros,
                        adam_v=zeros.copy(), step=0, isv=np.zeros(4), isv_observed=np.zeros(4, bool))


def paper_batch(**overrides) -> Batch:
    values = dict(h_t=np.array([[1.0, 2.0]]), h_tp1=np.array([[2.0, 0.0]]),
                  actions=np.array([1], np.int32), rewards=np.array([1.0]),
                  dones=np.array([0.0]), discounts=np.array([0.5]), weights=None)
    values.update(overrides)
    return Batch(**values)


def paper_config(**overrides) -> LearnerConfig:
    values = dict(hidden_dim=2, n_actions=2, isv_size=4, isv_slots={"action_entropy_ema": 1},
                  optimizer="sgd", lr=0.1, tau=0.5, priority_eps=1e-6)
    values.update(overrides)
    return LearnerConfig(**values)


def test_paper_forward():
    s = paper_state()
    np.testing.assert_allclose(q_values(s.params, np.array([[1.0, 2.0]])), [[0.5, 1.5]])
    np.testing.assert_allclose(q_values(s.params, np.array([[2.0, 0.0]])), [[3.0, 1.0]])


def test_paper_loss_td_and_gradients():
    s = paper_state()
    loss, delta, q_taken, g = loss_and_grads(s.params, s.target, paper_batch(), paper_config(), F64)
    assert loss == pytest.approx(0.5)
    np.testing.assert_allclose(delta, [-1.0])
    np.testing.assert_allclose(q_taken, [1.5])
    np.testing.assert_allclose(g.w_v, [-1.0, -2.0])
    np.testing.assert_allclose(g.b_v, [-1.0])
    np.testing.assert_allclose(g.w_a, [[0.5, -0.5], [1.0, -1.0]])
    np.testing.assert_allclose(g.b_a, [0.5, -0.5])


def test_paper_sgd_step_and_soft_update():
    new, out = train_step(paper_state(), paper_batch(), paper_config(), F64)
    # θ ← θ − 0.1·∂θ
    np.testing.assert_allclose(new.params.w_v, [1.1, 0.2])
    np.testing.assert_allclose(new.params.b_v, [0.1])
    np.testing.assert_allclose(new.params.w_a, [[0.95, 0.05], [-0.1, 1.1]])
    np.testing.assert_allclose(new.params.b_a, [-0.05, 0.05])
    # θ⁻ ← θ⁻ + 0.5 (θ_new − θ⁻), from the *new* θ
    np.testing.assert_allclose(new.target.w_v, [1.05, 0.1])
    np.testing.assert_allclose(new.target.w_a, [[0.975, 0.025], [-0.05, 1.05]])
    assert out.loss == pytest.approx(0.5)
    np.testing.assert_allclose(out.td_errors, [-1.0])
    np.testing.assert_allclose(out.priorities, [1.0 + 1e-6], rtol=1e-7)
    assert out.q_taken_mean == pytest.approx(1.5)
    assert out.grad_norm == pytest.approx(math.sqrt(1 + 4 + 1 + 0.25 * 2 + 1 + 1 + 0.25 * 2))
    assert out.finite and new.step == 1


def test_paper_adam_first_step_moves_each_weight_by_lr_times_sign():
    # At t = 1, m̂ = g and v̂ = g², so the update is lr·g / (|g| + eps).
    cfg = paper_config(optimizer="adam", lr=0.01, adam_eps=1e-8)
    s = paper_state()
    new, _ = train_step(s, paper_batch(), cfg, F64)
    _, _, _, g = loss_and_grads(s.params, s.target, paper_batch(), cfg, F64)
    for p0, p1, gi in zip(s.params.arrays(), new.params.arrays(), g.arrays()):
        np.testing.assert_allclose(p1, p0 - 0.01 * gi / (np.abs(gi) + 1e-8), rtol=0, atol=1e-15)
    np.testing.assert_allclose(new.adam_m.w_v, 0.1 * g.w_v)
    np.testing.assert_allclose(new.adam_v.w_v, 0.001 * g.w_v ** 2)


def test_done_masks_the_bootstrap():
    s = paper_state()
    _, delta, _, _ = loss_and_grads(s.params, s.target, paper_batch(dones=np.array([1.0])),
                                    paper_config(), F64)
    np.testing.assert_allclose(delta, [1.5 - 1.0])  # y = r


def test_importance_weight_scales_loss_and_gradient():
    s = paper_state()
    l1, _, _, g1 = loss_and_grads(s.params, s.target, paper_batch(), paper_config(), F64)
    l3, _, _, g3 = loss_and_grads(s.params, s.target, paper_batch(weights=np.array([3.0])),
                                  paper_config(), F64)
    assert l3 == pytest.approx(3 * l1)
    np.testing.assert_allclose(g3.w_a, 3 * g1.w_a)


@pytest.mark.parametrize("kappa, expect_loss, expect_g", [
    (2.0, 0.5, -1.0),        # |δ| = 1 < κ: quadratic, full gradient
    (1.0, 0.5, -1.0),        # |δ| = κ: both branches give ½κ², gradient −κ
    (0.5, 0.375, -0.5),      # |δ| > κ: κ(|δ| − ½κ) = 0.5·0.75, gradient clipped to −κ
])
def test_huber_kappa_boundary(kappa, expect_loss, expect_g):
    s = paper_state()
    loss, _, _, g = loss_and_grads(s.params, s.target, paper_batch(), paper_config(huber_kappa=kappa),
                                   F64)
    assert loss == pytest.approx(expect_loss)
    assert g.b_v[0] == pytest.approx(expect_g)


def test_huber_is_continuous_at_kappa():
    k = 0.7
    below, at, above = huber(np.array([k - 1e-9, k, k + 1e-9]), k)
    assert below == pytest.approx(at, abs=1e-8) and above == pytest.approx(at, abs=1e-8)


def test_argmax_ties_go_to_the_lowest_index():
    # h_tp1 = 0: every online Q is b_v + b_a − mean(b_a) = equal when b_a is constant.
    # Double DQN picks a* = 0 from the tie; θ⁻ values Q⁻ = [5, 7] make the choice visible.
    theta = paper_state().params
    target = Params(w_v=np.zeros(2), b_v=np.array([6.0]), w_a=np.zeros((2, 2)),
                    b_a=np.array([-1.0, 1.0]))
    b = paper_batch(h_tp1=np.zeros((1, 2)))
    _, delta, _, _ = loss_and_grads(theta, target, b, paper_config(double_dqn=True), F64)
    np.testing.assert_allclose(delta, [1.5 - (1 + 0.5 * 5.0)])


def test_double_dqn_and_plain_target_pick_different_actions():
    # Online Q(h_tp1) = [3, 1] → double DQN picks a* = 0.
    # Target θ⁻ has w_a swapped → Q⁻(h_tp1) = [1, 3] → plain DQN picks a* = 1 with value 3,
    # double DQN evaluates θ⁻ at a* = 0: value 1.
    theta = paper_state().params
    target = Params(w_v=np.array([1.0, 0.0]), b_v=np.array([0.0]),
                    w_a=np.array([[0.0, 1.0], [1.0, 0.0]]), b_a=np.zeros(2))
    np.testing.assert_allclose(q_values(target, np.array([[2.0, 0.0]])), [[1.0, 3.0]])
    plain = loss_and_grads(theta, target, paper_batch(), paper_config(), F64)[1]
    double = loss_and_grads(theta, target, paper_batch(), paper_config(double_dqn=True), F64)[1]
    np.testing.assert_allclose(plain, [1.5 - (1 + 0.5 * 3.0)])
    np.testing.assert_allclose(double, [1.5 - (1 + 0.5 * 1.0)])


def test_gradient_clipping_scales_to_max_norm():
    new, out = train_step(paper_state(), paper_batch(), paper_config(max_grad_norm=1.0), F64)
    scale = 1.0 / (out.grad_norm + 1e-6)
    np.testing.assert_allclose(new.params.w_v, [1.0 + 0.1 * scale, 0.0 + 0.2 * scale])


def test_target_update_period_and_hard_copy():
    cfg = paper_config(tau=1.0, target_update_period=2)
    s1, _ = train_step(paper_state(), paper_batch(), cfg, F64)
    np.testing.assert_array_equal(s1.target.w_v, paper_state().target.w_v)  # step 1: untouched
    s2, _ = train_step(s1, paper_batch(), cfg, F64)
    for p, t in zip(s2.params.arrays(), s2.target.arrays()):             # step 2: hard copy
        np.testing.assert_array_equal(p, t)
