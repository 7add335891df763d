"""The server-side replay buffer's NumPy reference (server/core/replay.py): the random
stream, the tree, sampling, importance weights, write-back, inserts and their refusals,
training through a learner, state round trips and resume.

Hand-computable cases first; then properties on random inputs."""

from __future__ import annotations

import dataclasses
import ml_dtypes
import numpy as np
import pytest

from duelq.server.core import InvalidArgument, Learner, LearnerConfig, ResourceExhausted
from duelq.server.core.backend import Upload
from duelq.server.core.errors import ReplayNotReady
from duelq.server.core.reference import train_step
from duelq.server.core.replay import (ReplayState, RunningReplay, SumTree, beta_at,
                                      butterfly_sums, importance_weights, inclusive_scan,
                                      leaf_values, philox4x32, positive_mins, tree_levels,
                                      uniforms)
from duelq.server.core.state import LearnerState
from duelq.wire.types import Transitions

H, N = 6, 3


def replay_config(**overrides) -> LearnerConfig:
    values = dict(hidden_dim=H, n_actions=N, lr=1e-2, replay_capacity=64, replay_batch_size=8,
                  replay_min_size=1, replay_alpha=0.6, replay_beta=0.4, replay_seed=7,
                  isv_size=4, isv_slots={"action_entropy_ema": 1})
    values.update(overrides)
    return LearnerConfig(**values)


def transitions(rng: np.random.Generator, n: int, *, dtype=np.float32,
                priorities: np.ndarray | None = None) -> Transitions:
    return Transitions(
        h_t=rng.standard_normal((n, H)).astype(dtype),
        h_tp1=rng.standard_normal((n, H)).astype(dtype),
        actions=rng.integers(0, N, n, dtype=np.int32),
        rewards=rng.standard_normal(n).astype(np.float32),
        dones=(rng.random(n) < 0.2).astype(np.float32),
        discounts=np.full(n, 0.97, np.float32), priorities=priorities)


def learner(**overrides) -> Learner:
    return Learner(replay_config(**overrides), backend="reference")


# ---- the random stream ----------------------------------------------------------------

# Random123's known answers for philox4x32 with 10 rounds: counter, key → output.
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8)),
    ((0xffffffff,) * 4, (0xffffffff, 0xffffffff), (0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd)),
    ((0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344), (0xa4093822, 0x299f31d0),
     (0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1)),
]


@pytest.mark.parametrize("counter, key, expected", PHILOX_KAT)
def test_philox_known_answers(counter, key, expected):
    out = philox4x32(np.array([counter], np.uint32), key)
    assert tuple(int(x) for x in out[0]) == expected


def test_uniforms_take_53_bits_of_word_pairs():
    # Draw 0 under seed 0: the counters (0, 0, 0, 0) of the first known answer.
    words = PHILOX_KAT[0][2]
    expect = [((words[0] >> 5) * 2 ** 26 + (words[1] >> 6)) / 2 ** 53,
              ((words[2] >> 5) * 2 ** 26 + (words[3] >> 6)) / 2 ** 53]
    assert list(uniforms(0, 0, 2)) == expect


def test_uniforms_per_row_do_not_depend_on_the_batch_size():
    u = uniforms(123, 45, 9)
    assert (u >= 0).all() and (u < 1).all()
    np.testing.assert_array_equal(uniforms(123, 45, 4), u[:4])
    np.testing.assert_array_equal(uniforms(123, 45, 9), u)
    assert not np.array_equal(uniforms(123, 46, 9), u)
    assert not np.array_equal(uniforms(123 + (1 << 32), 45, 9), u)   # the key's high word
    assert not np.array_equal(uniforms(123, 45 + (1 << 32), 9), u)   # the counter's high word


def test_beta_anneals_linearly_to_one():
    config = replay_config(replay_beta=0.4, replay_beta_steps=100)
    assert [beta_at(config, d) for d in (0, 50, 100, 1000)] == [0.4, 0.4 + 0.6 * 0.5, 1.0, 1.0]
    assert beta_at(replay_config(replay_beta=0.3), 10 ** 9) == 0.3


# ---- the tree -------------------------------------------------------------------------

@pytest.mark.parametrize("capacity, levels", [
    (1, [32, 1]), (32, [32, 1]), (33, [64, 32, 1]), (1024, [1024, 32, 1]),
    (1025, [1056, 64, 32, 1]), (10 ** 6, [10 ** 6, 31264, 992, 32, 1]),
])
def test_tree_levels(capacity, levels):
    assert tree_levels(capacity) == levels


def warp_butterfly(lanes: list[float]) -> list[float]:
    """What __shfl_xor_sync(…, 16, 8, 4, 2, 1) sums leave in each lane (float64)."""
    v = [np.float64(x) for x in lanes]
    for offset in (16, 8, 4, 2, 1):
        v = [v[lane] + v[lane ^ offset] for lane in range(32)]
    return v


def warp_scan(lanes: list[float]) -> list[float]:
    """What a Hillis–Steele scan with __shfl_up_sync(…, 1, 2, 4, 8, 16) leaves per lane."""
    v = [np.float64(x) for x in lanes]
    for offset in (1, 2, 4, 8, 16):
        v = [v[lane] + v[lane - offset] if lane >= offset else v[lane] for lane in range(32)]
    return v


def test_butterfly_sums_and_scans_add_in_a_warps_order():
    rng = np.random.default_rng(0)
    for values in (rng.standard_normal(32) * 10.0 ** rng.integers(-8, 8, 32),
                   np.array([1e16, 1.0, -1e16] + [0.5] * 29)):
        lanes = warp_butterfly(list(values))
        assert all(lane == lanes[0] for lane in lanes)   # every lane gets the same bits
        assert butterfly_sums(values)[0] == lanes[0]
        np.testing.assert_array_equal(inclusive_scan(values[None])[0], warp_scan(list(values)))


def test_positive_mins_ignore_empty_children():
    c = np.zeros(64, np.float32)
    c[[3, 7]] = [2.5, 0.5]
    assert list(positive_mins(c)) == [0.5, np.inf]


def small_tree(leaves) -> SumTree:
    tree = SumTree(len(leaves))
    tree.leaves[:len(leaves)] = leaves
    tree.rebuild()
    return tree


def test_descend_hand_cases():
    tree = small_tree(np.array([1, 2, 3, 4], np.float32))       # prefix 1, 3, 6, 10
    assert tree.total == 10.0 and tree.min == 1.0
    masses = [0.0, 0.999, 1.0, 2.5, 3.0, 5.999, 6.0, 9.999]
    assert list(tree.descend(np.array(masses))) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_descend_always_reaches_a_stored_row():
    leaves = np.zeros(40, np.float32)
    leaves[[0, 5, 33]] = [1.0, 2.0, 4.0]                         # two levels, gaps between
    tree = small_tree(leaves)
    assert tree.depth == 2
    masses = np.array([0.0, 0.5, 1.0, 2.99, 3.0, 6.99, 7.0, 7.5, 1e300])   # ≥ total too
    assert list(tree.descend(masses)) == [0, 0, 5, 5, 33, 33, 33, 33, 33]


def test_descend_matches_exact_prefix_sums_on_a_deep_tree():
    rng = np.random.default_rng(1)
    C = 40_000                                                   # three levels
    leaves = np.where(rng.random(C) < 0.7, rng.integers(1, 9, C), 0).astype(np.float32)
    tree = small_tree(leaves)
    assert tree.depth == 4 and tree.total == leaves.sum(dtype=np.float64)
    prefix = np.cumsum(leaves, dtype=np.float64)                 # small integers: exact
    mass = rng.random(5000) * tree.total
    expected = np.searchsorted(prefix, mass, side="right")
    np.testing.assert_array_equal(tree.descend(mass), expected)


def test_updating_gives_the_bits_of_rebuilding():
    rng = np.random.default_rng(2)
    tree = SumTree(3000)
    for _ in range(20):
        rows = rng.integers(0, 3000, 50)
        tree.leaves[rows] = (rng.random(50) * 10.0 ** rng.integers(-3, 3, 50)).astype(np.float32)
        tree.update(rows)
    fresh = small_tree(tree.leaves[:3000])
    for mine, theirs in zip(tree.sums + tree.mins, fresh.sums + fresh.mins):
        np.testing.assert_array_equal(mine, theirs)


# ---- sampling and weights ---------------------------------------------------------------

def test_weights_hand_case():
    # leaves 1, 2, 4 with β = ½: w = (1/leaf)^½
    np.testing.assert_array_equal(importance_weights(np.array([4, 1, 2], np.float32), 1.0, 0.5),
                                  np.array([0.5, 1.0, 2 ** -0.5], np.float32))
    np.testing.assert_array_equal(importance_weights(np.array([4, 1], np.float32), 1.0, 0.0),
                                  [1.0, 1.0])


def test_draw_frequencies_follow_priority_to_the_alpha():
    rng = np.random.default_rng(3)
    lrn = learner(replay_capacity=8, replay_batch_size=4096, replay_alpha=0.6)
    priorities = np.arange(1, 9, dtype=np.float32)
    lrn.insert(transitions(rng, 8, priorities=priorities))
    counts = np.zeros(8)
    for _ in range(10):
        draw = lrn.replay.draw()
        counts += np.bincount(draw.rows, minlength=8)
        lrn.replay.state.draws += 1
    p = priorities.astype(np.float64) ** 0.6
    p /= p.sum()
    n = counts.sum()
    sigma = np.sqrt(n * p * (1 - p))
    assert np.all(np.abs(counts - n * p) < 5 * sigma), (counts, n * p)


def test_draw_weights_are_relative_to_the_smallest_priority():
    rng = np.random.default_rng(4)
    lrn = learner(replay_capacity=4, replay_batch_size=64, replay_alpha=1.0, replay_beta=1.0)
    lrn.insert(transitions(rng, 4, priorities=np.array([1, 2, 4, 8], np.float32)))
    draw = lrn.replay.draw()
    expected = np.array([1, 0.5, 0.25, 0.125], np.float32)[draw.rows]
    np.testing.assert_array_equal(draw.weights, expected)       # (C·P)^-β / max = 1 / p
    assert draw.weights.max() <= 1


def test_alpha_zero_is_uniform():
    rng = np.random.default_rng(5)
    lrn = learner(replay_capacity=4, replay_batch_size=8, replay_alpha=0.0)
    lrn.insert(transitions(rng, 4, priorities=np.array([1, 10, 100, 1000], np.float32)))
    assert list(lrn.replay.tree.leaves[:4]) == [1, 1, 1, 1]
    np.testing.assert_array_equal(lrn.replay.draw().weights, np.ones(8, np.float32))


# ---- inserts and write-back -------------------------------------------------------------

def test_inserts_wrap_and_overwrite_the_oldest_rows():
    rng = np.random.default_rng(6)
    lrn = learner(replay_capacity=4)
    first, second = transitions(rng, 3), transitions(rng, 3)
    lrn.insert(first)
    result = lrn.insert(second)
    s = lrn.replay.state
    assert (result.rows, result.size, result.inserted) == (3, 4, 6)
    assert (s.cursor, s.size, s.inserted) == (2, 4, 6)
    np.testing.assert_array_equal(s.actions, [second.actions[1], second.actions[2],
                                              first.actions[2], second.actions[0]])
    np.testing.assert_array_equal(s.h_t[0], second.h_t[1])


def test_new_rows_get_the_largest_priority_so_far():
    rng = np.random.default_rng(7)
    lrn = learner(replay_alpha=1.0)
    lrn.insert(transitions(rng, 2))
    assert list(lrn.replay.state.priorities[:2]) == [1.0, 1.0]
    lrn.replay.write_back(np.array([0]), np.array([5.0], np.float32))
    lrn.insert(transitions(rng, 1))
    assert lrn.replay.state.priorities[2] == 5.0
    lrn.insert(transitions(rng, 1, priorities=np.array([9.0], np.float32)))
    lrn.insert(transitions(rng, 1))
    assert list(lrn.replay.state.priorities[:5]) == [5.0, 1.0, 5.0, 9.0, 9.0]
    np.testing.assert_array_equal(lrn.replay.tree.leaves[:5], [5, 1, 5, 9, 9])


def test_a_row_drawn_twice_takes_its_last_priority():
    rng = np.random.default_rng(8)
    lrn = learner(replay_alpha=0.5)
    lrn.insert(transitions(rng, 4))
    lrn.replay.write_back(np.array([3, 1, 3]), np.array([5.0, 6.0, 7.0], np.float32))
    s = lrn.replay.state
    assert list(s.priorities[:4]) == [1.0, 6.0, 1.0, 7.0]
    assert s.max_priority == 7.0
    np.testing.assert_array_equal(s.leaves[:4], leaf_values(np.array([1, 6, 1, 7]), 0.5))


def test_write_back_caps_priorities_at_float32_max():
    lrn = learner()
    lrn.insert(transitions(np.random.default_rng(9), 2))
    lrn.replay.write_back(np.array([0]), np.array([np.inf], np.float32))
    assert lrn.replay.state.priorities[0] == np.finfo(np.float32).max
    assert np.isfinite(lrn.replay.tree.total)


# ---- refusals ---------------------------------------------------------------------------

def bad(field: str, value, **kwargs) -> Transitions:
    t = transitions(np.random.default_rng(10), 4, **kwargs)
    return dataclasses.replace(t, **{field: value})


BAD_INSERTS = {
    "h_t wrong width": ("h_t", bad("h_t", np.zeros((4, H + 1), np.float32))),
    "h_t float64": ("h_t", bad("h_t", np.zeros((4, H)))),
    "h_t NaN": ("h_t", bad("h_t", np.full((4, H), np.nan, np.float32))),
    "h_tp1 rows": ("h_tp1", bad("h_tp1", np.zeros((3, H), np.float32))),
    "action out of range": ("actions", bad("actions", np.array([0, 1, N, 0], np.int32))),
    "actions float": ("actions", bad("actions", np.zeros(4, np.float32))),
    "rewards Inf": ("rewards", bad("rewards", np.array([0, np.inf, 0, 0], np.float32))),
    "dones 0.5": ("dones", bad("dones", np.array([0, 0.5, 0, 0], np.float32))),
    "discounts > 1": ("discounts", bad("discounts", np.array([0, 1.5, 0, 0], np.float32))),
    "priorities 0": ("priorities", bad("priorities", np.array([1, 0, 1, 1], np.float32))),
    "priorities < 0": ("priorities", bad("priorities", np.array([1, -1, 1, 1], np.float32))),
    "priorities NaN": ("priorities", bad("priorities", np.array([1, np.nan, 1, 1], np.float32))),
    "priorities shape": ("priorities", bad("priorities", np.ones(3, np.float32))),
}


@pytest.mark.parametrize("case", BAD_INSERTS)
def test_a_bad_insert_names_its_field_and_stores_nothing(case):
    field, t = BAD_INSERTS[case]
    lrn = learner()
    lrn.insert(transitions(np.random.default_rng(11), 5))
    before = lrn.replay.snapshot().checksum()
    with pytest.raises(InvalidArgument) as info:
        lrn.insert(t)
    assert info.value.field == field, info.value
    assert lrn.replay.snapshot().checksum() == before


class _Staged(Upload):
    closed = False

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("device_says", [True, False])
def test_an_inserts_values_are_checked_on_the_host_unless_the_device_passed_them(device_says):
    """A buffer whose uploads check the values on the device: the host reads no value when
    the device passes them (a bad reward goes through: the host never looked); when the
    device refuses, the host names the field, or, finding nothing, says so; either way the
    upload is given back."""
    lrn = learner()
    staged = []

    def upload(t):
        staged.append(_Staged())
        return staged[-1]
    lrn.replay.upload, lrn.replay.checked = upload, lambda u: device_says
    lrn.replay.checks_values = True
    spoiled, clean = BAD_INSERTS["rewards Inf"][1], transitions(np.random.default_rng(19), 4)
    if device_says:
        with lrn.prepare_insert(spoiled) as prepared:
            assert prepared.upload is staged[-1] and not staged[-1].closed
        return
    with pytest.raises(InvalidArgument) as info:
        lrn.prepare_insert(spoiled)
    assert info.value.field == "rewards" and staged[-1].closed
    with pytest.raises(RuntimeError, match="the device refused an insert's value"):
        lrn.prepare_insert(clean)
    assert staged[-1].closed
    with pytest.raises(InvalidArgument) as info:   # dtypes and shapes: before any upload
        lrn.prepare_insert(BAD_INSERTS["h_t float64"][1])
    assert info.value.field == "h_t" and len(staged) == 2


def test_a_run_left_running_is_finished_before_anything_but_an_insert():
    """start_replay leaves the run running (a device's is still enqueued): an insert goes
    on beside it, any other use of the learner finishes it first, and finish_replay waits
    for the device without the lock and finishes it once."""
    lrn, rng, events = learner(replay_min_size=1), np.random.default_rng(18), []
    lrn.insert(transitions(rng, 8))

    def start(steps: int) -> RunningReplay:
        run = lrn.replay.train(steps)

        def finish():
            events.append("finish")
            return run
        return RunningReplay(finish, wait=lambda: events.append(("wait", lrn.lock.locked())))
    lrn.replay.start = start
    running = lrn.start_replay(2)
    lrn.insert(transitions(rng, 3))
    assert events == []
    lrn.snapshot()
    assert events == ["finish"]
    run = lrn.finish_replay(running)
    assert events == ["finish", ("wait", False)] and run.steps == 2
    running = lrn.start_replay(1)
    assert lrn.step_count == 3 and events[-1] == "finish"   # the count once it has run
    assert lrn.finish_replay(running).steps == 1 and events[-1] == ("wait", False)


def test_a_run_whose_finish_fails_raises_at_every_finish():
    """A finish that fails (the device lost, say) is not retried, and never passes for a
    run that did nothing: every later finish raises the same error."""
    calls = []

    def finish():
        calls.append(1)
        raise RuntimeError("device lost")
    running = RunningReplay(finish)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="device lost"):
            running.finish()
    assert calls == [1]


def test_an_inserts_checks_run_without_the_learners_lock():
    """prepare_insert checks the rows beside steps, without the lock; inserting what it
    prepared stores what an insert of the rows themselves does."""
    class Forbidden:
        def __enter__(self):
            raise AssertionError("prepare_insert took the learner's lock")

        def __exit__(self, *exc):
            pass
    lrn, twin = learner(), learner()
    t = transitions(np.random.default_rng(16), 5, priorities=np.arange(1, 6, dtype=np.float32))
    lock, lrn.lock = lrn.lock, Forbidden()
    with pytest.raises(InvalidArgument) as info:
        lrn.prepare_insert(BAD_INSERTS["rewards Inf"][1])
    assert info.value.field == "rewards"
    prepared = lrn.prepare_insert(t)
    lrn.lock = lock
    assert lrn.insert(prepared) == twin.insert(t)
    assert lrn.replay.snapshot().checksum() == twin.replay.snapshot().checksum()


@pytest.mark.parametrize("dtype, field, value", [
    ("float16", "h_t", np.zeros((4, H), np.float32)),
    ("float16", "h_tp1", np.zeros((4, H), ml_dtypes.bfloat16)),
    ("bfloat16", "h_t", np.zeros((4, H), np.float16)),
])
def test_a_16_bit_buffer_takes_its_own_dtype_only(dtype, field, value):
    lrn = learner(replay_dtype=dtype)
    good = transitions(np.random.default_rng(12), 4, dtype=lrn.replay.state.h_t.dtype)
    lrn.insert(good)
    with pytest.raises(InvalidArgument, match=f"^{field}: dtype must be {dtype}"):
        lrn.insert(dataclasses.replace(good, **{field: value}))
    assert lrn.replay.size == 4


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_a_float32_buffer_stores_16_bit_rows_widened(dtype):
    """16-bit rows bound for a float32 buffer stay 16-bit through the checks (the buffer
    widens them as it stores them) and are stored as their exact float32 values."""
    lrn = learner()
    t = transitions(np.random.default_rng(17), 6, dtype=dtype)
    t.h_t[0, :3] = np.array([2.0 ** -24, -0.0, -(2.0 ** -14)], np.float32).astype(dtype)
    prepared = lrn.prepare_insert(t)
    assert prepared.rows.h_t.dtype == dtype and prepared.rows.h_tp1.dtype == dtype
    lrn.insert(prepared)
    state = lrn.replay.state
    assert state.h_t.dtype == np.float32
    np.testing.assert_array_equal(state.h_t[:6].view(np.uint32),
                                  t.h_t.astype(np.float32).view(np.uint32))
    np.testing.assert_array_equal(state.h_tp1[:6], t.h_tp1.astype(np.float32))


def test_an_insert_larger_than_the_buffer_is_refused():
    lrn = learner(replay_capacity=4)
    with pytest.raises(ResourceExhausted, match="actions"):
        lrn.insert(transitions(np.random.default_rng(13), 5))
    assert lrn.replay.size == 0


def test_training_waits_for_the_minimum_size_and_the_buffer_must_be_on():
    lrn = learner(replay_min_size=10)
    lrn.insert(transitions(np.random.default_rng(14), 9))
    with pytest.raises(ReplayNotReady, match="holds 9 rows"):
        lrn.train_replay(1)
    assert lrn.step_count == 0
    off = Learner(replay_config(replay_capacity=0), backend="reference")
    with pytest.raises(ReplayNotReady, match="off"):
        off.insert(transitions(np.random.default_rng(14), 1))
    with pytest.raises(InvalidArgument, match="steps"):
        lrn.train_replay(0)


@pytest.mark.parametrize("overrides, field", [
    (dict(replay_capacity=-1), "replay_capacity"),
    (dict(replay_dtype="float64"), "replay_dtype"),
    (dict(replay_alpha=1.5), "replay_alpha"),
    (dict(replay_beta=-0.1), "replay_beta"),
    (dict(replay_batch_size=0), "replay_batch_size"),
    (dict(replay_min_size=65), "replay_min_size"),
    (dict(replay_ratio=-1.0), "replay_ratio"),
    (dict(replay_seed=1 << 64), "replay_seed"),
    (dict(priority_eps=0.0), "priority_eps"),
])
def test_replay_settings_are_checked(overrides, field):
    with pytest.raises(InvalidArgument) as info:
        replay_config(**overrides)
    assert info.value.field == field


# ---- training -------------------------------------------------------------------------

def test_one_replay_step_is_the_batch_step_of_the_drawn_rows():
    """Capacity 1, B = 2: both draws take row 0 with weight 1; the step is the reference
    step of that batch, and the row's priority becomes its |δ| + ε."""
    rng = np.random.default_rng(15)
    lrn = learner(replay_capacity=1, replay_batch_size=2, replay_min_size=1)
    t = transitions(rng, 1)
    lrn.insert(t)
    before = lrn.snapshot()
    run = lrn.train_replay(1)
    assert (run.steps, run.refused) == (1, False)
    batch = lrn.replay.state.batch(np.array([0, 0]), np.ones(2, np.float32))
    expected, out = train_step(before, batch, lrn.config)
    assert lrn.snapshot().checksum() == expected.checksum()
    assert lrn.replay.state.priorities[0] == out.priorities[1]
    assert run.losses[0] == out.loss
    info = lrn.replay_info()
    assert (info.sampled, info.draws, info.inserted, info.ratio) == (2, 1, 1, 2.0)


def test_a_non_finite_step_is_refused_and_consumes_its_draw():
    lrn = learner(replay_capacity=2, replay_batch_size=2, optimizer="sgd", lr=1.0)
    huge = dataclasses.replace(transitions(np.random.default_rng(16), 2),
                               rewards=np.full(2, 3e38, np.float32))
    lrn.insert(huge)
    state, replay = lrn.snapshot().checksum(), lrn.replay.snapshot()
    run = lrn.train_replay(5)
    assert (run.steps, run.refused, len(run.losses)) == (0, True, 0)
    assert lrn.snapshot().checksum() == state
    np.testing.assert_array_equal(lrn.replay.state.priorities, replay.priorities)
    assert (lrn.replay.state.draws, lrn.replay.state.sampled) == (1, 0)


def run_steps(lrn: Learner, rng: np.random.Generator, rounds: int) -> None:
    for _ in range(rounds):
        lrn.insert(transitions(rng, int(rng.integers(1, 12))))
        lrn.train_replay(int(rng.integers(1, 4)))


def test_same_seed_and_inserts_give_bit_identical_runs():
    a, b, c = learner(), learner(), learner(replay_seed=8)
    for lrn in (a, b, c):
        run_steps(lrn, np.random.default_rng(17), 12)
    assert a.snapshot().checksum() == b.snapshot().checksum()
    assert a.replay.snapshot().checksum() == b.replay.snapshot().checksum()
    assert a.snapshot().checksum() != c.snapshot().checksum()


def test_the_tree_stays_the_rebuild_of_its_leaves():
    lrn = learner(replay_capacity=50)
    run_steps(lrn, np.random.default_rng(18), 15)
    fresh = small_tree(lrn.replay.tree.leaves[:50])
    for mine, theirs in zip(lrn.replay.tree.sums + lrn.replay.tree.mins,
                            fresh.sums + fresh.mins):
        np.testing.assert_array_equal(mine, theirs)
    np.testing.assert_array_equal(lrn.replay.tree.leaves[:50], lrn.replay.state.leaves)


def test_a_16_bit_buffer_trains_as_its_widened_rows_would():
    rng16, rng32 = np.random.default_rng(19), np.random.default_rng(19)
    half, full = learner(replay_dtype="float16"), learner()
    for _ in range(5):
        t = transitions(rng16, 7, dtype=np.float16)
        transitions(rng32, 7)   # keep the two streams level
        half.insert(t)
        full.insert(dataclasses.replace(t, h_t=t.h_t.astype(np.float32),
                                        h_tp1=t.h_tp1.astype(np.float32)))
        half.train_replay(2)
        full.train_replay(2)
    assert half.replay.state.h_t.dtype == np.float16
    assert half.snapshot().checksum() == full.snapshot().checksum()


def test_ratio_due_steps():
    lrn = learner(replay_ratio=2.0, replay_batch_size=4, replay_min_size=5)
    lrn.insert(transitions(np.random.default_rng(20), 4))
    assert lrn.replay_due() == 0                      # below the minimum size
    lrn.insert(transitions(np.random.default_rng(21), 6))
    assert lrn.replay_due() == 5                      # (2·10 − 0) // 4
    lrn.train_replay(3)
    assert lrn.replay_due() == 2                      # (20 − 12) // 4
    assert learner().replay_due() == 0                # ratio 0: on request only


# ---- state round trips and resume -------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_state_round_trips_through_bytes(dtype):
    lrn = learner(replay_dtype=dtype)
    rng = np.random.default_rng(22)
    for _ in range(4):
        lrn.insert(transitions(rng, 9, dtype=lrn.replay.state.h_t.dtype))
        lrn.train_replay(2)
    state = lrn.replay.snapshot()
    again = ReplayState.from_bytes(state.to_bytes(), lrn.config)
    assert again.checksum() == state.checksum()
    assert again.h_t.dtype == state.h_t.dtype


def test_state_from_bytes_refuses_what_does_not_fit():
    lrn = learner()
    lrn.insert(transitions(np.random.default_rng(23), 5))
    data = lrn.replay.snapshot().to_bytes()
    with pytest.raises(ValueError, match="replay_capacity=32"):
        ReplayState.from_bytes(data, replay_config(replay_capacity=32))
    with pytest.raises(ValueError, match="h_t"):
        ReplayState.from_bytes(data, replay_config(replay_dtype="float16"))
    with pytest.raises(ValueError, match="readable"):
        ReplayState.from_bytes(data[:100], lrn.config)
    broken = lrn.replay.snapshot()
    broken.priorities[2] = 0.0
    with pytest.raises(ValueError, match="priorities"):
        ReplayState.from_bytes(broken.to_bytes(), lrn.config)
    broken = lrn.replay.snapshot()
    broken.cursor = 9
    with pytest.raises(ValueError, match="cursor"):
        ReplayState.from_bytes(broken.to_bytes(), lrn.config)
    broken = lrn.replay.snapshot()
    broken.actions[1] = N
    with pytest.raises(ValueError, match="actions"):
        ReplayState.from_bytes(broken.to_bytes(), lrn.config)
    broken = lrn.replay.snapshot()
    broken.leaves[0] = np.inf
    with pytest.raises(ValueError, match="leaves"):
        ReplayState.from_bytes(broken.to_bytes(), lrn.config)
    for bad in (1e39, float("inf"), float("nan"), 0.0):   # 1e39: past float32's range
        broken = lrn.replay.snapshot()
        broken.max_priority = bad
        assert "max_priority" in broken.problem(lrn.config)


def test_a_resumed_buffer_continues_bit_identically():
    rng = np.random.default_rng(24)
    a = learner()
    run_steps(a, rng, 6)
    state, replay = a.snapshot(), ReplayState.from_bytes(a.replay.snapshot().to_bytes(), a.config)
    later = transitions(rng, 10)
    a.insert(later)
    a.train_replay(7)

    b = Learner(a.config, backend="reference", state=LearnerState.initial(a.config))
    b.load(state)
    b.load_replay(replay)
    b.insert(later)
    b.train_replay(7)
    assert b.snapshot().checksum() == a.snapshot().checksum()
    assert b.replay.snapshot().checksum() == a.replay.snapshot().checksum()


def test_loading_a_state_that_does_not_fit_is_refused():
    lrn = learner()
    other = ReplayState.empty(replay_config(replay_capacity=8))
    with pytest.raises(InvalidArgument, match="replay"):
        lrn.load_replay(other)
