"""The actor-side n-step prioritised replay, and a greedy policy that reaches the
known optimum of a real gymnasium task."""

from __future__ import annotations

import numpy as np
import pytest

from duelq.client.replay import NStepReplay
from duelq.server.core import Learner, LearnerConfig


def h(i: int) -> np.ndarray:
    return np.full(2, float(i), np.float32)


def test_n_step_returns_discounts_and_done_on_termination():
    r = NStepReplay(16, 2, n_step=3, gamma=0.5)
    r.add(h(0), 0, 1.0, h(1), False)
    r.add(h(1), 1, 2.0, h(2), False)
    assert len(r) == 0                        # no transition has n steps yet
    r.add(h(2), 2, 4.0, h(3), False)
    assert len(r) == 1                        # s0 → s3: 1 + 0.5·2 + 0.25·4 = 3, γ³
    assert (r.rewards[0], r.discounts[0], r.dones[0]) == (3.0, 0.125, 0.0)
    np.testing.assert_array_equal(r.h_tp1[0], h(3))
    r.add(h(3), 0, 8.0, h(4), terminated=True)
    # s1 → s4 (2 + 2 + 2 = 6, γ³), s2 → s4 (4 + 4, γ²), s3 → s4 (8, γ¹), all done
    assert len(r) == 4
    np.testing.assert_allclose(r.rewards[1:4], [6.0, 8.0, 8.0])
    np.testing.assert_allclose(r.discounts[1:4], [0.125, 0.25, 0.5])
    np.testing.assert_array_equal(r.dones[1:4], [1.0, 1.0, 1.0])
    np.testing.assert_array_equal(r.actions[:4], [0, 1, 2, 0])


def test_truncation_flushes_but_keeps_bootstrapping():
    r = NStepReplay(16, 2, n_step=3, gamma=0.9)
    r.add(h(0), 0, 1.0, h(1), False)
    r.add(h(1), 1, 1.0, h(2), terminated=False, truncated=True)
    assert len(r) == 2
    np.testing.assert_array_equal(r.dones[:2], [0.0, 0.0])
    np.testing.assert_allclose(r.discounts[:2], [0.81, 0.9])
    np.testing.assert_allclose(r.rewards[:2], [1.9, 1.0])


def test_prioritised_sampling_weights_and_updates():
    r = NStepReplay(4, 2, n_step=1, gamma=1.0, alpha=1.0, beta=1.0)
    for i in range(6):                         # wraps: keeps the last 4
        r.add(h(i), i % 2, float(i), h(i + 1), False)
    assert len(r) == 4
    np.testing.assert_allclose(sorted(r.rewards), [2.0, 3.0, 4.0, 5.0])
    assert (r.priorities[:4] == 1.0).all()     # new transitions get the max priority
    r.update_priorities(np.arange(4), np.array([1.0, 1.0, 1.0, 97.0]))
    batch, idx = r.sample(4000, np.random.default_rng(0))
    assert abs((idx == 3).mean() - 0.97) < 0.02
    # w = (M·P)^-β / max: the rare ones weigh 1, the frequent one 1/97
    np.testing.assert_allclose(batch.weights[idx == 3], 1 / 97, rtol=1e-5)
    np.testing.assert_allclose(batch.weights[idx != 3], 1.0)
    r.add(h(9), 0, 0.0, h(10), False)
    assert r.priorities[r._next - 1] == 97.0   # new ones get the current max


def test_replay_checks_its_arguments():
    with pytest.raises(ValueError):
        NStepReplay(0, 2)
    with pytest.raises(ValueError):
        NStepReplay(4, 2, gamma=1.5)
    with pytest.raises(ValueError, match="empty"):
        NStepReplay(4, 2).sample(1, np.random.default_rng(0))


def test_greedy_policy_reaches_the_optimum_on_frozen_lake():
    pytest.importorskip("gymnasium")
    from duelq.apps.gym_actor import (OPTIMAL_RETURN, ActorConfig, env_dims, greedy_return,
                                        run_actor)
    env_id = "FrozenLake-v1"
    H, N = env_dims(env_id)
    learner = Learner(LearnerConfig(hidden_dim=H, n_actions=N, optimizer="sgd", lr=1.0,
                                    tau=0.05), backend="reference")
    before = greedy_return(env_id, learner.weights()[0])
    report = run_actor(ActorConfig(env_id=env_id, env_steps=2000),
                       train=lambda b: learner.step(b).priorities,
                       pull=lambda: learner.weights()[0])
    assert report.batches == learner.step_count == 1800
    assert before < OPTIMAL_RETURN[env_id]
    assert greedy_return(env_id, learner.weights()[0]) == OPTIMAL_RETURN[env_id]


def test_env_demo_learns_through_the_server(tmp_path, capsys):
    pytest.importorskip("gymnasium")
    from duelq.apps.cli import main
    plot = tmp_path / "frozen.png"
    code = main(["demo", "--env", "FrozenLake-v1", "--actors", "2", "--env-steps", "1500",
                 "--backend", "reference", "--plot", str(plot)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "greedy policy return 1 (optimum 1): reaches the optimum" in out
    assert "2600 learner steps" in out  # 2 actors × (1500 − 200 warm-up) batches
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_env_demo_refuses_a_server_of_the_wrong_size(server, capsys):
    pytest.importorskip("gymnasium")
    from duelq.apps.cli import main
    assert main(["demo", "--env", "FrozenLake-v1", "--target", server.target]) == 1
    assert "FrozenLake-v1 needs H, N = (16, 4)" in capsys.readouterr().out
