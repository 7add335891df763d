"""The actor-side n-step prioritised replay, and a learned Q whose greedy action is optimal
in every reachable state of a real gymnasium task (Q* by value iteration, and by hand)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from duelq.client.replay import NStepReplay, NStepReturns
from duelq.server.core import Learner, LearnerConfig
from duelq.server.core.reference import q_values


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


def test_n_step_returns_emit_the_rows_a_step_completes():
    """NStepReturns alone (the server feed's): None until a row is complete, then the
    completed rows as one Transitions, in the server's convention."""
    r = NStepReturns(n_step=2, gamma=0.5)
    assert r.add(h(0), 3, 1.0, h(1), False) is None
    rows = r.add(h(1), 2, 2.0, h(2), False)             # s0 → s2: 1 + 0.5·2, γ²
    assert (rows.size, rows.rewards.tolist(), rows.discounts.tolist()) == (1, [2.0], [0.25])
    assert rows.priorities is None and rows.actions.dtype == np.int32
    rows = r.add(h(2), 1, 4.0, h(3), terminated=True)    # s1 → s3 (2 + 2), s2 → s3 (4)
    assert rows.rewards.tolist() == [4.0, 4.0] and rows.discounts.tolist() == [0.25, 0.5]
    assert rows.dones.tolist() == [1.0, 1.0] and rows.actions.tolist() == [2, 1]
    np.testing.assert_array_equal(rows.h_t, [h(1), h(2)])
    np.testing.assert_array_equal(rows.h_tp1, [h(3), h(3)])


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


#: Deterministic 4×4 FrozenLake: S start, F frozen, H hole, G goal (reward 1, terminal).
LAKE = ["SFFF",
        "FHFH",
        "FFFH",
        "HFFG"]
MOVES = [(0, -1), (1, 0), (0, 1), (-1, 0)]   # LEFT, DOWN, RIGHT, UP as (row, column)


def lake_q_star(gamma: float) -> np.ndarray:
    """Q* [16, 4] by hand: with d(s) the fewest moves from s to the goal (holes barred),
    V*(s) = γ^(d(s) − 1); Q*(s, a) = 1 into the goal, 0 into a hole, γ V*(s') elsewhere;
    a move off the grid stays put."""
    tile = "".join(LAKE)

    def move(s: int, a: int) -> int:
        r, c = divmod(s, 4)
        return min(max(r + MOVES[a][0], 0), 3) * 4 + min(max(c + MOVES[a][1], 0), 3)
    distance, layer = {15: 0}, {15}
    while layer:
        layer = {s for s in range(16) if s not in distance and tile[s] != "H"
                 and any(move(s, a) in layer for a in range(4))}
        distance.update({s: 1 + min(distance.get(move(s, a), 99) for a in range(4))
                         for s in layer})
    q = np.zeros((16, 4))
    for s in range(16):
        for a in range(4):
            s2 = move(s, a)
            if tile[s] not in "HG" and tile[s2] != "H":
                q[s, a] = gamma ** distance[s2]   # γ · γ^(d(s') − 1); 1 into the goal
    return q


def test_value_iteration_finds_the_hand_computed_q_star():
    pytest.importorskip("gymnasium")
    from duelq.apps.gym_actor import optimal_q, reachable_states
    np.testing.assert_allclose(optimal_q("FrozenLake-v1", 0.9), lake_q_star(0.9), atol=1e-9)
    assert reachable_states("FrozenLake-v1") == [0, 1, 2, 3, 4, 6, 8, 9, 10, 13, 14]


def test_greedy_action_is_optimal_in_every_reachable_frozen_lake_state():
    """One actor (deterministic: the same seed, the same steps) against an in-process
    learner with the demo's settings."""
    pytest.importorskip("gymnasium")
    from duelq.apps.gym_actor import (TASKS, ActorConfig, ActorReplay, check_policy, env_dims,
                                      greedy_return, run_actor)
    from duelq.apps.gym_demo import env_config
    env_id = "FrozenLake-v1"
    learner = Learner(env_config(env_id, LearnerConfig(), LearnerConfig()), backend="reference")
    cfg = ActorConfig.of(env_id)
    before = check_policy(env_id, learner.weights()[0], cfg.gamma)
    report = run_actor(cfg, ActorReplay(cfg, lambda b: learner.step(b).priorities),
                       pull=lambda: learner.weights()[0])
    assert report.batches == learner.step_count == cfg.env_steps - cfg.warmup
    assert env_dims(env_id) == (16, 4)
    assert not before.all_optimal
    after = check_policy(env_id, learner.weights()[0], cfg.gamma)
    print(f"greedy optimal in {after.optimal}/{after.states} states, "
          f"max |Q - Q*| = {after.q_error:.4f}")
    assert (after.optimal, after.states) == (11, 11)
    q = learner.weights()[0]
    learned = q_values(q, np.eye(16, dtype=np.float32)).astype(np.float64)
    states = [0, 1, 2, 3, 4, 6, 8, 9, 10, 13, 14]
    assert after.q_error == pytest.approx(np.abs(learned - lake_q_star(cfg.gamma))[states].max())
    assert after.q_error < 0.1
    assert greedy_return(env_id, q) == TASKS[env_id].optimal_return


def test_an_actor_feeding_the_server_replay_is_reproducible():
    """ServerReplay: each env step's transition inserted once, one TrainReplay step per step
    after the warm-up; two runs of the same seed give bit-identical weights."""
    pytest.importorskip("gymnasium")
    from duelq.apps.gym_actor import ActorConfig, ServerReplay, run_actor
    from duelq.apps.gym_demo import env_config
    env_id = "FrozenLake-v1"
    cfg = ActorConfig.of(env_id, env_steps=400)

    def run() -> tuple[Learner, int]:
        config = env_config(env_id, LearnerConfig(), LearnerConfig(), "replay")
        learner = Learner(config, backend="reference")
        feed = ServerReplay(cfg, lambda rows: learner.insert(rows).size,
                            lambda: learner.train_replay(1), config.replay_min_size)
        report = run_actor(cfg, feed, pull=lambda: learner.weights()[0])
        return learner, report.batches
    (first, batches), (second, _) = run(), run()
    assert (first.config.replay_capacity, first.config.replay_batch_size,
            first.config.replay_min_size) == (cfg.capacity, cfg.batch_size, cfg.batch_size)
    info = first.replay_info()
    assert batches == first.step_count == cfg.env_steps - cfg.warmup == 200
    assert info.inserted == cfg.env_steps                 # one-step returns: a row a step
    assert info.sampled == batches * cfg.batch_size
    for a, b in zip(first.weights()[0].arrays(), second.weights()[0].arrays()):
        np.testing.assert_array_equal(a, b)
    assert first.replay_snapshot().checksum() == second.replay_snapshot().checksum()


def test_greedy_action_is_optimal_in_every_reachable_cliff_walking_state():
    """The second task: 37 reachable states, rewards of −1 a move and −100 off the cliff
    (back to the start), an optimal return of −13."""
    pytest.importorskip("gymnasium")
    from duelq.apps.gym_actor import (TASKS, ActorConfig, ActorReplay, check_policy,
                                      greedy_return, run_actor)
    from duelq.apps.gym_demo import env_config
    env_id = "CliffWalking-v1"
    learner = Learner(env_config(env_id, LearnerConfig(), LearnerConfig()), backend="reference")
    cfg = ActorConfig.of(env_id)
    run_actor(cfg, ActorReplay(cfg, lambda b: learner.step(b).priorities),
              pull=lambda: learner.weights()[0])
    check = check_policy(env_id, learner.weights()[0], cfg.gamma)
    print(f"greedy optimal in {check.optimal}/{check.states} states, "
          f"max |Q - Q*| = {check.q_error:.4f}")
    assert (check.optimal, check.states) == (37, 37)
    assert check.q_error < 1.0   # Q* spans −1 … −106
    assert greedy_return(env_id, learner.weights()[0]) == TASKS[env_id].optimal_return


def test_env_demo_learns_q_star_through_the_server(tmp_path, capsys):
    pytest.importorskip("gymnasium")
    from duelq.apps.cli import main
    plot = tmp_path / "frozen.png"
    code = main(["demo", "--env", "FrozenLake-v1", "--actors", "1", "--backend", "reference",
                 "--plot", str(plot)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "2800 learner steps" in out   # 3000 env steps − 200 warm-up, one batch each
    assert "greedy action optimal in 11/11 reachable states" in out
    error = float(re.search(r"max \|Q − Q\*\| = ([\d.]+)", out).group(1))
    assert error < 0.1
    assert "greedy policy return 1 (optimum 1): reaches the optimum" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_env_demo_learns_q_star_through_the_server_replay(tmp_path, capsys):
    """``--feed replay``: the same figures as the batches, the steps drawn on the server."""
    pytest.importorskip("gymnasium")
    from duelq.apps.cli import main
    code = main(["demo", "--env", "FrozenLake-v1", "--actors", "1", "--backend", "reference",
                 "--feed", "replay", "--plot", str(tmp_path / "frozen.png")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "feed: replay" in out
    assert "2800 learner steps (drawn from the server's replay buffer)" in out
    assert "greedy action optimal in 11/11 reachable states" in out
    error = float(re.search(r"max \|Q − Q\*\| = ([\d.]+)", out).group(1))
    assert error < 0.1
    assert "greedy policy return 1 (optimum 1): reaches the optimum" in out


def test_env_demo_feed_replay_refusals(make_server, capsys, monkeypatch):
    pytest.importorskip("gymnasium")
    from duelq.apps.cli import EXIT_USAGE, main
    from duelq.apps.gym_demo import env_config
    assert main(["demo", "--feed", "replay"]) == EXIT_USAGE
    assert "--feed replay: needs --env" in capsys.readouterr().err
    monkeypatch.setenv("DUELQ_FEED", "sideways")
    assert main(["demo", "--env", "FrozenLake-v1"]) == EXIT_USAGE
    assert "DUELQ_FEED='sideways'" in capsys.readouterr().err
    monkeypatch.setenv("DUELQ_FEED", "replay")
    plain = make_server(env_config("FrozenLake-v1", LearnerConfig(), LearnerConfig()))
    assert main(["demo", "--env", "FrozenLake-v1", "--target", plain.target]) == 1
    assert "--feed replay needs a server with its replay buffer on" in capsys.readouterr().out


def test_env_demo_refuses_a_server_of_the_wrong_size(server, capsys):
    pytest.importorskip("gymnasium")
    from duelq.apps.cli import main
    assert main(["demo", "--env", "FrozenLake-v1", "--target", server.target]) == 1
    assert "FrozenLake-v1 needs H, N = (16, 4)" in capsys.readouterr().out
