"""GPU tests of the CUDA backend: float64 NumPy reference and PyTorch autograd as oracles.

Every buffer a call writes is NaN-poisoned first, so an unwritten element fails.
Batches are random; rows whose target action is ambiguous at float32 precision (top-two
gap of the selecting Q-values < 1e-4 under the oracle's state) are redrawn, because there
float32 and float64 may legitimately pick different actions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import zlib

import numpy as np
import pytest

from duelq.server.core import reference
from duelq.server.core.batch import Batch, PackedBatch
from duelq.server.core.config import LearnerConfig
from duelq.server.core.errors import InvalidArgument, NonFiniteStep
from duelq.server.core.learner import Learner, cuda_usable
from duelq.server.core.state import LearnerState, Params

USABLE, WHY = cuda_usable()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not USABLE, reason=f"no usable GPU: {WHY}")]

SLOT = "action_entropy_ema"
GROUPS = ("params", "target", "adam_m", "adam_v")


def cuda_backend(config: LearnerConfig, state: LearnerState | None = None):
    """A CudaBackend from ``state`` (default: the config's initial one); its host calls are
    server/core/native.c's."""
    from duelq.server.core.cuda import CudaBackend
    return CudaBackend(config, state if state is not None else LearnerState.initial(config))


def poison(backend, batch_size: int = 0) -> None:
    """NaN-fill (−7 for ints) every buffer that a step, Act or entropy call writes; tagged
    partials get a NaN value under the previous launch's epoch (what a stale word looks like)."""
    import cupy as cp
    backend._outputs.reserve(2 * batch_size + 1 + 5 * backend.max_blocks)
    stale = np.uint64((((backend._epoch - 2) % 2**32) << 32) | 0x7FC00000)
    with backend.stream:
        pending = backend._states[1 - backend._cur]
        for a in (pending.params, pending.isv, backend._outputs.device, backend._grad,
                  backend._part_sq, backend._ent_out):
            a.fill(np.nan)
        pending.observed.fill(-7)
        for a in (backend._part_grad, backend._part_counts, backend._ent_part):
            a.fill(stale)
        backend._act_out = cp.full(batch_size * backend.config.n_actions, np.nan, np.float32)
    backend._outputs.host.fill(np.nan)
    backend.stream.synchronize()


# ---- random inputs ----------------------------------------------------------------------
def random_state(config: LearnerConfig, rng: np.random.Generator, step: int) -> LearnerState:
    """θ from the config's init, θ⁻ ≠ θ, Adam moments ≠ 0, half the ISV slots observed."""
    init = LearnerState.initial(config)

    def noisy(p: Params, scale: float, positive: bool = False) -> Params:
        def draw(a):
            return rng.random(a.shape) if positive else rng.standard_normal(a.shape)
        return p.map(lambda a: (a + scale * draw(a)).astype(np.float32))

    adam = config.optimizer == "adam"
    zeros = Params.zeros(config.hidden_dim, config.n_actions)
    return LearnerState(
        params=init.params, target=noisy(init.params, 0.05),
        adam_m=noisy(zeros, 1e-3) if adam else zeros,
        adam_v=noisy(zeros, 1e-5, positive=True) if adam else zeros.copy(),
        step=step, isv=rng.standard_normal(config.isv_size).astype(np.float32),
        isv_observed=rng.random(config.isv_size) < 0.5)


def random_batch(rng, B: int, config: LearnerConfig, state: LearnerState,
                 weights: bool) -> Batch:
    """Random batch; rows with an ambiguous target action are redrawn (see module doc)."""
    H, N = config.hidden_dim, config.n_actions
    selector = (state.params if config.double_dqn else state.target).astype(np.float64)
    h_tp1 = rng.standard_normal((B, H)).astype(np.float32)
    while True:
        q = np.sort(reference.q_values(selector, h_tp1.astype(np.float64)), axis=1)
        bad = q[:, -1] - q[:, -2] < 1e-4
        if not bad.any():
            break
        h_tp1[bad] = rng.standard_normal((int(bad.sum()), H)).astype(np.float32)
    return Batch(
        h_t=rng.standard_normal((B, H)).astype(np.float32), h_tp1=h_tp1,
        actions=rng.integers(0, N, B).astype(np.int32),
        rewards=rng.standard_normal(B).astype(np.float32),
        dones=(rng.random(B) < 0.2).astype(np.float32),
        discounts=rng.uniform(0.5, 1.0, B).astype(np.float32),
        weights=rng.uniform(0.0, 2.0, B).astype(np.float32) if weights else None)


# ---- comparisons ------------------------------------------------------------------------
def assert_close(name: str, got, ref, rtol: float, atol_scale: float) -> None:
    """|got − ref| ≤ rtol·|ref| + atol_scale·max|ref| elementwise; NaN never passes."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape, f"{name}: shape {got.shape} != {ref.shape}"
    assert np.isfinite(got).all(), f"{name}: non-finite element (unwritten?) at " \
                                   f"{np.argwhere(~np.isfinite(got))[:3].tolist()}"
    scale = float(np.abs(ref).max()) if ref.size else 0.0
    err = np.abs(got - ref)
    bad = err > rtol * np.abs(ref) + atol_scale * scale
    if bad.any():
        i = np.unravel_index(np.argmax(np.where(bad, err, -1)), err.shape)
        pytest.fail(f"{name}: {int(bad.sum())}/{bad.size} elements off; worst at {list(i)}: "
                    f"got {got[i]!r}, ref {ref[i]!r} (max|ref| {scale:g})")


def assert_scalar(name: str, got: float, ref: float, rtol: float = 1e-4, atol: float = 1e-6):
    assert math.isfinite(got) and abs(got - ref) <= rtol * abs(ref) + atol, \
        f"{name}: got {got!r}, ref {ref!r}"


def assert_outputs(got, ref) -> None:
    assert got.finite and ref.finite
    assert_scalar("loss", got.loss, ref.loss)
    assert_scalar("q_taken_mean", got.q_taken_mean, ref.q_taken_mean, atol=1e-5)
    assert_scalar("grad_norm", got.grad_norm, ref.grad_norm)
    assert_close("td_errors", got.td_errors, ref.td_errors, 1e-4, 1e-5)
    assert_close("priorities", got.priorities, ref.priorities, 1e-4, 1e-5)
    if ref.entropy is None:
        assert got.entropy is None
    else:
        assert_scalar("entropy", got.entropy, ref.entropy, rtol=0, atol=2e-6)


def assert_state(backend, ref: LearnerState, start: LearnerState) -> None:
    """Every tensor of the committed state, and θ, θ⁻ moves since ``start``."""
    got = backend.snapshot()
    assert got.step == ref.step
    for group in GROUPS:
        for name, g, r in zip(("w_v", "b_v", "w_a", "b_a"), getattr(got, group).arrays(),
                              getattr(ref, group).arrays()):
            assert_close(f"{group}.{name}", g, r, 2e-4, 1e-4)
    for group in ("params", "target"):
        for name, g, r, s in zip(("w_v", "b_v", "w_a", "b_a"), getattr(got, group).arrays(),
                                 getattr(ref, group).arrays(), getattr(start, group).arrays()):
            assert_close(f"Δ{group}.{name}", g - s.astype(np.float64), r - s, 1e-3, 1e-3)
    assert_close("isv", got.isv, ref.isv, 1e-5, 1e-6)
    raw_observed = backend._states[backend._cur].observed.get()
    assert set(np.unique(raw_observed)) <= {0, 1}, "observed flags not all written"
    np.testing.assert_array_equal(got.isv_observed, ref.isv_observed)


# ---- the step against the float64 reference ----------------------------------------------
@dataclasses.dataclass(frozen=True)
class Case:
    B: int
    H: int
    N: int
    optimizer: str
    double_dqn: bool
    weights: bool
    clip: float        # max_grad_norm as a multiple of the first step's gradient norm; 0 = off
    period: int = 1    # target_update_period
    entropy: bool = False
    start_step: int = 0

    def __str__(self):
        return (f"B{self.B}-H{self.H}-N{self.N}-{self.optimizer}-"
                f"{'double' if self.double_dqn else 'plain'}-{'w' if self.weights else 'now'}-"
                f"clip{self.clip}-K{self.period}{'-ent' if self.entropy else ''}")


CASES = [
    Case(1, 64, 2, "adam", False, True, 0.5),
    Case(31, 128, 11, "sgd", True, False, 2.0, entropy=True, start_step=4),
    Case(1024, 256, 18, "adam", True, True, 0.5, period=3, start_step=5),
    Case(1024, 64, 11, "sgd", False, True, 0.0, entropy=True),
    Case(16384, 128, 11, "adam", False, True, 0.5, entropy=True, start_step=9),
    Case(16384, 64, 18, "sgd", True, False, 2.0, period=2, start_step=1),
    Case(31, 256, 2, "adam", True, False, 0.5, period=4),
    Case(1, 128, 18, "sgd", True, True, 0.5, entropy=True),
    Case(31, 100, 7, "adam", False, True, 0.5),  # H not a multiple of 4: scalar loads
    # Gradient partials summed in global memory tile by tile (too many for registers).
    Case(4096, 512, 18, "adam", True, True, 0.5, entropy=True, start_step=2),
    # No clipping, no entropy, and blocks whose parameter slice is empty (G·slice > params).
    Case(2048, 64, 11, "adam", False, True, 0.0),
]
FIFTY = [CASES[i] for i in (0, 1, 2, 3, 5, 6)]


def run_against_reference(case: Case, steps: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    config = LearnerConfig(
        hidden_dim=case.H, n_actions=case.N, optimizer=case.optimizer,
        lr=1e-3 if case.optimizer == "adam" else 5e-2, double_dqn=case.double_dqn,
        target_update_period=case.period, tau=1.0 if case.period == 4 else 0.05,
        step_entropy_slot=SLOT if case.entropy else "", step_entropy_alpha=0.3)
    start = random_state(config, rng, case.start_step)
    batch = random_batch(rng, case.B, config, start, case.weights)
    if case.clip:
        _, first = reference.train_step(start, batch, config, np.float64)
        config = dataclasses.replace(config, max_grad_norm=case.clip * first.grad_norm)
    backend = cuda_backend(config, start)
    ref = start
    for k in range(steps):
        if k:
            batch = random_batch(rng, case.B, config, ref, case.weights)
        poison(backend, case.B)
        got = backend.propose(batch)
        ref, ref_out = reference.train_step(ref, batch, config, np.float64)
        assert_outputs(got, ref_out)
        backend.commit()
    assert_state(backend, ref, start)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_one_step_matches_float64_reference(case):
    run_against_reference(case, steps=1, seed=zlib.crc32(str(case).encode()))


@pytest.mark.parametrize("case", FIFTY, ids=str)
def test_fifty_steps_match_float64_reference(case):
    run_against_reference(case, steps=50, seed=zlib.crc32(str(case).encode()) + 1)


def test_pytorch_autograd_agrees():
    """Three steps from the initial state: CUDA vs torch autograd + torch.optim (float64)."""
    torch = pytest.importorskip("torch")
    for case in (Case(1024, 128, 11, "adam", True, True, 0.5),
                 Case(31, 64, 2, "sgd", False, False, 0.5)):
        rng = np.random.default_rng(7)
        config = LearnerConfig(hidden_dim=case.H, n_actions=case.N, optimizer=case.optimizer,
                               lr=1e-2, double_dqn=case.double_dqn, max_grad_norm=0.05, tau=0.1)
        start = LearnerState.initial(config)
        batches = [random_batch(rng, case.B, config, start, case.weights) for _ in range(3)]
        want, want_out = torch_trajectory(torch, start, batches, config)
        ref = start
        for batch, out in zip(batches, want_out):  # the two oracles agree with each other
            ref, ref_out = reference.train_step(ref, batch, config, np.float64)
            assert_close("torch vs numpy td", out["td"], ref_out.td_errors, 1e-7, 1e-9)  # f32 out
        for group in GROUPS:
            for g, r in zip(getattr(want, group).arrays(), getattr(ref, group).arrays()):
                assert_close(f"torch vs numpy {group}", g, r, 1e-9, 1e-12)
        backend = cuda_backend(config, start)
        for batch, out in zip(batches, want_out):
            poison(backend, case.B)
            got = backend.propose(batch)
            backend.commit()
            assert_scalar("loss", got.loss, out["loss"])
            assert_scalar("grad_norm", got.grad_norm, out["grad_norm"])
            assert_close("td_errors", got.td_errors, out["td"], 1e-4, 1e-5)
        assert_state(backend, dataclasses.replace(want, isv=start.isv,
                                                  isv_observed=start.isv_observed), start)


def torch_trajectory(torch, state: LearnerState, batches, config: LearnerConfig):
    """The same steps written with autograd, torch.optim and clip_grad_norm_, in float64."""
    f64 = torch.float64
    theta = [torch.tensor(a, dtype=f64, requires_grad=True) for a in state.params.arrays()]
    target = [torch.tensor(a, dtype=f64) for a in state.target.arrays()]
    opt = (torch.optim.Adam(theta, lr=config.lr, betas=(config.beta1, config.beta2),
                            eps=config.adam_eps)
           if config.optimizer == "adam" else torch.optim.SGD(theta, lr=config.lr))

    def q(p, h):  # [B, H] → [B, N]
        V, A = h @ p[0] + p[1], h @ p[2] + p[3]
        return V[:, None] + A - A.mean(dim=1, keepdim=True)

    outputs = []
    for t, b in enumerate(batches, start=state.step + 1):
        ht, hn = torch.tensor(b.h_t, dtype=f64), torch.tensor(b.h_tp1, dtype=f64)
        r, d, g = (torch.tensor(x, dtype=f64) for x in (b.rewards, b.dones, b.discounts))
        w = torch.tensor(b.weights, dtype=f64) if b.weights is not None else torch.ones_like(r)
        act = torch.tensor(b.actions, dtype=torch.int64)
        with torch.no_grad():
            q_target = q(target, hn)
            a_star = (q(theta, hn) if config.double_dqn else q_target).argmax(dim=1)
            y = r + g * (1 - d) * q_target.gather(1, a_star[:, None])[:, 0]
        q_taken = q(theta, ht).gather(1, act[:, None])[:, 0]
        loss = (w * torch.nn.functional.huber_loss(q_taken, y, reduction="none",
                                                   delta=config.huber_kappa)).sum() / len(r)
        opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(theta, config.max_grad_norm)
        opt.step()
        if t % config.target_update_period == 0:
            with torch.no_grad():
                for p_t, p in zip(target, theta):
                    p_t.add_(config.tau * (p - p_t))
        outputs.append({"loss": loss.item(), "td": (q_taken - y).detach().numpy(),
                        "grad_norm": float(norm)})

    def params(tensors):
        return Params(*(x.detach().numpy().copy() for x in tensors))

    zeros = Params.zeros(config.hidden_dim, config.n_actions, np.float64)
    moments = ((params(opt.state[p]["exp_avg"] for p in theta),
                params(opt.state[p]["exp_avg_sq"] for p in theta))
               if config.optimizer == "adam" else (zeros, zeros))
    final = LearnerState(params=params(theta), target=params(target), adam_m=moments[0],
                         adam_v=moments[1], step=state.step + len(batches),
                         isv=state.isv, isv_observed=state.isv_observed)
    return final, outputs


# ---- determinism, refusal, plumbing ------------------------------------------------------
def test_bit_identical_across_runs():
    config = LearnerConfig(hidden_dim=128, n_actions=11, double_dqn=True, max_grad_norm=0.1,
                           step_entropy_slot=SLOT)
    rng = np.random.default_rng(3)
    start = random_state(config, rng, 0)
    batches = [random_batch(rng, 16384, config, start, True) for _ in range(3)]
    runs = []
    for _ in range(2):
        backend = cuda_backend(config, start)
        outs = []
        for batch in batches:
            first = backend.propose(batch)
            backend.discard()
            again = backend.propose(batch)
            assert first.td_errors.tobytes() == again.td_errors.tobytes()
            assert (first.loss, first.grad_norm) == (again.loss, again.grad_norm)
            backend.commit()
            outs.append((again.loss, again.grad_norm, again.entropy, again.td_errors.tobytes()))
        runs.append((backend.snapshot().checksum(), outs))
    assert runs[0] == runs[1]


def test_non_finite_step_is_refused_and_state_unchanged():
    config = LearnerConfig(hidden_dim=64, n_actions=11)
    rng = np.random.default_rng(5)
    state = random_state(config, rng, 2)
    sane = random_batch(rng, 31, config, state, True)
    huge = dataclasses.replace(sane, weights=np.full(31, 3e38, np.float32))  # g² overflows
    _, f32 = reference.train_step(state, huge, config, np.float32)
    assert not f32.finite  # the float32 reference refuses it too
    learner = Learner(config, backend=cuda_backend(config, state))
    before = learner.snapshot().checksum()
    with pytest.raises(NonFiniteStep):
        learner.step(huge)
    assert learner.snapshot().checksum() == before and learner.step_count == 2
    assert learner.step(sane).step == 3


def test_a_step_whose_loss_overflows_is_refused():
    # gradients and weights stay finite (SGD, tiny lr); only Σ w·huber(δ) overflows
    config = LearnerConfig(hidden_dim=64, n_actions=11, optimizer="sgd", lr=1e-30)
    rng = np.random.default_rng(6)
    state = random_state(config, rng, 0)
    sane = random_batch(rng, 31, config, state, True)
    huge = dataclasses.replace(sane, rewards=np.full(31, 100, np.float32),
                               weights=np.full(31, 1e38, np.float32))
    assert not reference.train_step(state, huge, config, np.float32)[1].finite
    learner = Learner(config, backend=cuda_backend(config, state))
    before = learner.snapshot().checksum()
    with pytest.raises(NonFiniteStep, match=r"step 1 refused: the loss overflowed to inf "):
        learner.step(huge)
    assert learner.snapshot().checksum() == before


def test_discard_leaves_state_and_commit_advances():
    config = LearnerConfig(hidden_dim=64, n_actions=2)
    rng = np.random.default_rng(6)
    state = random_state(config, rng, 3)
    backend = cuda_backend(config, state)
    backend.propose(random_batch(rng, 31, config, state, False))
    backend.discard()
    assert backend.snapshot().checksum() == state.checksum() and backend.step == 3
    backend.propose(random_batch(rng, 31, config, state, False))
    backend.commit()
    assert backend.step == 4 and backend.snapshot().checksum() != state.checksum()


def test_load_snapshot_and_weights_round_trip():
    config = LearnerConfig(hidden_dim=100, n_actions=7)  # H not a multiple of 4
    state = random_state(config, np.random.default_rng(8), 12)
    backend = cuda_backend(config, state)
    assert backend.snapshot().checksum() == state.checksum()
    for target, want in ((False, state.params), (True, state.target)):
        for g, w in zip(backend.weights(target).arrays(), want.arrays()):
            np.testing.assert_array_equal(g, w)
    values, observed = backend.read_isv(np.array([0, 583, 1023]))
    np.testing.assert_array_equal(values, state.isv[[0, 583, 1023]])
    np.testing.assert_array_equal(observed, state.isv_observed[[0, 583, 1023]])


@pytest.mark.parametrize("B,H,N", [(1, 64, 2), (31, 128, 11), (1024, 256, 18), (16384, 100, 7)])
def test_q_values_match_reference(B, H, N):
    config = LearnerConfig(hidden_dim=H, n_actions=N)
    rng = np.random.default_rng(B + H + N)
    state = random_state(config, rng, 0)
    backend = cuda_backend(config, state)
    h = rng.standard_normal((B, H)).astype(np.float32)
    for target, params in ((False, state.params), (True, state.target)):
        poison(backend, B)
        want = reference.q_values(params.astype(np.float64), h.astype(np.float64))
        assert_close(f"Q target={target}", backend.q_values(h, target), want, 1e-4, 1e-5)


# ---- action entropy ---------------------------------------------------------------------
def entropy_call(backend, actions, slot, alpha):
    poison(backend)
    return backend.entropy(np.asarray(actions, np.int32), slot, alpha)


def fresh_slot_backend(n_actions: int, slot: int = 583, value: float = 0.0, observed=False):
    config = LearnerConfig(hidden_dim=64, n_actions=n_actions)
    state = LearnerState.initial(config)
    state.isv[slot], state.isv_observed[slot] = value, observed
    return cuda_backend(config, state)


def test_entropy_all_one_action_is_zero_and_stays_observed():
    backend = fresh_slot_backend(11)
    h, ema = entropy_call(backend, np.full(1000, 3), 583, 0.2)
    assert (h, ema) == (0.0, 0.0) and math.copysign(1, h) == math.copysign(1, ema) == 1  # +0.0
    values, observed = backend.read_isv(np.array([583]))
    assert values[0] == 0.0 and observed[0]
    h, ema = entropy_call(backend, np.arange(1100) % 11, 583, 0.2)  # EMA 0 is not re-bootstrapped
    assert_scalar("entropy", h, math.log(11), rtol=0, atol=1e-6)
    assert_scalar("ema", ema, 0.2 * math.log(11), rtol=0, atol=1e-6)


def test_a_steps_entropy_of_one_action_is_plus_zero():
    config = LearnerConfig(hidden_dim=64, n_actions=11, step_entropy_slot=SLOT)
    rng = np.random.default_rng(8)
    state = LearnerState.initial(config)
    batch = dataclasses.replace(random_batch(rng, 300, config, state, True),
                                actions=np.full(300, 4, np.int32))
    result = Learner(config, backend=cuda_backend(config, state)).step(batch)
    assert result.entropy == 0.0 and math.copysign(1, result.entropy) == 1


@pytest.mark.parametrize("N", [2, 11, 18, 32, 33, 100, 1024])
def test_entropy_uniform_is_log_n(N):
    backend = fresh_slot_backend(N)
    h, ema = entropy_call(backend, np.random.default_rng(N).permutation(np.arange(64 * N) % N),
                          583, 0.5)
    assert_scalar("entropy", h, math.log(N), rtol=0, atol=1e-6)
    assert ema == np.float32(h)  # bootstrapped, not blended


def test_entropy_first_observation_bootstraps_regardless_of_value():
    backend = fresh_slot_backend(11, value=5.0, observed=False)
    actions = np.random.default_rng(1).integers(0, 11, 500)
    h, ema = entropy_call(backend, actions, 583, 0.1)
    assert ema == np.float32(h) and backend.read_isv(np.array([583]))[1][0]


@pytest.mark.parametrize("M", [1, 31, 1023, 1025, 16384, 16385, 65536])
def test_entropy_matches_reference_any_length(M):
    N = 11
    rng = np.random.default_rng(M)
    config = LearnerConfig(hidden_dim=64, n_actions=N)
    state = random_state(config, rng, 0)
    backend = cuda_backend(config, state)
    ref = reference.ReferenceBackend(config, state, dtype=np.float64)
    p = rng.dirichlet(np.ones(N) * 0.5)  # skewed, some actions rare
    for slot, alpha in ((583, 0.3), (583, 0.05), (420, 1.0), (7, 0.5)):
        actions = rng.choice(N, size=M, p=p).astype(np.int32)
        h, ema = entropy_call(backend, actions, slot, alpha)
        want_h, want_ema = ref.entropy(actions, slot, alpha)
        assert_scalar("entropy", h, want_h, rtol=0, atol=2e-6)
        assert_scalar("ema", ema, want_ema, rtol=1e-6, atol=2e-6)
    got_values, got_observed = backend.read_isv(np.arange(config.isv_size))
    want_values, want_observed = ref.read_isv(np.arange(config.isv_size))
    assert_close("isv", got_values, want_values, 1e-6, 1e-7)
    np.testing.assert_array_equal(got_observed, want_observed)


@pytest.mark.parametrize("N", [33, 1024])  # counters in shared memory instead of registers
def test_entropy_many_actions_matches_reference(N):
    rng = np.random.default_rng(N)
    config = LearnerConfig(hidden_dim=64, n_actions=N)
    backend = cuda_backend(config)
    ref = reference.ReferenceBackend(config, LearnerState.initial(config), dtype=np.float64)
    for M in (1, 999, 40000):
        actions = rng.choice(N, size=M, p=rng.dirichlet(np.ones(N) * 0.3)).astype(np.int32)
        h, ema = entropy_call(backend, actions, 583, 0.25)
        want_h, want_ema = ref.entropy(actions, 583, 0.25)
        assert_scalar("entropy", h, want_h, rtol=0, atol=2e-6)
        assert_scalar("ema", ema, want_ema, rtol=1e-6, atol=2e-6)


def test_the_epoch_restart_changes_nothing():
    """Steps and entropy calls across the epoch restart at 2^30 (tagged buffers and barrier
    flags zeroed, count restarted) give bit for bit what the same calls give far from it."""
    config = LearnerConfig(hidden_dim=64, n_actions=11, max_grad_norm=1.0, step_entropy_slot=SLOT)
    rng = np.random.default_rng(8)
    start = random_state(config, rng, 0)
    batches = [random_batch(rng, 4096, config, start, True) for _ in range(4)]
    actions = rng.integers(0, 11, 20000).astype(np.int32)
    runs = []
    for epoch in (1, (1 << 30) - 4):
        backend = cuda_backend(config, start)
        backend._epoch = epoch
        outs = []
        for batch in batches:
            poison(backend, batch.size)
            out = backend.propose(batch)
            backend.commit()
            outs.append((out.loss, out.grad_norm, out.entropy, out.td_errors.tobytes(),
                         backend.entropy(actions, 7, 0.5)))
        runs.append((backend.snapshot().checksum(), outs, backend._epoch < 100))
    assert runs[0][:2] == runs[1][:2]
    assert runs[1][2], "the epoch did not wrap"


@pytest.mark.parametrize("B", [31, 4096])
def test_invalid_values_are_found_on_the_device(B):
    """The host checks only dtypes and shapes on cuda; the kernel's flag makes the learner
    refuse a batch with any invalid value, at any position, with the host's message and
    the state unchanged (an action out of range reads no memory outside its arrays)."""
    config = LearnerConfig(hidden_dim=64, n_actions=11, step_entropy_slot=SLOT)
    rng = np.random.default_rng(B)
    state = random_state(config, rng, 3)
    learner = Learner(config, backend=cuda_backend(config, state))
    assert learner.backend.checks_values
    sane = random_batch(rng, B, config, state, True)
    before = learner.snapshot().checksum()
    H, last = config.hidden_dim, B - 1
    nan_at = r"NaN or Inf.*index {}\b"
    cases = [("h_t", 0, np.nan, nan_at), ("h_tp1", B * H - 1, np.inf, nan_at),
             ("h_t", (B // 2) * H + 5, -np.inf, nan_at), ("h_tp1", H + 1, np.nan, nan_at),
             ("actions", last, 11, r"\[0, 11\); element {} is 11"),
             ("actions", 0, -1, r"element {} is -1"),
             ("actions", B // 2, 2**31 - 1, r"element {} is 2147483647"),
             ("rewards", last, np.inf, nan_at), ("rewards", 1, np.nan, nan_at),
             ("dones", B // 3, 0.5, r"0 or 1; element {} is 0.5"),
             ("discounts", 0, 1.0 + 2**-23, r"\[0, 1\]; element {}"),
             ("discounts", last, -0.0001, r"\[0, 1\]; element {}"),
             ("discounts", 2, np.nan, nan_at),
             ("weights", last, -1.0, r"≥ 0; element {}"), ("weights", 0, np.inf, nan_at)]
    for field, flat, value, message in cases:
        bad = getattr(sane, field).copy()
        bad.reshape(-1)[flat] = value
        with pytest.raises(InvalidArgument, match=rf"{field}.*{message.format(flat)}"):
            learner.step(dataclasses.replace(sane, **{field: bad}))
        assert learner.snapshot().checksum() == before and learner.step_count == 3
    edge = dataclasses.replace(sane, dones=np.where(np.arange(B) % 2, 1.0, -0.0).astype(
        np.float32), discounts=np.where(np.arange(B) % 2, 1.0, 0.0).astype(np.float32),
        weights=np.zeros(B, np.float32))
    learner.step(edge)  # the bounds themselves are valid; the refusals left nothing behind
    assert learner.step_count == 4


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("B,H", [(31, 64), (4096, 128), (300, 100)])  # H=100: scalar loads
def test_16_bit_features_widened_on_the_device_match_float32(dtype, B, H):
    """16-bit features go to the kernel as they came and are widened there: every output
    and the state are bit-identical to sending the same values as float32."""
    import ml_dtypes
    dt = np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16)
    config = LearnerConfig(hidden_dim=H, n_actions=11, step_entropy_slot=SLOT)
    rng = np.random.default_rng(B + H)
    start = random_state(config, rng, 1)
    narrow, wide = Learner(config, backend=cuda_backend(config, start)), \
        Learner(config, backend=cuda_backend(config, start))
    for step in range(3):
        b = random_batch(rng, B, config, start, step != 1)
        b16 = dataclasses.replace(b, h_t=b.h_t.astype(dt), h_tp1=b.h_tp1.astype(dt))
        b32 = dataclasses.replace(b, h_t=b16.h_t.astype(np.float32),
                                  h_tp1=b16.h_tp1.astype(np.float32))
        with narrow.prepare(b16) as prepared:
            assert prepared.batch.h_t.dtype == dt  # really sent as 16-bit
            got = narrow.step(prepared)
        want = wide.step(b32)
        assert (got.loss, got.grad_norm, got.entropy) == (want.loss, want.grad_norm, want.entropy)
        assert got.td_errors.tobytes() == want.td_errors.tobytes()
    assert narrow.snapshot().checksum() == wide.snapshot().checksum()
    bad = b16.h_tp1.copy()
    bad.reshape(-1)[B * H - 3] = np.inf
    before = narrow.snapshot().checksum()
    with pytest.raises(InvalidArgument, match=rf"h_tp1.*NaN or Inf.*index {B * H - 3}\b"):
        narrow.step(dataclasses.replace(b16, h_tp1=bad))
    assert narrow.snapshot().checksum() == before


def test_the_relay_keeps_no_more_jobs_than_there_are_upload_buffers():
    from duelq.server.core import cuda
    from duelq.server.fronts import relay
    assert relay.AHEAD + 1 <= cuda.UPLOAD_BUFFERS


def test_uploaded_batches_step_exactly_like_staged_ones():
    """Batches sent ahead with prepare() (more than there are upload buffers, one never
    stepped) give bit for bit what the same batches give stepped one at a time."""
    config = LearnerConfig(hidden_dim=128, n_actions=11, step_entropy_slot=SLOT)
    rng = np.random.default_rng(12)
    start = random_state(config, rng, 0)
    batches = [random_batch(rng, B, config, start, w)
               for B, w in ((1024, True), (31, False), (4096, True), (1024, True), (7, False))]
    plain = Learner(config, backend=cuda_backend(config, start))
    want = [plain.step(b) for b in batches]
    ahead = Learner(config, backend=cuda_backend(config, start))
    prepared = [ahead.prepare(b) for b in batches]
    assert sum(p.upload is not None for p in prepared) == 3  # the buffers, then staged at step
    with ahead.prepare(batches[0]):  # sent ahead and never stepped: its buffer comes back
        pass
    got = [ahead.step(p) for p in prepared]
    for g, w in zip(got, want):
        assert (g.loss, g.grad_norm, g.entropy, g.step) == (w.loss, w.grad_norm, w.entropy, w.step)
        assert g.td_errors.tobytes() == w.td_errors.tobytes()
    assert ahead.snapshot().checksum() == plain.snapshot().checksum()
    assert sum(ahead.prepare(b).upload is not None for b in batches[:3]) == 3  # all came back


def pack_request(data: bytes, buffer: np.ndarray, packer=None) -> tuple[PackedBatch, bytes]:
    """(the packed batch, its key's bytes) of request ``data`` written into ``buffer``
    (uint8) by the front's Packer and read back as the learner reads a PACKED frame."""
    from duelq.server.fronts.packing import Packer, read_packed
    descriptor = (packer if packer is not None else Packer()).pack(data, buffer)
    assert descriptor is not None
    return read_packed(descriptor, buffer.data, buffer.ctypes.data)


@pytest.mark.parametrize("wire", ["float32", "float16", "bfloat16"])
def test_packed_batches_copied_from_pinned_memory_step_as_unpacked_ones(wire):
    """Packed batches (server/fronts/packing.py) copied to the device from where they lie:
    in a pool page-locked with backend.pin (at odd offsets) or in pageable memory outside
    it.  The device's words are bit for bit what the host packs of the decoded batch
    (_Staging.pack), and the steps are bit-identical to the same batches unpacked."""
    from duelq.client import encode_batch
    from duelq.server.core.cuda import _Staging
    from duelq.server.framing import parse_train_request
    from duelq.server.service import decode_batch
    rng = np.random.default_rng(21)
    pool = np.zeros(8 << 20, np.uint8)
    outside = np.zeros(1 << 20, np.uint8)
    for H in (128, 127):
        config = LearnerConfig(hidden_dim=H, n_actions=11, step_entropy_slot=SLOT)
        start = random_state(config, rng, 0)
        plain = Learner(config, backend=cuda_backend(config, start))
        direct = Learner(config, backend=cuda_backend(config, start))
        direct.backend.pin(pool)
        try:
            for B, weights, offset, region in ((1024, True, 3, pool), (31, False, 1 << 20, pool),
                                               (4096, True, 7, pool), (1, True, 2, pool),
                                               (33, True, 1, outside)):
                data = encode_batch(random_batch(rng, B, config, start, weights),
                                    feature_dtype=wire).SerializeToString()
                decoded = decode_batch(parse_train_request(data), keep_16bit=True)
                packed, _ = pack_request(data, region[offset:])
                with direct.prepare_packed(packed) as prepared:
                    assert prepared.batch is packed and prepared.upload is not None
                    prepared.upload.buffer.copied.synchronize()
                    host = _Staging()
                    words = host.pack(decoded)
                    assert words == packed.words
                    device = prepared.upload.buffer.staging.device[:words].get()
                    assert device.tobytes() == host.host[:words].tobytes()
                    got = direct.step(prepared)
                want = plain.step(decoded)
                assert (got.loss, got.grad_norm, got.entropy) == (want.loss, want.grad_norm,
                                                                  want.entropy)
                assert got.td_errors.tobytes() == want.td_errors.tobytes()
            assert direct.snapshot().checksum() == plain.snapshot().checksum()
        finally:
            direct.backend.unpin(pool)
        assert not direct.backend._pinned


@contextlib.contextmanager
def relayed_learners(config: LearnerConfig, start: LearnerState, pool_bytes: int):
    """(plain, relayed, service, pool): two cuda learners from ``start``, the second behind a
    service, as the front process's learner is, with a page-locked pool of ``pool_bytes``
    for requests (the first steps decoded batches, to compare with)."""
    from duelq.server.server import ServerOptions
    from duelq.server.service import LearnerService
    plain = Learner(config, backend=cuda_backend(config, start))
    relayed = Learner(config, backend=cuda_backend(config, start))
    service = LearnerService(ServerOptions(max_message_bytes=1 << 26, max_batch_size=1 << 16,
                                           max_streams=4).limits())
    service.attach(relayed)
    pool = np.zeros(pool_bytes, np.uint8)
    relayed.backend.pin(pool)
    try:
        yield plain, relayed, service, pool
    finally:
        relayed.backend.unpin(pool)


@pytest.mark.parametrize("wire", ["float32", "float16", "bfloat16"])
def test_requests_packed_by_the_front_step_as_decoded_ones(wire):
    """The front's packed requests (server/fronts/packing.py) on cuda: a relay buffer's words go to
    the device as they are, bit for bit what the host packs (_Staging.pack).  Packed and
    unpacked requests take turns in the upload buffers (an unpacked one is packed into its
    upload buffer's pinned host memory, a packed one copied from where it lies); packed requests
    beyond the upload buffers are staged at their step.  Every step is bit-identical to a
    learner fed the decoded batch, and a packed batch's bad value is found by the kernel
    and named by the host."""
    from duelq.client import encode_batch
    from duelq.server.core.cuda import UPLOAD_BUFFERS, _Staging
    from duelq.server.fronts.packing import Packer
    from duelq.server.framing import parse_train_request
    from duelq.server.service import decode_batch
    rng = np.random.default_rng(23)
    config = LearnerConfig(hidden_dim=128, n_actions=11, step_entropy_slot=SLOT)
    start = random_state(config, rng, 0)
    packer, size = Packer(), 4 << 20
    with relayed_learners(config, start, 8 * size) as (plain, relayed, service, pool):
        def prepare(i: int, data: bytes, packed: bool):
            at = (i % 8) * size
            if not packed:   # at an odd offset
                pool[at + 1:at + 1 + len(data)] = np.frombuffer(data, np.uint8)
                return service.relay_prepare(pool.data[at + 1:at + 1 + len(data)], "TrainStream")
            return service.relay_prepare_packed(*pack_request(data, pool[at:at + size],
                                                              packer), "TrainStream")

        def want(data: bytes):
            return plain.step(decode_batch(parse_train_request(data), keep_16bit=True))

        def same(got, wanted, i) -> None:
            assert (got.loss, got.grad_norm, got.entropy) == (wanted.loss, wanted.grad_norm,
                                                              wanted.entropy), i
            assert got.td_errors.tobytes() == wanted.td_errors.tobytes(), i

        # Each upload buffer's turn: mixed kinds, then unpacked 64 rows, packed 3072 (the staging
        # buffers grow and move) and 64 unpacked again, packed anew on the host.
        for i, (B, weights, packed) in enumerate([(1024, True, True), (1024, False, False),
                                                  (64, True, True)] * 3
                                                 + [(1024, True, False), (31, False, True)] * 2
                                                 + [(64, True, False)] * 3
                                                 + [(3072, True, True)] * 3
                                                 + [(64, True, False)] * 3):
            batch = random_batch(rng, B, config, start, weights)
            data = encode_batch(batch, feature_dtype=wire).SerializeToString()
            with prepare(i, data, packed) as job:
                upload = job.prepared.upload
                assert upload is not None
                assert (type(job.prepared.batch) is PackedBatch) == packed
                if packed:
                    upload.buffer.copied.synchronize()
                    host = _Staging()
                    words = host.pack(decode_batch(parse_train_request(data),
                                                   keep_16bit=True))
                    device = upload.buffer.staging.device[:words].get()
                    assert device.tobytes() == host.host[:words].tobytes(), i
                got = relayed.step(job.prepared)
            same(got, want(data), i)
        # More packed requests ahead than upload buffers: the last is staged at its step.
        datas = [encode_batch(random_batch(rng, 512, config, start, True),
                              feature_dtype=wire).SerializeToString()
                 for _ in range(UPLOAD_BUFFERS + 1)]
        jobs = [prepare(i, data, True) for i, data in enumerate(datas)]
        assert [job.prepared.upload is not None for job in jobs] == [True] * UPLOAD_BUFFERS + [
            False]
        for i, (job, data) in enumerate(zip(jobs, datas)):
            with job:
                got = relayed.step(job.prepared)
            same(got, want(data), i)
        assert relayed.snapshot().checksum() == plain.snapshot().checksum()
        bad = random_batch(rng, 1024, config, start, True)
        bad.rewards[700] = np.nan
        with pytest.raises(InvalidArgument, match="rewards.*index 700"):
            with prepare(0, encode_batch(bad, feature_dtype=wire).SerializeToString(),
                         True) as job:
                relayed.step(job.prepared)
        assert relayed.snapshot().checksum() == plain.snapshot().checksum()


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_an_upload_failing_part_way_gives_its_buffer_back_whole(packed, monkeypatch):
    """A request whose upload fails part way (the device out of memory as the buffer's
    staging buffer grows, for a larger request, unpacked or packed) gives its buffer back fit
    for use: every upload buffer can still be taken at once, and the requests after it
    (the failed buffer's among them) step exactly as decoded ones."""
    from duelq.client import encode_batch
    from duelq.server.core import cuda
    from duelq.server.framing import parse_train_request
    from duelq.server.service import decode_batch
    rng = np.random.default_rng(23)
    config = LearnerConfig(hidden_dim=64, n_actions=5)
    start = random_state(config, rng, 0)
    grow = cuda._Staging.reserve_device
    fail = []

    def reserve_device(staging, words):
        if fail and words > staging.device.size:
            fail.clear()
            raise RuntimeError("out of device memory (the test's)")
        return grow(staging, words)
    monkeypatch.setattr(cuda._Staging, "reserve_device", reserve_device)

    def same(got, want) -> None:
        assert got.td_errors.tobytes() == want.td_errors.tobytes()
        assert (got.loss, got.grad_norm) == (want.loss, want.grad_norm)

    def step(B: int, weights: bool) -> None:
        data = encode_batch(random_batch(rng, B, config, start, weights)).SerializeToString()
        pool[1:1 + len(data)] = np.frombuffer(data, np.uint8)
        with service.relay_prepare(pool.data[1:1 + len(data)], "TrainStream") as job:
            got = relayed.step(job.prepared)
        same(got, plain.step(decode_batch(parse_train_request(data))))
    with relayed_learners(config, start, 4 << 20) as (plain, relayed, service, pool):
        for _ in range(cuda.UPLOAD_BUFFERS):   # every upload buffer sized for 64 rows
            step(64, False)
        bigger = encode_batch(random_batch(rng, 512, config, start, True)).SerializeToString()
        fail.append(True)
        with pytest.raises(RuntimeError, match="the test's"):
            if packed:
                service.relay_prepare_packed(*pack_request(bigger, pool), "TrainStream")
            else:
                pool[1:1 + len(bigger)] = np.frombuffer(bigger, np.uint8)
                service.relay_prepare(pool.data[1:1 + len(bigger)], "TrainStream")
        assert not fail   # the failure came from the buffer's staging buffer
        batches = [random_batch(rng, 64, config, start, True)
                   for _ in range(cuda.UPLOAD_BUFFERS)]
        ahead = [relayed.prepare(b) for b in batches]
        assert all(p.upload is not None for p in ahead)   # the failed buffer came back
        for p, b in zip(ahead, batches):
            same(relayed.step(p), plain.step(b))
        for _ in range(2 * cuda.UPLOAD_BUFFERS):   # the failed buffer among them
            step(64, False)
        assert relayed.snapshot().checksum() == plain.snapshot().checksum()


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_a_step_waits_for_its_upload(packed):
    """The upload stream held back by a spinning kernel (≈ 0.1 s) while a request is
    prepared (unpacked: packed into its upload buffer; packed: copied from a pinned
    pool as it lies): its copy has not finished when its step is enqueued, so a step that
    did not wait for it, or an upload that recorded no event, would read stale inputs.  The
    steps stay bit-identical to a learner fed the decoded batches."""
    import cupy as cp
    from duelq.client import encode_batch
    from duelq.server.framing import parse_train_request
    from duelq.server.service import decode_batch
    spin = cp.RawKernel(r"""extern "C" __global__ void spin(long long cycles) {
        long long start = clock64(); while (clock64() - start < cycles) {} }""", "spin")
    config = LearnerConfig(hidden_dim=128, n_actions=11, step_entropy_slot=SLOT)
    rng = np.random.default_rng(5)
    start = random_state(config, rng, 0)
    plain = Learner(config, backend=cuda_backend(config, start))
    gated = Learner(config, backend=cuda_backend(config, start))
    pool = np.zeros(8 << 20, np.uint8)
    if packed:
        gated.backend.pin(pool)
    try:
        for i in range(4):   # one more than there are upload buffers
            data = encode_batch(random_batch(rng, 1024, config, start, True)
                                ).SerializeToString()
            want = plain.step(decode_batch(parse_train_request(data), keep_16bit=True))
            batch = (pack_request(data, pool[3:])[0] if packed
                     else decode_batch(parse_train_request(data), keep_16bit=True))
            with gated.backend._upload_stream:
                spin((1,), (1,), (np.int64(2 * 10**8),))
            prepared = gated.prepare_packed(batch) if packed else gated.prepare(batch)
            assert (type(prepared.batch) is PackedBatch) == packed
            assert prepared.upload is not None and not prepared.upload.buffer.copied.done
            got = gated.step(prepared)
            assert (got.loss, got.grad_norm, got.entropy) == (want.loss, want.grad_norm,
                                                              want.entropy), i
            assert got.td_errors.tobytes() == want.td_errors.tobytes(), i
        assert gated.snapshot().checksum() == plain.snapshot().checksum()
    finally:
        if packed:
            gated.backend.unpin(pool)


def test_without_a_compiler_the_backend_refuses_to_start(monkeypatch, tmp_path):
    """The step's host calls are server/core/native.c's alone: where it cannot be built the
    backend raises NativeUnavailable saying why."""
    from duelq.server.core.native import NativeUnavailable
    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv("DUELQ_CACHE_DIR", str(tmp_path))
    with pytest.raises(NativeUnavailable, match="false failed on native.c"):
        cuda_backend(LearnerConfig(hidden_dim=32, n_actions=4))


def test_learner_auto_picks_cuda():
    config = LearnerConfig()
    learner = Learner(config, backend="auto")
    assert learner.backend.name == "cuda" and learner.backend.device
    batch = random_batch(np.random.default_rng(2), 256, config, LearnerState.initial(config), True)
    result = learner.step(batch)
    _, want = reference.train_step(LearnerState.initial(config), batch, config, np.float64)
    assert result.step == 1
    assert_scalar("loss", result.loss, want.loss)
