"""Checkpoints: bit-identical resume, atomic writes, strict refusal of bad files, save policy,
the writer, and checkpoints through the server (SaveCheckpoint, periodic saves, resume,
idempotency records across a restart, `duelq serve` refusing a bad checkpoint)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import safetensors

from duelq.client import LearnerClient
from duelq.apps import cli
from duelq.server.core import checkpoint
from duelq.server.core.batch import Batch
from duelq.server.core.checkpoint import (CheckpointError, CheckpointPolicy, CheckpointWriter,
                                     TUNABLE_FIELDS, checkpoint_name, read_checkpoint,
                                     read_latest, save_checkpoint)
from duelq.server.core.config import LearnerConfig
from duelq.server.core.errors import InvalidArgument
from duelq.server.core.learner import Learner
from duelq.server.core.state import LearnerState

from conftest import SMALL, random_batch
from helpers import wait_for

CONFIG = LearnerConfig(hidden_dim=8, n_actions=3, isv_size=16, isv_slots={"ent": 5},
                       step_entropy_slot="ent", tau=0.1, target_update_period=2, seed=7)


def batches(count: int, seed: int = 1, size: int = 6) -> list[Batch]:
    rng = np.random.default_rng(seed)
    H, N = CONFIG.hidden_dim, CONFIG.n_actions
    return [Batch(h_t=rng.standard_normal((size, H), dtype=np.float32),
                  h_tp1=rng.standard_normal((size, H), dtype=np.float32),
                  actions=rng.integers(0, N, size, dtype=np.int32),
                  rewards=rng.standard_normal(size, dtype=np.float32),
                  dones=(rng.random(size) < 0.2).astype(np.float32),
                  discounts=np.full(size, 0.99, np.float32),
                  weights=rng.random(size, dtype=np.float32))
            for _ in range(count)]


def trained(steps: int) -> LearnerState:
    learner = Learner(CONFIG, backend="reference")
    for batch in batches(steps):
        learner.step(batch)
    return learner.snapshot()


@pytest.fixture(scope="module")
def state() -> LearnerState:
    return trained(3)


def test_round_trip_is_bit_identical(tmp_path, state):
    path = save_checkpoint(tmp_path, state, CONFIG, backend="reference")
    assert path == tmp_path / "ckpt-000000000003.safetensors"
    loaded = read_checkpoint(path, CONFIG).state
    assert loaded.checksum() == state.checksum()
    assert loaded.isv_observed.dtype == bool and loaded.isv_observed[5]
    assert all(a.dtype == np.float32 for a in loaded.adam_v.arrays())
    with safetensors.safe_open(path, framework="numpy") as f:
        info = json.loads(f.metadata()["duelq"])
    assert (info["format_version"], info["step"], info["backend"]) == (
        checkpoint.FORMAT_VERSION, 3, "reference")
    assert LearnerConfig.from_dict(info["config"]) == CONFIG


def test_stopped_and_resumed_run_matches_one_never_stopped(tmp_path):
    k, data = 4, batches(8)
    never_stopped = Learner(CONFIG, backend="reference")
    for batch in data:
        never_stopped.step(batch)

    first = Learner(CONFIG, backend="reference")
    for batch in data[:k]:
        first.step(batch)
    save_checkpoint(tmp_path, first.snapshot(), CONFIG)
    del first
    found = read_latest(tmp_path, CONFIG)
    loaded, path = found.state, found.path
    assert path.name == checkpoint_name(k)
    resumed = Learner(CONFIG, backend="reference", state=loaded)
    for batch in data[k:]:
        resumed.step(batch)

    assert resumed.snapshot().checksum() == never_stopped.snapshot().checksum()
    assert resumed.step_count == 2 * k


def test_keeps_the_newest_k(tmp_path):
    learner = Learner(CONFIG, backend="reference")
    for batch in batches(5):
        learner.step(batch)
        save_checkpoint(tmp_path, learner.snapshot(), CONFIG, keep=2)
    assert sorted(os.listdir(tmp_path)) == [checkpoint_name(4), checkpoint_name(5)]
    found = read_latest(tmp_path, CONFIG)
    loaded, path = found.state, found.path
    assert path.name == checkpoint_name(5) and loaded.checksum() == learner.snapshot().checksum()


def test_same_step_is_replaced_and_older_step_refused(tmp_path, state):
    save_checkpoint(tmp_path, state, CONFIG)
    save_checkpoint(tmp_path, state, CONFIG)
    assert os.listdir(tmp_path) == [checkpoint_name(3)]
    with pytest.raises(CheckpointError, match=r"refusing to write step 1: .*ckpt-000000000003"):
        save_checkpoint(tmp_path, trained(1), CONFIG)
    assert os.listdir(tmp_path) == [checkpoint_name(3)]


def test_crash_at_rename_leaves_no_partial_file(tmp_path, state, monkeypatch):
    save_checkpoint(tmp_path, state, CONFIG)
    newer = trained(4)

    def crash(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(CheckpointError, match=r"ckpt-000000000004.*write failed"):
        save_checkpoint(tmp_path, newer, CONFIG)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == [checkpoint_name(3)]
    found = read_latest(tmp_path, CONFIG)
    loaded, path = found.state, found.path
    assert path.name == checkpoint_name(3) and loaded.checksum() == state.checksum()


def test_killed_writer_leaves_a_stray_temp_that_is_ignored_then_cleaned(tmp_path, state):
    save_checkpoint(tmp_path, state, CONFIG)
    child = textwrap.dedent(f"""
        import os, signal, sys
        from duelq.server.core.checkpoint import save_checkpoint
        from duelq.server.core.learner import Learner
        from test_checkpoint import CONFIG, batches
        learner = Learner(CONFIG, backend="reference")
        for batch in batches(5):
            learner.step(batch)
        os.replace = lambda src, dst: os.kill(os.getpid(), signal.SIGKILL)
        save_checkpoint({str(tmp_path)!r}, learner.snapshot(), CONFIG)
    """)
    proc = subprocess.run([sys.executable, "-c", child], cwd=Path(__file__).parent)
    assert proc.returncode == -9
    stray = [n for n in os.listdir(tmp_path) if n != checkpoint_name(3)]
    assert len(stray) == 1 and stray[0].startswith(".ckpt-") and stray[0].endswith(".tmp")
    assert (tmp_path / stray[0]).stat().st_size > 0

    found = read_latest(tmp_path, CONFIG)
    loaded, path = found.state, found.path
    assert path.name == checkpoint_name(3) and loaded.checksum() == state.checksum()
    save_checkpoint(tmp_path, trained(4), CONFIG)
    assert sorted(os.listdir(tmp_path)) == [checkpoint_name(3), checkpoint_name(4)]


@pytest.mark.parametrize("length", [0, 7, 100, -1])
def test_truncated_file_is_refused(tmp_path, state, length):
    path = save_checkpoint(tmp_path, state, CONFIG)
    data = path.read_bytes()
    path.write_bytes(data[:length % len(data)])
    with pytest.raises(CheckpointError, match=r"ckpt-000000000003\.safetensors: not a readable"):
        read_latest(tmp_path, CONFIG)


def test_every_flipped_byte_is_refused(tmp_path, state):
    path = save_checkpoint(tmp_path, state, CONFIG)
    data = path.read_bytes()
    for i in range(len(data)):
        bad = bytearray(data)
        bad[i] ^= 1 << (i % 8)
        path.write_bytes(bad)
        with pytest.raises(CheckpointError):
            read_checkpoint(path, CONFIG)
    flipped = bytearray(data)
    flipped[-1] ^= 0x01  # last byte of the tensor data
    path.write_bytes(flipped)
    with pytest.raises(CheckpointError, match="SHA-256 mismatch"):
        read_checkpoint(path, CONFIG)


def test_newest_corrupt_file_does_not_fall_back_to_an_older_one(tmp_path, state):
    save_checkpoint(tmp_path, state, CONFIG)
    newest = save_checkpoint(tmp_path, trained(4), CONFIG)
    newest.write_bytes(newest.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="ckpt-000000000004"):
        read_latest(tmp_path, CONFIG)


def test_other_format_version_is_refused(tmp_path, state, monkeypatch):
    ours = checkpoint.FORMAT_VERSION
    monkeypatch.setattr(checkpoint, "FORMAT_VERSION", ours + 1)
    path = save_checkpoint(tmp_path, state, CONFIG)
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match=f"format version {ours + 1}; this build reads "
                                              f"version {ours}"):
        read_checkpoint(path, CONFIG)


def test_config_mismatch_is_refused_strictly(tmp_path, state):
    path = save_checkpoint(tmp_path, state, CONFIG)
    wider = dataclasses.replace(CONFIG, hidden_dim=16)
    with pytest.raises(CheckpointError, match=r"config mismatch \(hidden_dim: checkpoint 8, "
                                              r"server 16\)"):
        read_latest(tmp_path, wider)
    slower = dataclasses.replace(CONFIG, lr=1e-5)
    with pytest.raises(CheckpointError, match=r"lr: checkpoint 0\.0001, server 1e-05"):
        read_checkpoint(path, slower)
    resumed = read_checkpoint(path, slower, allow_changes=["lr"]).state
    assert resumed.checksum() == state.checksum()
    with pytest.raises(CheckpointError, match="optimizer"):
        read_checkpoint(path, dataclasses.replace(CONFIG, optimizer="sgd", lr=1e-5),
                        allow_changes=["lr"])
    with pytest.raises(InvalidArgument, match=r"allow_changes: \['isv_size'\]"):
        read_checkpoint(path, CONFIG, allow_changes=["isv_size"])


def test_tunable_fields_are_config_fields_and_exclude_layout():
    names = {f.name for f in dataclasses.fields(LearnerConfig)}
    assert TUNABLE_FIELDS <= names
    assert names - TUNABLE_FIELDS == {"hidden_dim", "n_actions", "isv_size", "isv_slots",
                                      "optimizer", "replay_capacity", "replay_dtype",
                                      "replay_alpha"}


@pytest.mark.parametrize("name, bad, message", [
    ("adam_m.w_a", np.zeros((8, 3), np.float64), r"adam_m\.w_a is float64\[8, 3\], "
                                                 r"expected float32\[8, 3\]"),
    ("isv", np.zeros(15, np.float32), r"isv is float32\[15\], expected float32\[16\]"),
    ("extra", np.zeros(1, np.float32), r"unexpected \['extra'\]"),
    ("isv_observed", np.full(16, 2, np.uint8), "values other than 0 and 1"),
])
def test_wrong_tensor_layout_is_refused(tmp_path, state, name, bad, message):
    tensors = checkpoint._state_tensors(state, CONFIG, tmp_path)
    tensors[name] = bad
    info = {"format_version": checkpoint.FORMAT_VERSION, "step": 3, "config": CONFIG.to_dict()}
    path = tmp_path / checkpoint_name(3)
    path.write_bytes(checkpoint._encode(tensors, info))
    with pytest.raises(CheckpointError, match=message):
        read_checkpoint(path, CONFIG)


def test_state_that_does_not_fit_the_config_is_not_written(tmp_path, state):
    with pytest.raises(CheckpointError, match="does not fit the config: tensor params.w_v"):
        save_checkpoint(tmp_path, state, dataclasses.replace(CONFIG, hidden_dim=9))
    assert os.listdir(tmp_path) == []


def test_renamed_file_is_refused(tmp_path, state):
    path = save_checkpoint(tmp_path, state, CONFIG)
    path.rename(tmp_path / checkpoint_name(30))
    with pytest.raises(CheckpointError, match="holds step 3, but its name says step 30"):
        read_latest(tmp_path, CONFIG)


def test_directory_without_checkpoints_gives_none(tmp_path):
    assert read_latest(tmp_path / "missing", CONFIG) is None
    assert read_latest(tmp_path, CONFIG) is None
    (tmp_path / ".ckpt-000000000009.abc.tmp").write_bytes(b"partial")
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    assert read_latest(tmp_path, CONFIG) is None


@pytest.mark.parametrize("keep", [0, -1, 2.0, True])
def test_keep_must_be_a_positive_integer(tmp_path, state, keep):
    with pytest.raises(InvalidArgument, match="keep"):
        save_checkpoint(tmp_path, state, CONFIG, keep=keep)
    with pytest.raises(InvalidArgument, match="keep"):   # the writer: before any save
        CheckpointWriter(tmp_path, CONFIG, lambda: (state, {}), keep=keep)
    assert list(tmp_path.iterdir()) == []


def test_policy_every_n_steps():
    policy = CheckpointPolicy(every_steps=3, now=0.0)
    assert [s for s in range(1, 10) if policy.maybe_save(s, now=float(s))] == [3, 6, 9]
    policy.record(10, now=10.0)  # an on-demand save restarts the count
    assert [s for s in range(11, 16) if policy.maybe_save(s, now=float(s))] == [13]


def test_policy_every_t_seconds_only_when_steps_advanced():
    policy = CheckpointPolicy(every_seconds=60, step=100, now=1000.0)
    assert not policy.maybe_save(101, now=1059.9)
    assert policy.maybe_save(101, now=1060.0)
    assert not policy.maybe_save(101, now=1200.0)  # nothing new since the last save
    assert policy.maybe_save(102, now=1200.0)
    assert not policy.maybe_save(103, now=1259.0)


def test_policy_either_trigger_and_off():
    policy = CheckpointPolicy(every_steps=10, every_seconds=5.0, now=0.0)
    assert policy.maybe_save(1, now=5.0)       # time first
    assert policy.maybe_save(11, now=6.0)      # then steps
    never = CheckpointPolicy(now=0.0)
    assert not any(never.maybe_save(s, now=s * 1e6) for s in range(1, 100))


@pytest.mark.parametrize("kwargs, field", [
    ({"every_steps": -1}, "every_steps"), ({"every_steps": 1.5}, "every_steps"),
    ({"every_seconds": -1.0}, "every_seconds"), ({"every_seconds": float("inf")}, "every_seconds"),
])
def test_policy_rejects_bad_periods(kwargs, field):
    with pytest.raises(InvalidArgument, match=field):
        CheckpointPolicy(**kwargs, now=0.0)



# -- extras, the writer -------------------------------------------------------------------

def test_extras_round_trip_inside_the_digest(tmp_path, state):
    blob = b'{"records": [1, 2, 3]}'
    path = save_checkpoint(tmp_path, state, CONFIG, extras={"replay": blob, "empty": b""})
    found = read_checkpoint(path, CONFIG)
    assert found.extras == {"replay": blob, "empty": b""}
    assert found.state.checksum() == state.checksum() and found.path == path
    assert read_checkpoint(path, CONFIG).state.checksum() == state.checksum()
    data = bytearray(path.read_bytes())
    at = bytes(data).rindex(b"[1, 2, 3]")  # the extra's bytes, in the tensor data
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="SHA-256 mismatch"):
        read_latest(tmp_path, CONFIG)
    with pytest.raises(InvalidArgument, match="extras"):
        save_checkpoint(tmp_path, state, CONFIG, extras={"Bad Name": b""})


def test_writer_saves_periodically_off_the_step_path_and_at_close(tmp_path):
    """Every 4 steps and at close.  The snapshot is held until the test lets it go, after
    notify returned: notify never waits for a save (were it to, the held snapshot would
    give up after 10 s and the saves would be missing)."""
    learner = Learner(CONFIG, backend="reference")
    snapshots, taken, go = [], threading.Semaphore(0), threading.Semaphore(0)

    def held_snapshot():
        taken.release()
        assert go.acquire(timeout=10)
        snapshots.append(learner.step_count)
        return learner.snapshot(), {"note": str(learner.step_count).encode()}

    writer = CheckpointWriter(tmp_path, CONFIG, held_snapshot, keep=10, every_steps=4)
    writer.start()
    for batch in batches(10):
        learner.step(batch)
        writer.notify(learner.step_count)   # returns while a due save is held
        if learner.step_count % 4 == 0:
            assert taken.acquire(timeout=10)
            go.release()
            wait_for(lambda: (tmp_path / checkpoint_name(learner.step_count)).exists())
    go.release()                            # the final save's snapshot
    path, step = writer.close()
    assert (path.name, step) == (checkpoint_name(10), 10)
    assert snapshots == [4, 8, 10]
    assert sorted(os.listdir(tmp_path)) == [checkpoint_name(s) for s in (4, 8, 10)]
    assert read_checkpoint(path, CONFIG).extras == {"note": b"10"}
    assert writer.close() == (path, 10)   # closing twice writes nothing new
    assert snapshots == [4, 8, 10]


# -- through the server -------------------------------------------------------------------

def test_save_checkpoint_rpc_writes_what_the_server_holds(make_server, tmp_path):
    server = make_server(checkpoint_dir=str(tmp_path))
    rng = np.random.default_rng(0)
    with LearnerClient(server.target) as client:
        for _ in range(3):
            client.train_step(random_batch(rng, 8))
        path, step = client.save_checkpoint()
    assert (Path(path), step) == (tmp_path / checkpoint_name(3), 3)
    assert read_checkpoint(path, SMALL).state.checksum() == server.learner.snapshot().checksum()


def test_periodic_checkpoints_hold_exactly_the_steps_before_them(make_server, tmp_path):
    server = make_server(checkpoint_dir=str(tmp_path), checkpoint_every_steps=5,
                         checkpoint_keep=100)
    rng = np.random.default_rng(1)
    sent = [random_batch(rng, 8) for _ in range(40)]
    with LearnerClient(server.target) as client:
        assert [r.step for r in client.train_stream(sent, window=8)] == list(range(1, 41))
    server.stop(0)
    names = sorted(os.listdir(tmp_path))
    steps = [int(name[5:17]) for name in names]
    assert len(steps) >= 3 and steps[-1] == 40    # periodic ones, then the final one
    oracle = Learner(SMALL, backend="reference")
    for k, batch in enumerate(sent, 1):
        oracle.step(batch)
        if k in steps:
            assert read_checkpoint(tmp_path / checkpoint_name(k), SMALL).state.checksum() == \
                oracle.snapshot().checksum()


def test_restart_keeps_applied_keys_applied(make_server, tmp_path):
    first = make_server(checkpoint_dir=str(tmp_path))
    rng = np.random.default_rng(2)
    batch = random_batch(rng, 8)
    with LearnerClient(first.target, actor_id="a") as client:
        applied = client.train_step(batch)
        client.compute_entropy(np.array([0, 1, 1], np.int32), "policy_entropy_ema", 0.5)
    assert first.stop(0) == (tmp_path / checkpoint_name(1), 1)

    second = make_server(checkpoint_dir=str(tmp_path))
    assert second.learner.snapshot().checksum() == first.learner.snapshot().checksum()
    with LearnerClient(second.target, actor_id="a") as client:
        client.train_step(random_batch(rng, 8))  # seq 1 again: answered from the records
        again = client.train_step(batch, seq=1)
        assert again.replayed and (again.step, again.loss) == (1, applied.loss)
        assert client.info().step == 1
        entropy = client.compute_entropy(np.array([3], np.int32), "policy_entropy_ema", 0.5)
        assert entropy.replayed                  # seq 2 was the entropy request
        assert client.train_step(random_batch(rng, 8)).step == 2


def test_a_server_resumes_with_changed_tunable_settings_and_says_so(make_server, tmp_path,
                                                                     caplog):
    """Settings that fix no shape or meaning (TUNABLE_FIELDS: lr, say) may change across a
    restart; the server logs each change.  The others are refused (the exit-3 test)."""
    first = make_server(checkpoint_dir=str(tmp_path))
    with LearnerClient(first.target, actor_id="a") as client:
        client.train_step(random_batch(np.random.default_rng(3), 8))
    first.stop(0)
    slower = dataclasses.replace(SMALL, lr=SMALL.lr / 10)
    with caplog.at_level(logging.WARNING, logger="duelq.server.server"):
        second = make_server(slower, checkpoint_dir=str(tmp_path))
    assert second.learner.step_count == 1 and second.learner.config.lr == slower.lr
    assert second.learner.snapshot().checksum() == first.learner.snapshot().checksum()
    assert f"resuming with changed settings: lr {SMALL.lr!r} → {slower.lr!r}" in caplog.text
    second.stop(0)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="duelq.server.server"):
        make_server(slower, checkpoint_dir=str(tmp_path))   # the same settings again
    assert "changed settings" not in caplog.text


def _serve(*argv: str) -> int:
    return cli.main(["serve", "--port", "0", "--backend", "reference", "--hidden-dim", "8",
                     "--n-actions", "3", *argv])


def test_serve_refuses_a_corrupt_or_mismatched_checkpoint_with_exit_3(tmp_path, monkeypatch,
                                                                      capsys):
    monkeypatch.setattr(signal, "signal", lambda *args: None)
    config = LearnerConfig(hidden_dim=8, n_actions=3)
    learner = Learner(config, backend="reference")
    for batch in batches(2):
        learner.step(batch)
    path = save_checkpoint(tmp_path, learner.snapshot(), config)
    good = path.read_bytes()

    assert _serve("--checkpoint-dir", str(tmp_path), "--n-actions", "4") == cli.EXIT_CHECKPOINT
    err = capsys.readouterr().err
    assert "config mismatch (n_actions: checkpoint 3, server 4)" in err
    assert "refusing to start" in err and path.name in err

    path.write_bytes(good[:-8])
    assert _serve("--checkpoint-dir", str(tmp_path)) == cli.EXIT_CHECKPOINT
    assert "not a readable safetensors file" in capsys.readouterr().err
    assert os.listdir(tmp_path) == [path.name] and path.read_bytes() == good[:-8]

    (tmp_path / "file").write_text("x")
    assert _serve("--checkpoint-dir", str(tmp_path / "file")) == cli.EXIT_CHECKPOINT
    assert "cannot use as checkpoint directory" in capsys.readouterr().err
