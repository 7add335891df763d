"""`duelq bench`: it runs and writes well-formed output.  Figures are never asserted."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from duelq.apps import cli
from duelq.apps.bench import report, run, servers
from duelq.server.core.learner import Learner
from duelq.server.core.state import LearnerState

from conftest import SMALL, random_batch

ROW_KEYS = {"section", "kind", "backend", "batch", "wire", "transport", "actors", "variant",
            "request_bytes", "response_bytes", "steps_per_s", "transitions_per_s", "mb_per_s",
            "p50_ms", "p99_ms", "client_cpu_us", "server_cpu_us"}


def test_quick_bench_writes_a_table_json_and_png(tmp_path):
    out = tmp_path / "bench"
    run = subprocess.run(
        [sys.executable, "-m", "duelq.apps.cli", "bench", "--quick", "--backend", "reference",
         "--out", str(out), "--hidden-dim", "16", "--n-actions", "5", "--echo-processes", "2"],
        capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "### Throughput by batch size" in run.stdout and "÷ echo" in run.stdout
    assert "byte stream on 2 processes" in run.stdout   # sharing its TCP port
    assert "goal" not in run.stdout.lower()             # figures, no verdicts

    result = json.loads((out / "bench.json").read_text())
    assert set(result) >= {"meta", "rows", "codec_us", "device_step", "failures"}
    assert result["failures"] == [] and result["meta"]["quick"] is True
    assert result["meta"]["echo_processes"] == 2
    rows = result["rows"]
    assert {r["kind"] for r in rows} == {"echo", "stream", "unary", "replay"}
    assert {r["backend"] for r in rows} == {"echo", "reference", "null"}
    assert {r["transport"] for r in rows} == {"tcp", "uds"}
    for row in rows:
        assert ROW_KEYS <= set(row) and "error" not in row
        if row["kind"] != "echo":
            assert "vs_echo" in row and "vs_echo_f32" in row
    check_replay_rows(rows, "tcp")
    assert "### Server-side replay" in run.stdout
    assert any("server_us" in r for r in rows)   # in-process: server-side overhead
    for r in rows:   # a thread's CPU time within the wall time it is set against
        if "server_us" in r:
            us = r["server_us"]
            assert 0 <= us["handler_cpu"] <= 1.05 * us["handler"] + 50, (r["kind"], us)
    assert "skipped" in result["device_step"]     # no GPU in the suite
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


REPLAY_KEYS = {"replay_batch", "replay_ratio", "learner_steps", "inserted_rows_per_s",
               "inserts_per_s", "ratio_measured", "wire_bytes_per_step", "vs_stream_steps",
               "vs_stream_bytes_per_step"}


def check_replay_rows(rows: list[dict], transport: str) -> None:
    """Replay cells, one per wire of the stream cells at B, well-formed; no timings."""
    replay = [r for r in rows if r["kind"] == "replay"]
    stream = {r["wire"] for r in rows if r["kind"] == "stream" and r["section"] == "main"}
    assert {r["wire"] for r in replay} == stream
    for r in replay:
        assert REPLAY_KEYS <= set(r), r
        assert r["backend"] == "reference" and r["transport"] == transport
        assert r["replay_batch"] == r["batch"] == 256 and r["replay_ratio"] == 8
        assert r["learner_steps"] >= 0 and r["inserted_rows_per_s"] >= 0
        assert r["request_bytes"] > 0 and r["vs_echo"] is None
        if r["learner_steps"]:
            assert r["wire_bytes_per_step"] > 0 and r["vs_stream_steps"] is not None
            assert r["vs_stream_bytes_per_step"] is not None


def test_bench_with_front_process_starts_and_measures_that_server(tmp_path):
    """`duelq bench --front-processes 2` benches a front-process server it
    starts itself, as a --target: the learner's cells on its backend over the target
    transport, no null-backend or UDS cells, and the server named in the output.  Started
    in the Docker image's environment (a token file, a checkpoint directory, a metrics
    port), it sends the file's token and leaves the checkpoints and the port alone."""
    out, checkpoints = tmp_path / "bench", tmp_path / "checkpoints"
    (tmp_path / "token").write_text("s3cret\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        metrics = s.getsockname()[1]
    env = {**os.environ, "DUELQ_TOKEN_FILE": str(tmp_path / "token"),
           "DUELQ_CHECKPOINT_DIR": str(checkpoints), "DUELQ_METRICS_PORT": str(metrics)}
    run = subprocess.run(
        [sys.executable, "-m", "duelq.apps.cli", "bench", "--quick", "--backend", "reference",
         "--front-processes", "2", "--scaling-actors", "", "--out",
         str(out), "--hidden-dim", "16", "--n-actions", "5"],
        capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert not checkpoints.exists() or not any(checkpoints.iterdir())
    assert "a front-process server with 2 front(s), started by the bench" in run.stdout
    result = json.loads((out / "bench.json").read_text())
    assert result["failures"] == [] and result["meta"]["target"].startswith("127.0.0.1:")
    rows = result["rows"]
    assert {r["transport"] for r in rows} == {"target"}
    assert {r["backend"] for r in rows} == {"echo", "reference"}
    assert {r["kind"] for r in rows} == {"echo", "stream", "unary", "replay"}
    assert all("vs_echo" in r for r in rows if r["kind"] != "echo")
    check_replay_rows(rows, "target")   # the fronts forward inserts to the learner's buffer


@pytest.mark.parametrize("flags, problem", [
    (["--batch-sizes", "256,x"], "--batch-sizes"),
    (["--batch-sizes", "0"], "--batch-sizes"),
    (["--transports", "tcp,carrier-pigeon"], "--transports"),
    (["--wire-dtypes", "int8"], "--wire-dtypes"),
    (["--duration", "0"], "--duration"),
    (["--echo-processes", "0"], "--echo-processes"),
])
def test_bad_flags_are_usage_errors(flags, problem, capsys, tmp_path):
    assert cli.main(["bench", "--out", str(tmp_path), *flags]) == cli.EXIT_USAGE
    assert problem in capsys.readouterr().err


def test_every_learner_cell_has_an_echo_ceiling_of_the_same_shape():
    cells = run.Plan.from_args(cli.build_parser().parse_args(["bench"])).cells(
        "reference", in_process=True)
    assert len(cells) == len(set(cells))
    echo = {(c.section, c.batch, c.wire == "float32", c.transport, c.actors, c.variant)
            for c in cells if c.kind == "echo"}
    for c in cells:
        if c.kind != "echo":
            key = (c.section, c.batch, c.wire == "float32", c.transport, c.actors)
            assert key + (c.variant,) in echo or key + ("",) in echo, c
    # A remote target: no null backend, no UDS, no experiments (they need in-process servers).
    remote = run.Plan.from_args(argparse.Namespace(**{**vars(cli.build_parser().parse_args(
        ["bench"])), "target": "localhost:1"})).cells("cuda", in_process=False)
    assert {c.backend for c in remote} == {"echo", "cuda"}
    assert {c.transport for c in remote} == {"target"}


def test_replay_cells_follow_the_stream_cells_and_can_be_left_out(monkeypatch):
    cells = run.Plan.from_args(cli.build_parser().parse_args(["bench"])).cells(
        "reference", in_process=True)
    for B in (256, 1024, 4096):
        main = [c for c in cells if c.section == "main" and c.batch == B]
        kinds = [c.kind for c in main]
        assert kinds.count("replay") == 3 and {c.backend for c in main
                                               if c.kind == "replay"} == {"reference"}
        assert max(i for i, k in enumerate(kinds) if k == "stream") < kinds.index("replay")
    assert not any(c.kind == "replay" for c in cells if c.section != "main")
    off = run.Plan.from_args(cli.build_parser().parse_args(["bench", "--no-replay-cells"]))
    assert not any(c.kind == "replay" for c in off.cells("reference", in_process=True))
    monkeypatch.setenv("DUELQ_REPLAY_CELLS", "false")
    env = run.Plan.from_args(cli.build_parser().parse_args(["bench"]))
    assert env.replay is False


def test_replay_config_sizes_the_buffer_for_the_cell():
    config = run.replay_config(SMALL, 1024)
    assert (config.replay_batch_size, config.replay_min_size, config.replay_ratio) == (
        1024, 1024, 8.0)
    assert config.replay_capacity >= 4 * 1024
    kept = run.replay_config(replace(SMALL, replay_capacity=1 << 20, replay_ratio=2.0), 256)
    assert (kept.replay_capacity, kept.replay_ratio) == (1 << 20, 2.0)


def test_replay_rows_are_compared_with_the_stream_of_the_same_b_and_wire():
    def row(kind, wire, steps, B=256, **extra):
        return {"section": "main", "kind": kind, "backend": "reference", "batch": B,
                "wire": wire, "transport": "tcp", "actors": 2, "variant": "",
                "steps_per_s": steps, "transitions_per_s": steps * B, **extra}
    rows = [row("stream", "float32", 100.0, request_bytes=1000),
            row("stream", "float16", 150.0, request_bytes=600),
            row("replay", "float16", 300.0, wire_bytes_per_step=60.0, replay_ratio=8.0,
                inserted_rows_per_s=9600.0, ratio_measured=8.0, request_bytes=15000,
                p50_ms=1.0)]
    report.add_ratios(rows)
    assert rows[2]["vs_stream_steps"] == pytest.approx(2.0)
    assert rows[2]["vs_stream_bytes_per_step"] == pytest.approx(0.1)
    assert rows[2]["vs_echo"] is None
    assert "| 2.00 |" in report.replay_table(rows)


def test_ratios_divide_by_the_ceiling_of_the_same_message_size():
    def row(kind, backend, wire, steps, B=1024):
        return {"section": "main", "kind": kind, "backend": backend, "batch": B, "wire": wire,
                "transport": "tcp", "actors": 2, "variant": "", "steps_per_s": steps,
                "transitions_per_s": steps * B}
    rows = [row("echo", "echo", "float32", 100.0), row("echo", "echo", "bfloat16", 180.0),
            row("stream", "null", "float32", 90.0), row("stream", "null", "bfloat16", 150.0)]
    report.add_ratios(rows)
    assert rows[2]["vs_echo"] == pytest.approx(0.9)
    assert rows[3]["vs_echo"] == pytest.approx(150 / 180)
    assert rows[3]["vs_echo_f32"] == pytest.approx(1.5)


def test_null_and_timed_backends_keep_the_learner_contract():
    rng = np.random.default_rng(0)
    learner = Learner(SMALL, backend=servers.TimedBackend(
        servers.NullBackend(SMALL, LearnerState.initial(SMALL))))
    for step in (1, 2):
        result = learner.step(random_batch(rng, 8))
        assert result.step == step and result.td_errors.shape == (8,)
    assert learner.backend.name == "null" and learner.backend.seconds > 0
    assert learner.weights()[1] == 2

