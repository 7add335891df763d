"""GPU tests of the replay buffer on the device (kernels/replay.cu, server/core/cuda_replay.py)
against its NumPy reference (server/core/replay.py), step by step.

At every step the reference is loaded with the device's exact state first, so nothing
drifts: the device must draw the reference's rows with the reference's weights (bit for
bit), its step must be the batch path's learner_step on those rows (bit for bit: the same
kernel on the same bytes), and its write-back of that step's priorities must leave the
reference's buffer and tree (bit for bit).  The one operation that may round differently
is a float64 ``pow`` (leaves p^α, weights); float32 hides its last bit but for about one
value in 10^8, and these tests' fixed inputs do not meet one.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from duelq.server.core.batch import PackedBatch, packed_layout
from duelq.server.core.config import LearnerConfig
from duelq.server.core.errors import InvalidArgument, ReplayTooLarge
from duelq.server.core.learner import Learner, cuda_usable
from duelq.server.core.replay import ReplayState, STORAGE_DTYPES, uniforms, validate_transitions
from duelq.server.core.state import LearnerState
from duelq.wire.types import Batch, Transitions

USABLE, WHY = cuda_usable()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not USABLE, reason=f"no usable GPU: {WHY}")]


@dataclasses.dataclass(frozen=True)
class Case:
    capacity: int
    B: int
    H: int
    N: int
    dtype: str
    alpha: float
    beta: float = 0.4
    beta_steps: int = 0
    optimizer: str = "adam"
    double_dqn: bool = False

    def config(self, **overrides) -> LearnerConfig:
        values = dict(hidden_dim=self.H, n_actions=self.N, optimizer=self.optimizer,
                      lr=1e-3, double_dqn=self.double_dqn, max_grad_norm=5.0,
                      step_entropy_slot="action_entropy_ema", replay_capacity=self.capacity,
                      replay_dtype=self.dtype, replay_alpha=self.alpha,
                      replay_beta=self.beta, replay_beta_steps=self.beta_steps,
                      replay_batch_size=self.B, replay_min_size=1, replay_seed=12345)
        values.update(overrides)
        return LearnerConfig(**values)

    def __str__(self):
        return f"C{self.capacity}-B{self.B}-H{self.H}-N{self.N}-{self.dtype}-a{self.alpha}"


CASES = [
    Case(1, 1, 64, 2, "float32", 0.6),
    Case(5, 7, 127, 5, "bfloat16", 1.0, optimizer="sgd"),
    Case(33, 256, 128, 11, "float32", 0.6, beta_steps=4),
    Case(3000, 31, 100, 7, "float16", 0.0, double_dqn=True),
    Case(40_000, 1024, 128, 11, "bfloat16", 0.5, beta=0.0),
    Case(40_000, 4096, 128, 11, "float32", 0.7, beta=1.0),
]


def transitions(rng: np.random.Generator, n: int, case: Case, *, priorities: bool = False,
                reward_scale: float = 1.0) -> Transitions:
    dtype = STORAGE_DTYPES[case.dtype]
    return Transitions(
        h_t=rng.standard_normal((n, case.H)).astype(np.float32).astype(dtype),
        h_tp1=rng.standard_normal((n, case.H)).astype(np.float32).astype(dtype),
        actions=rng.integers(0, case.N, n, dtype=np.int32),
        rewards=(reward_scale * rng.standard_normal(n)).astype(np.float32),
        dones=(rng.random(n) < 0.2).astype(np.float32),
        discounts=rng.uniform(0.5, 1.0, n).astype(np.float32),
        priorities=rng.uniform(0.01, 5.0, n).astype(np.float32) if priorities else None)


def fill(learners: list[Learner], rng: np.random.Generator, case: Case, rows: int) -> None:
    """The same inserts into each learner: ``rows`` rows in pieces, a third with priorities,
    the last pieces wrapping around a full buffer."""
    left, i = rows, 0
    while left > 0:
        n = int(min(left, rng.integers(1, max(2, case.capacity // 3) + 1), case.capacity,
                    4096))
        t = transitions(rng, n, case, priorities=i % 3 == 1)
        for learner in learners:
            learner.insert(t)
        left, i = left - n, i + 1


def tree_arrays(learner: Learner) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(leaves, sums, mins) of a learner's tree, the device's or the reference's."""
    replay = learner.replay
    if learner.backend.name == "cuda":
        return replay._leaves.get(), replay._sums.get(), replay._mins.get()
    tree = replay.tree
    return tree.leaves, np.concatenate(tree.sums), np.concatenate(tree.mins)


def assert_same_buffer(cuda: Learner, ref: Learner) -> None:
    got, want = cuda.replay_snapshot(), ref.replay_snapshot()
    for name in ReplayState.ARRAYS:
        np.testing.assert_array_equal(np.asarray(getattr(got, name)).view(np.uint8),
                                      np.asarray(getattr(want, name)).view(np.uint8),
                                      err_msg=name)
    for name in ReplayState.COUNTERS + ("max_priority",):
        assert getattr(got, name) == getattr(want, name), name
    for name, g, w in zip(("leaves", "sums", "mins"), tree_arrays(cuda), tree_arrays(ref)):
        np.testing.assert_array_equal(g, w, err_msg=name)


def packed(batch: Batch) -> bytes:
    """learner_step's packed input bytes of ``batch`` (server/core/batch.py packed_layout)."""
    return b"".join(np.ascontiguousarray(a).tobytes() for a in (
        batch.h_t, batch.h_tp1, batch.actions.astype(np.int32), batch.rewards, batch.dones,
        batch.discounts, batch.weights))


def learners(case: Case, **overrides) -> tuple[Learner, Learner]:
    config = case.config(**overrides)
    state = LearnerState.initial(config)
    return (Learner(config, backend="cuda", state=state),
            Learner(config, backend="reference", state=state))


# ---- inserts and draws -------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=str)
def test_inserts_build_the_reference_buffer_bit_for_bit(case):
    cuda, ref = learners(case)
    assert type(cuda.replay).__name__ == "CudaReplay"
    assert_same_buffer(cuda, ref)                 # empty
    rng = np.random.default_rng(1)
    for _ in range(4):
        fill([cuda, ref], rng, case, max(1, case.capacity // 2))
        assert_same_buffer(cuda, ref)


@pytest.mark.parametrize("case, wire", [
    (CASES[4], "bfloat16"), (CASES[2], "float16"), (CASES[5], "bfloat16")], ids=str)
def test_inserts_without_a_free_upload_buffer_store_the_same_bits(case, wire):
    """An insert's rows come in one of the backend's upload buffers, or, with none free,
    through the step's own input buffer: both store the reference's bits (16-bit rows into
    a float32 buffer too), and every buffer comes back, also from a prepared insert dropped
    unused."""
    from duelq.server.core.cuda import UPLOAD_BUFFERS
    cuda, ref = learners(case)
    busy = learners(case)[0]
    held = [busy.backend._free_uploads.get_nowait() for _ in range(UPLOAD_BUFFERS)]
    rng, dtype = np.random.default_rng(21), STORAGE_DTYPES[wire]
    for i in range(3):
        t = transitions(rng, max(1, case.capacity // 12), case, priorities=i != 1)
        t = dataclasses.replace(t, h_t=t.h_t.astype(np.float32).astype(dtype),
                                h_tp1=t.h_tp1.astype(np.float32).astype(dtype))
        for learner in (cuda, busy, ref):
            learner.insert(t)
    assert_same_buffer(cuda, ref)
    assert_same_buffer(busy, ref)
    assert busy.prepare_insert(transitions(rng, 9, case)).upload is None
    unused = cuda.prepare_insert(transitions(rng, 9, case))
    assert unused.upload is not None
    unused.__exit__()
    assert cuda.backend._free_uploads.qsize() == UPLOAD_BUFFERS
    for buf in held:
        busy.backend._free_uploads.put(buf)


def _packed(t: Transitions) -> PackedBatch:
    """``t`` as a front process packs an insert (priorities in the weights' place)."""
    n, H = t.h_t.shape
    pool = np.zeros(4 * packed_layout(n, H, t.h_t.dtype.itemsize, True)[1], np.uint8)
    raw = packed(Batch(t.h_t, t.h_tp1, t.actions, t.rewards, t.dones, t.discounts,
                       t.priorities))
    pool[:len(raw)] = np.frombuffer(raw, np.uint8)
    return PackedBatch(n, H, t.h_t.dtype, True, len(pool) // 4, memoryview(pool),
                       pool.ctypes.data)


@pytest.mark.parametrize("case, wire", [
    (CASES[1], "bfloat16"), (CASES[4], "bfloat16"), (CASES[2], "float32"),  # as they came
    (CASES[0], "float16"), (CASES[2], "float16"), (CASES[2], "bfloat16"),
    (Case(5, 7, 127, 5, "float32", 1.0), "float16"),          # widened on the device
], ids=str)
def test_packed_and_16_bit_inserts_store_the_reference_bits(case, wire):
    """Rows a front packed are copied to the device as they lie, and 16-bit rows bound for
    a float32 buffer are widened by replay_insert: both, and the same rows packed on the
    host, store what the reference does (subnormals and signed zeros included)."""
    cuda, ref = learners(case)
    dtype, rng = STORAGE_DTYPES[wire], np.random.default_rng(22)
    for n in sorted({1, min(7, case.capacity), min(case.B, case.capacity)}):
        t = transitions(rng, n, case, priorities=True)
        t = dataclasses.replace(t, h_t=t.h_t.astype(np.float32).astype(dtype),
                                h_tp1=t.h_tp1.astype(np.float32).astype(dtype))
        t.h_t[0, :3] = np.array([2.0 ** -24, -0.0, -(2.0 ** -14)], np.float32).astype(dtype)
        prepared = cuda.prepare_insert(_packed(t))
        assert prepared.upload is not None
        assert prepared.rows.h_t.dtype == dtype
        cuda.insert(prepared)
        ref.insert(t)
        assert_same_buffer(cuda, ref)
        cuda.insert(t)
        ref.insert(t)
        assert_same_buffer(cuda, ref)
    if case.dtype == "float32" and wire != "float32":   # mixed 16-bit rows: widened first
        other = STORAGE_DTYPES["float16" if wire == "bfloat16" else "bfloat16"]
        t = dataclasses.replace(t, h_tp1=t.h_tp1.astype(np.float32).astype(other))
        with cuda.prepare_insert(t) as prepared:
            assert prepared.rows.h_tp1.dtype == np.float32
        cuda.insert(t)
        ref.insert(t)
        assert_same_buffer(cuda, ref)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_draws_are_the_references_rows_weights_and_bytes(case):
    cuda, ref = learners(case)
    fill([cuda, ref], np.random.default_rng(2), case, case.capacity + 3)
    replay, stream = cuda.replay, cuda.backend.stream
    for draw in (0, 1, 2, 17, (1 << 32) + 5):
        with stream:
            replay.draw_alone(draw)
        stream.synchronize()
        ref.replay.state.draws = draw
        expected = ref.replay.draw()
        np.testing.assert_array_equal(replay._drawn.get(), expected.rows)
        want = packed(ref.replay.state.batch(expected.rows, expected.weights))
        got = replay._gathered.get().view(np.uint8)[:len(want)].tobytes()
        assert got == want, f"draw {draw}: gathered bytes differ"


def test_draws_follow_the_tree_on_a_deep_buffer():
    case = Case(100_000, 4096, 16, 3, "float32", 1.0)
    cuda, ref = learners(case)
    rng = np.random.default_rng(3)
    t = transitions(rng, 50_000, case)
    t.priorities = rng.integers(1, 9, 50_000).astype(np.float32)   # exact sums
    for learner in (cuda, ref):
        learner.insert(t)
    prefix = np.cumsum(t.priorities, dtype=np.float64)
    for draw in range(3):
        with cuda.backend.stream:
            cuda.replay.draw_alone(draw)
        cuda.backend.stream.synchronize()
        mass = uniforms(case.config().replay_seed, draw, case.B) * prefix[-1]
        np.testing.assert_array_equal(cuda.replay._drawn.get(),
                                      np.searchsorted(prefix, mass, side="right"))


# ---- the device's check of an insert's values --------------------------------------------
#: Values each field's rule refuses (the actions' out-of-range ones are worked out per N).
BAD_VALUES = {
    "h_t": [np.nan, np.inf, -np.inf], "h_tp1": [np.nan, -np.inf],
    "actions": [-1, "N", 1 << 30], "rewards": [np.nan, np.inf, -np.inf],
    "dones": [0.5, -1.0, 2.0, np.nan], "discounts": [-0.5, 1.0000001, np.nan, np.inf],
    "priorities": [0.0, -0.0, -1.0, np.nan, np.inf],
}


def spoiled(rng: np.random.Generator, t: Transitions, field: str, N: int) -> Transitions:
    """``t`` with one of ``field``'s bad values at a random place."""
    values = getattr(t, field).copy()
    bad = BAD_VALUES[field][rng.integers(len(BAD_VALUES[field]))]
    values.reshape(-1)[rng.integers(values.size)] = N if bad == "N" else bad
    return dataclasses.replace(t, **{field: values})


@pytest.mark.parametrize("case, wire", [(CASES[5], "float32"), (CASES[5], "float16"),
                                        (CASES[2], "bfloat16"), (CASES[3], "float16"),
                                        (CASES[1], "bfloat16")], ids=str)
def test_the_device_refuses_an_inserts_values_where_the_host_does(case, wire):
    """replay_check against the host's checks (the oracle) on fresh random inserts of
    several sizes, each clean or spoiled in one field, with and without priorities."""
    cuda, _ = learners(case)
    config, rng = case.config(), np.random.default_rng(19)
    limit = min(cuda.max_batch_size, case.capacity)
    for trial in range(60):
        n = int(min(limit, rng.choice([1, 2, 3, 31, case.B, 3000])))
        t = transitions(rng, n, case, priorities=trial % 2 == 1)
        t = dataclasses.replace(t, h_t=t.h_t.astype(np.float32).astype(STORAGE_DTYPES[wire]),
                                h_tp1=t.h_tp1.astype(np.float32).astype(STORAGE_DTYPES[wire]))
        fields = [f for f in BAD_VALUES if f != "priorities" or t.priorities is not None]
        field = None if trial % 5 == 0 else fields[rng.integers(len(fields))]
        if field is not None:
            t = spoiled(rng, t, field, case.N)
        upload = cuda.replay.upload(validate_transitions(t, config, limit, check_values=False))
        assert upload is not None
        try:
            passed = cuda.replay.checked(upload)
        finally:
            upload.close()
        try:
            validate_transitions(t, config, limit)
            refused = None
        except InvalidArgument as exc:
            refused = exc.field
        assert refused == field and passed == (field is None), (trial, n, field, refused)


def test_a_bad_insert_is_refused_naming_its_field_and_stores_nothing():
    """Refused by the device's check, named by the host's; the buffer is unchanged."""
    case = CASES[2]
    cuda, _ = learners(case)
    rng = np.random.default_rng(20)
    fill([cuda], rng, case, case.capacity)
    before = cuda.replay_snapshot().checksum()
    for field in BAD_VALUES:
        for _ in range(3):
            t = spoiled(rng, transitions(rng, 7, case, priorities=True), field, case.N)
            with pytest.raises(InvalidArgument) as info:
                cuda.insert(t)
            assert info.value.field == field
    assert cuda.replay_snapshot().checksum() == before


# ---- steps ------------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=str)
def test_step_by_step_against_the_reference_and_the_batch_path(case):
    cuda, ref = learners(case)
    twin = Learner(case.config(replay_capacity=0), backend="cuda")   # the batch path
    rng = np.random.default_rng(4)
    fill([cuda], rng, case, case.capacity + case.capacity // 2)
    for step in range(6):
        if step == 3:
            fill([cuda], rng, case, max(1, case.capacity // 4))
        if step == 4:   # draws whose steps never ran leave owner marks the next draw outranks
            with cuda.backend.stream:
                for draw in (10**6, 10**6 + 1):
                    cuda.replay.draw_alone(draw)
        state, buffer = cuda.snapshot(), cuda.replay_snapshot()
        ref.load(state)
        ref.load_replay(buffer)
        assert_same_buffer(cuda, ref)
        draw = ref.replay.draw()

        run = cuda.train_replay(1)
        assert (run.steps, run.refused) == (1, False)
        np.testing.assert_array_equal(cuda.replay._drawn.get(), draw.rows)

        twin.load(state)
        result = twin.step(buffer.batch(draw.rows, draw.weights))
        assert cuda.snapshot().checksum() == twin.snapshot().checksum(), f"step {step}"
        assert (run.losses[0], run.q_taken_means[0], run.grad_norms[0]) == (
            result.loss, result.q_taken_mean, result.grad_norm)

        ref.replay.write_back(draw.rows, result.priorities)
        ref.replay.state.draws += 1
        ref.replay.state.sampled += case.B
        assert_same_buffer(cuda, ref)


@pytest.mark.parametrize("case", [CASES[1], CASES[4]], ids=str)
def test_runs_are_deterministic_and_do_not_depend_on_their_length(case):
    a, _ = learners(case)
    b, _ = learners(case)
    rng_a, rng_b = np.random.default_rng(5), np.random.default_rng(5)
    fill([a], rng_a, case, case.capacity)
    fill([b], rng_b, case, case.capacity)
    run = a.train_replay(70)                    # two runs of the device: 64 + 6
    for k in (1, 2, 3, 64):                     # 70 steps in other pieces
        b.train_replay(k)
    assert run.steps == 70 and b.step_count == 70
    assert a.snapshot().checksum() == b.snapshot().checksum()
    assert a.replay_snapshot().checksum() == b.replay_snapshot().checksum()
    assert len(run.losses) == 70 and np.isfinite(run.losses).all()


@pytest.mark.parametrize("case", [CASES[2], CASES[4]], ids=str)
def test_inserts_while_a_run_is_left_running_go_in_after_its_steps(case):
    """A run left running, as the replay loop leaves it, with inserts meanwhile through the
    upload buffers (each reused, and grown, while inserts that read it still wait behind
    the run), then a batch-path step, which waits for the run: the bits of the run
    finished first, then the inserts, then the step."""
    a, _ = learners(case)
    b, _ = learners(case)
    rng = np.random.default_rng(17)
    fill([a, b], rng, case, case.capacity)
    sizes = [1, 3, 2, 1, case.B, 5, min(case.capacity, 2 * case.B), 1]   # > UPLOAD_BUFFERS
    rows = [transitions(rng, min(n, case.capacity), case, priorities=i % 2 == 1)
            for i, n in enumerate(sizes)]
    t = transitions(rng, case.B, case)
    batch = Batch(t.h_t, t.h_tp1, t.actions, t.rewards, t.dones, t.discounts, None)
    running = a.start_replay(9)
    for r in rows:
        with a.prepare_insert(r) as prepared:
            assert prepared.upload is not None
            a.insert(prepared)
    stepped = a.step(batch)
    got = a.finish_replay(running)
    want = b.train_replay(9)
    for r in rows:
        b.insert(r)
    other = b.step(batch)
    assert (stepped.step, stepped.loss) == (other.step, other.loss)
    np.testing.assert_array_equal(stepped.priorities, other.priorities)
    assert (got.steps, got.losses.tolist()) == (want.steps, want.losses.tolist())
    assert a.snapshot().checksum() == b.snapshot().checksum()
    assert a.replay_snapshot().checksum() == b.replay_snapshot().checksum()


def test_the_barrier_targets_restart_without_changing_anything():
    """Before the grid-barrier targets pass 2^30 the flags are zeroed and they restart at 1
    (a block that smaller launches leave out must not look arrived): inserts of several
    sizes and steps across the restart give the bits they give far from it."""
    case = CASES[4]
    a, _ = learners(case)
    b, _ = learners(case)
    b.replay._barrier = (1 << 30) - 5
    fill([a, b], np.random.default_rng(14), case, case.capacity)
    for learner in (a, b):
        learner.train_replay(6)
    assert b.replay._barrier < 1000, "the targets did not restart"
    assert a.snapshot().checksum() == b.snapshot().checksum()
    assert a.replay_snapshot().checksum() == b.replay_snapshot().checksum()


def test_a_non_finite_step_halts_the_run_where_the_reference_says():
    """α = 0: every draw is uniform whatever the priorities, so the reference knows which
    draw first takes the row whose features overflow Adam's second moment (no clipping)."""
    case = Case(16, 1, 32, 3, "float32", 0.0)
    cuda, _ = learners(case, max_grad_norm=0.0)
    twin, _ = learners(case, max_grad_norm=0.0)
    bad = 0
    rows = transitions(np.random.default_rng(6), 16, case)
    rows.h_t[bad] = 1e30                        # finite: the insert takes it
    for learner in (cuda, twin):
        learner.insert(rows)
    seed = case.config().replay_seed
    draws = [int(uniforms(seed, d, 1)[0] * 16) for d in range(64)]   # leaves all 1: ⌊16u⌋
    halt = draws.index(bad)
    assert 0 < halt < 30, "pick another row: the test wants a halt inside the run"

    run = cuda.train_replay(40)
    assert (run.steps, run.refused, len(run.losses)) == (halt, True, halt)
    twin.train_replay(halt)                     # the same steps, no refusal
    assert cuda.snapshot().checksum() == twin.snapshot().checksum()
    got, want = cuda.replay_snapshot(), twin.replay_snapshot()
    np.testing.assert_array_equal(got.priorities, want.priorities)
    assert (got.draws, got.sampled, want.draws) == (halt + 1, halt, halt)
    again = cuda.train_replay(1)                # the next run draws the next row
    assert (again.steps, again.refused) == ((0, True) if draws[halt + 1] == bad else (1, False))


def test_a_resumed_buffer_continues_bit_identically():
    pytest.importorskip("safetensors")
    case = CASES[2]
    a, _ = learners(case)
    rng = np.random.default_rng(7)
    fill([a], rng, case, 40)
    a.train_replay(5)
    state = a.snapshot()
    buffer = ReplayState.from_bytes(a.replay_snapshot().to_bytes(), a.config)
    later = transitions(rng, 11, case)
    a.insert(later)
    a.train_replay(7)

    b = Learner(a.config, backend="cuda", state=state)
    b.load_replay(buffer)
    b.insert(later)
    b.train_replay(7)
    assert b.snapshot().checksum() == a.snapshot().checksum()
    assert b.replay_snapshot().checksum() == a.replay_snapshot().checksum()


def test_a_buffer_that_does_not_fit_the_device_is_refused():
    config = Case(1 << 30, 256, 4096, 11, "float32", 0.6).config()
    with pytest.raises(ReplayTooLarge, match="GiB of device memory"):
        Learner(config, backend="cuda")


def test_a_cuda_server_trains_from_its_buffer(tmp_path):
    for package in ("grpc_health", "grpc_reflection", "prometheus_client", "safetensors"):
        pytest.importorskip(package, reason="the server's packages are not installed here")
    from duelq.client import LearnerClient
    from duelq.server.fronts import start_server
    from duelq.server.server import ServerOptions

    case = Case(1000, 64, 128, 11, "float32", 0.6)
    server = start_server(case.config(replay_ratio=1.0),
                          ServerOptions(port=0, checkpoint_dir=str(tmp_path),
                                        checkpoint_replay=True), backend="cuda")
    try:
        rng = np.random.default_rng(8)
        with LearnerClient(server.target) as client:
            for _ in range(5):
                client.insert(transitions(rng, 64, case))
            result = client.train_replay(3)
            assert (result.steps, result.refused) == (3, False)
            path, step = client.save_checkpoint()
            info = client.replay_info()
        assert info.inserted == 320 and info.size == 320 and info.sampled >= 3 * 64
        assert server.learner.backend.name == "cuda" and step <= server.learner.step_count
        assert type(server.learner.replay).__name__ == "CudaReplay"
    finally:
        server.stop(0, final_checkpoint=False)
