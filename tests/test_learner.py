"""The Learner boundary: every bad input refused with a named field, state untouched;
action entropy and its EMA; configuration checks; backend selection."""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np
import pytest

from duelq.server.core import (Batch, InvalidArgument, Learner, LearnerConfig, LearnerState,
                          NonFiniteStep, ResourceExhausted)
from duelq.server.core.batch import validate_batch, validate_features
from duelq.server.core.learner import cuda_usable

from helpers import random_batch, small_config

H, N = 8, 3


@pytest.fixture
def learner() -> Learner:
    lrn = Learner(small_config(), backend="reference", max_batch_size=64)
    lrn.step(random_batch(np.random.default_rng(0), 4, H, N))  # non-trivial moments
    return lrn


def good(B=4, **overrides) -> Batch:
    return dataclasses.replace(random_batch(np.random.default_rng(1), B, H, N), **overrides)


def f32(*values):
    return np.array(values, np.float32)


BAD_BATCHES = {
    "h_t wrong dtype": ("h_t", good(h_t=np.ones((4, H), np.float64))),
    "h_t wrong width": ("h_t", good(h_t=np.ones((4, H + 1), np.float32))),
    "h_t wrong rows": ("h_t", good(h_t=np.ones((3, H), np.float32))),
    "h_t 1-D": ("h_t", good(h_t=np.ones(4 * H, np.float32))),
    "h_t NaN": ("h_t", good(h_t=np.full((4, H), np.nan, np.float32))),
    "h_tp1 Inf": ("h_tp1", good(h_tp1=np.full((4, H), np.inf, np.float32))),
    "h_tp1 not an array": ("h_tp1", good(h_tp1=[[0.0] * H] * 4)),
    "B = 0": ("actions", Batch(*(np.zeros((0, H), np.float32),) * 2, np.zeros(0, np.int32),
                               *(np.zeros(0, np.float32),) * 3)),
    "actions negative": ("actions", good(actions=np.array([0, 1, -1, 2], np.int32))),
    "actions = N": ("actions", good(actions=np.array([0, 1, N, 2], np.int32))),
    "actions float": ("actions", good(actions=f32(0, 1, 2, 0))),
    "actions 2-D": ("actions", good(actions=np.zeros((4, 1), np.int32))),
    "rewards NaN": ("rewards", good(rewards=f32(0, np.nan, 0, 0))),
    "rewards wrong length": ("rewards", good(rewards=f32(0, 0, 0))),
    "rewards string": ("rewards", good(rewards=np.array(["a"] * 4))),
    "dones not 0/1": ("dones", good(dones=f32(0, 0.5, 1, 0))),
    "discounts > 1": ("discounts", good(discounts=f32(0.9, 1.01, 0.9, 0.9))),
    "discounts < 0": ("discounts", good(discounts=f32(0.9, -0.1, 0.9, 0.9))),
    "discounts Inf": ("discounts", good(discounts=f32(0.9, np.inf, 0.9, 0.9))),
    "weights negative": ("weights", good(weights=f32(1, 1, -0.5, 1))),
    "weights NaN": ("weights", good(weights=f32(1, 1, np.nan, 1))),
    "weights wrong length": ("weights", good(weights=f32(1, 1))),
}


@pytest.mark.parametrize("case", sorted(BAD_BATCHES))
def test_bad_batch_is_refused_naming_the_field_and_state_is_unchanged(learner, case):
    field, batch = BAD_BATCHES[case]
    before = learner.snapshot().checksum()
    with pytest.raises(InvalidArgument) as info:
        learner.step(batch)
    assert info.value.field == field
    assert str(info.value).startswith(field + ":")
    assert learner.snapshot().checksum() == before
    learner.step(good())  # still serving
    assert learner.step_count == 2


def test_batch_over_the_limit_is_resource_exhausted(learner):
    before = learner.snapshot().checksum()
    with pytest.raises(ResourceExhausted, match="65 exceeds the limit 64"):
        learner.step(good(B=65))
    assert learner.snapshot().checksum() == before


def test_float16_features_and_integer_dones_are_accepted(learner):
    b = good()
    result = learner.step(dataclasses.replace(b, h_t=b.h_t.astype(np.float16),
                                              dones=b.dones.astype(np.int32)))
    assert result.step == 2 and np.isfinite(result.loss)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_16_bit_features_are_kept_only_for_a_backend_that_takes_them(dtype):
    b = good()
    b16 = dataclasses.replace(b, h_t=b.h_t.astype(dtype), h_tp1=b.h_tp1.astype(dtype))
    CONFIG = small_config()
    kept = validate_batch(b16, CONFIG, 64, check_values=False, keep=(np.dtype(dtype),))
    assert kept.h_t.dtype == dtype and kept.h_tp1.dtype == dtype
    assert kept.h_t.tobytes() == b16.h_t.tobytes()
    widened = validate_batch(b16, CONFIG, 64)  # the reference backend's view: exact float32
    assert widened.h_t.dtype == np.float32
    assert np.array_equal(widened.h_t, b16.h_t.astype(np.float32))
    mixed = dataclasses.replace(b16, h_tp1=b.h_tp1)  # one dtype per batch, or float32
    assert validate_batch(mixed, CONFIG, 64, keep=(np.dtype(dtype),)).h_t.dtype == np.float32
    bad = b16.h_tp1.copy()
    bad[2, 5] = np.inf
    with pytest.raises(InvalidArgument, match=rf"h_tp1: contains NaN or Inf .*index {2 * H + 5}\b"):
        validate_batch(dataclasses.replace(b16, h_tp1=bad), CONFIG, 64, keep=(np.dtype(dtype),))
    with pytest.raises(InvalidArgument, match="float32, float16 or bfloat16, got float64"):
        validate_batch(dataclasses.replace(b, h_t=b.h_t.astype(np.float64)), CONFIG, 64)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_16_bit_features_are_refused_exactly_where_numpy_sees_nan_or_inf(dtype):
    """Every one of the 2^16 bit patterns, H to a row: a row is refused iff np.isfinite
    finds a value that is not finite, at its first such value."""
    rows = np.arange(1 << 16, dtype=np.uint16).view(dtype).reshape(-1, H)
    for row in rows:
        bad = np.flatnonzero(~np.isfinite(row.astype(np.float32)))
        if bad.size == 0:
            validate_features(row[None], H, "h_t", rows=1, keep=(np.dtype(dtype),))
            continue
        with pytest.raises(InvalidArgument, match=rf"h_t: .* index {bad[0]}\)"):
            validate_features(row[None], H, "h_t", rows=1, keep=(np.dtype(dtype),))


def test_non_finite_step_is_refused_and_state_unchanged(learner):
    before = learner.snapshot().checksum()
    huge = good(h_t=np.full((4, H), 3e38, np.float32))  # finite input, overflowing Q
    with pytest.raises(NonFiniteStep, match=r"^step 2 refused: .+; the state is unchanged$"):
        learner.step(huge)
    assert learner.snapshot().checksum() == before
    assert learner.step(good()).step == 2


def test_a_step_whose_loss_overflows_is_refused():
    # finite gradients and weights (tiny lr), but Σ w·huber(δ) overflows float32
    lrn = Learner(small_config(optimizer="sgd", lr=1e-30), backend="reference")
    before = lrn.snapshot().checksum()
    with pytest.raises(NonFiniteStep, match=r"^step 1 refused: the loss overflowed to inf "
                                            r"\(gradient norm [0-9.e+]+\); the state is "
                                            r"unchanged$"):
        lrn.step(good(rewards=f32(100, 100, 100, 100), weights=f32(1e38, 1e38, 1e38, 1e38)))
    assert lrn.snapshot().checksum() == before


def test_a_refusal_says_what_overflowed_first():
    config = small_config()
    state = LearnerState.initial(config)
    state.params.w_v[:] = 1.0                      # V = Σ h_t = 8e38: Q and δ overflow
    lrn = Learner(config, backend="reference", state=state)
    with pytest.raises(NonFiniteStep, match=r"^step 1 refused: 4 of 4 TD errors are non-finite "
                                            r"\(the Q-values overflowed\); the state is "
                                            r"unchanged$"):
        lrn.step(good(h_t=np.full((4, H), 1e38, np.float32)))
    lrn = Learner(small_config(optimizer="sgd", lr=1e38), backend="reference")
    with pytest.raises(NonFiniteStep, match=r"^step 1 refused: the update would make the weights "
                                            r"or the Adam moments non-finite \(gradient norm"):
        lrn.step(good(weights=f32(1e3, 1e3, 1e3, 1e3)))     # finite loss and gradient


def test_a_steps_entropy_of_one_action_is_plus_zero():
    lrn = Learner(small_config(step_entropy_slot="action_entropy_ema"), backend="reference")
    result = lrn.step(good(actions=np.full(4, 1, np.int32)))
    assert result.entropy == 0.0 and math.copysign(1, result.entropy) == 1


def test_step_result_shapes_and_priorities(learner):
    r = learner.step(good(B=5))
    assert r.td_errors.shape == r.priorities.shape == (5,)
    assert r.td_errors.dtype == r.priorities.dtype == np.float32
    np.testing.assert_allclose(r.priorities, np.abs(r.td_errors) + 1e-6, rtol=1e-6)


def test_q_values_and_weights(learner):
    h = np.random.default_rng(3).normal(size=(6, H)).astype(np.float32)
    q = learner.q_values(h)
    w, version = learner.weights()
    A = h @ w.w_a + w.b_a
    expect = (h @ w.w_v + w.b_v)[:, None] + A - A.mean(axis=1, keepdims=True)
    np.testing.assert_allclose(q, expect, rtol=1e-5, atol=1e-6)
    assert version == 1 and q.shape == (6, N)
    assert not np.array_equal(learner.q_values(h, target=True), q)  # θ⁻ moved only by τ
    with pytest.raises(InvalidArgument, match="^h:"):
        learner.q_values(np.ones((2, H + 1), np.float32))


# ---- action entropy and the ISV bus -------------------------------------------------


def test_uniform_actions_give_ln_n(learner):
    r = learner.compute_entropy(np.tile(np.arange(N, dtype=np.int32), 5), "action_entropy_ema", 0.5)
    assert r.entropy == pytest.approx(math.log(N), rel=1e-12)
    assert r.ema == pytest.approx(math.log(N), rel=1e-6)  # first observation bootstraps
    assert r.slot == 5


def test_one_action_gives_zero_and_a_zero_ema_stays_observed(learner):
    ones = np.full(10, 2, np.int32)
    first = learner.compute_entropy(ones, "action_entropy_ema", 0.3)
    assert first.entropy == 0.0 and first.ema == 0.0
    assert math.copysign(1, first.entropy) == math.copysign(1, first.ema) == 1   # +0.0
    [value] = learner.read_isv(["action_entropy_ema"])
    assert value.observed and value.value == 0.0 and value.name == "action_entropy_ema"
    # the seeds' `prev == 0.0` sentinel would re-bootstrap here to ln 2; we blend:
    second = learner.compute_entropy(np.array([0, 1], np.int32), "action_entropy_ema", 0.3)
    assert second.ema == pytest.approx(0.3 * math.log(2), rel=1e-6)


def test_ema_blends_after_the_first_observation(learner):
    learner.compute_entropy(np.array([0, 1, 2], np.int32), 7, 1.0)
    r = learner.compute_entropy(np.array([0, 0, 1, 1], np.int32), 7, 0.25)
    assert r.ema == pytest.approx(0.75 * math.log(3) + 0.25 * math.log(2), rel=1e-6)
    [value] = learner.read_isv([7])
    assert value.name == "" and value.value == pytest.approx(r.ema)


@pytest.mark.parametrize("alpha", [0.0, -0.1, 1.5, float("nan"), True, "0.5"])
def test_alpha_outside_0_1_is_refused(learner, alpha):
    before = learner.snapshot().checksum()
    with pytest.raises(InvalidArgument, match="^alpha:"):
        learner.compute_entropy(np.array([0, 1], np.int32), "action_entropy_ema", alpha)
    assert learner.snapshot().checksum() == before


@pytest.mark.parametrize("slot, actions, field", [
    ("nope", np.array([0], np.int32), "slot"),
    (16, np.array([0], np.int32), "slot"),
    (-1, np.array([0], np.int32), "slot"),
    ("action_entropy_ema", np.array([0, N], np.int32), "actions"),
    ("action_entropy_ema", np.array([], np.int32), "actions"),
    ("action_entropy_ema", np.array([0.0, 1.0]), "actions"),
])
def test_bad_entropy_requests_are_refused(learner, slot, actions, field):
    before = learner.snapshot().checksum()
    with pytest.raises(InvalidArgument) as info:
        learner.compute_entropy(actions, slot, 0.5)
    assert info.value.field == field
    assert learner.snapshot().checksum() == before


def test_train_step_updates_the_entropy_slot_when_configured():
    lrn = Learner(small_config(step_entropy_slot="action_entropy_ema", step_entropy_alpha=0.5),
                  backend="reference")
    b = good(actions=np.array([0, 0, 1, 1], np.int32))
    assert lrn.step(b).entropy == pytest.approx(math.log(2))
    [value] = lrn.read_isv(["action_entropy_ema"])
    assert value.observed and value.value == pytest.approx(math.log(2), rel=1e-6)


def test_read_isv_without_names_lists_every_named_slot(learner):
    assert [v.name for v in learner.read_isv([])] == ["policy_entropy_ema", "action_entropy_ema"]


# ---- configuration and state ---------------------------------------------------------


@pytest.mark.parametrize("field, value", [
    ("hidden_dim", 0), ("hidden_dim", 2.5), ("n_actions", 1), ("optimizer", "rmsprop"),
    ("lr", 0.0), ("lr", float("inf")), ("beta1", 1.0), ("beta2", -0.1), ("adam_eps", 0.0),
    ("huber_kappa", -1.0), ("double_dqn", "yes"), ("max_grad_norm", -1.0), ("tau", 0.0),
    ("tau", 1.5), ("target_update_period", 0), ("priority_eps", -1e-3), ("isv_size", 0),
    ("isv_slots", {"a": 2000}), ("isv_slots", {"a": 1, "b": 1}), ("step_entropy_slot", "nope"),
    ("step_entropy_alpha", 0.0), ("seed", -1),
])
def test_bad_config_values_name_the_field(field, value):
    with pytest.raises(InvalidArgument) as info:
        LearnerConfig(**{field: value})
    assert info.value.field == field


def test_config_round_trips_through_a_dict():
    cfg = small_config(double_dqn=True, lr=3e-4)
    assert LearnerConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(InvalidArgument, match="unknown fields"):
        LearnerConfig.from_dict({**cfg.to_dict(), "gamma": 0.99})


def test_initial_weights_are_reproducible_from_the_seed_and_target_equals_online():
    a, b = LearnerState.initial(small_config(seed=3)), LearnerState.initial(small_config(seed=3))
    assert a.checksum() == b.checksum()
    assert a.checksum() != LearnerState.initial(small_config(seed=4)).checksum()
    for p, t in zip(a.params.arrays(), a.target.arrays()):
        np.testing.assert_array_equal(p, t)
        assert p is not t
    bound = 1 / math.sqrt(8)
    assert all(np.abs(p).max() <= bound for p in a.params.arrays())


def test_same_batches_give_bit_identical_states():
    rng = np.random.default_rng(11)
    batches = [random_batch(rng, 32, H, N) for _ in range(5)]
    runs = []
    for _ in range(2):
        lrn = Learner(small_config(), backend="reference")
        for b in batches:
            lrn.step(b)
        runs.append(lrn.snapshot().checksum())
    assert runs[0] == runs[1]


def test_backend_selection():
    with pytest.raises(InvalidArgument, match="^backend:"):
        Learner(small_config(), backend="tpu")
    auto = Learner(small_config(), backend="auto")
    assert auto.backend.name == ("cuda" if cuda_usable()[0] else "reference")
    if not cuda_usable()[0]:
        with pytest.raises(RuntimeError, match="no usable GPU"):
            Learner(small_config(), backend="cuda")


def test_shape_only_validation_leaves_values_but_not_dtypes():
    """check_values=False (a backend that checks values on the device) passes bad values
    through untouched and still refuses bad dtypes and shapes: actions wider than int32,
    whose cast could wrap into range, are not among the contract's dtypes."""
    b, CONFIG, B = good(), small_config(), 4
    bad = dataclasses.replace(b, rewards=np.full(B, np.nan, np.float32),
                              dones=np.full(B, 0.5, np.float32),
                              discounts=np.full(B, 2.0, np.float32),
                              actions=np.full(B, 99, np.int32))
    with pytest.raises(InvalidArgument, match="actions"):
        validate_batch(bad, CONFIG, 64)
    passed = validate_batch(bad, CONFIG, 64, check_values=False)
    assert passed.actions is bad.actions and np.isnan(passed.rewards).all()
    with pytest.raises(InvalidArgument, match=r"dones: shape must be \[4\]"):
        validate_batch(dataclasses.replace(bad, dones=np.zeros(B + 1, np.float32)), CONFIG, 64,
                       check_values=False)
    wraps = np.full(B, 2**32 + 1, np.int64)  # 1 once cast to int32
    with pytest.raises(InvalidArgument, match=r"actions: dtype must be int32 or uint8, got int64"):
        validate_batch(dataclasses.replace(b, actions=wraps), CONFIG, 64, check_values=False)
    assert validate_batch(dataclasses.replace(b, actions=b.actions.astype(np.uint8)), CONFIG, 64,
                          check_values=False).actions.dtype == np.int32
