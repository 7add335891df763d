"""`duelq bench`: it runs and writes well-formed output.  Figures are never asserted."""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from duelq.server import cli
from duelq.server.bench import report, run, servers
from duelq.server.learner import Learner
from duelq.server.state import LearnerState

from conftest import SMALL, random_batch

ROW_KEYS = {"section", "kind", "backend", "batch", "wire", "transport", "actors", "variant",
            "request_bytes", "response_bytes", "steps_per_s", "transitions_per_s", "mb_per_s",
            "p50_ms", "p99_ms", "client_cpu_us", "server_cpu_us"}


def test_quick_bench_writes_a_table_json_and_png(tmp_path):
    out = tmp_path / "bench"
    run = subprocess.run(
        [sys.executable, "-m", "duelq.server.cli", "bench", "--quick", "--backend", "reference",
         "--out", str(out), "--hidden-dim", "16", "--n-actions", "5", "--echo-processes", "2"],
        capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "### Throughput by batch size" in run.stdout and "÷ echo" in run.stdout
    assert "byte stream on 2 processes" in run.stdout   # sharing its TCP port

    result = json.loads((out / "bench.json").read_text())
    assert set(result) >= {"meta", "rows", "codec_us", "goals", "device_step", "failures"}
    assert result["failures"] == [] and result["meta"]["quick"] is True
    assert result["meta"]["echo_processes"] == 2
    rows = result["rows"]
    assert {r["kind"] for r in rows} == {"echo", "stream", "unary"}
    assert {r["backend"] for r in rows} == {"echo", "reference", "null"}
    assert {r["transport"] for r in rows} == {"tcp", "uds"}
    for row in rows:
        assert ROW_KEYS <= set(row) and "error" not in row
        if row["kind"] != "echo":
            assert "vs_echo" in row and "vs_echo_f32" in row
    assert any("server_us" in r for r in rows)   # in-process: server-side overhead
    assert "skipped" in result["device_step"]     # no GPU in the suite
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_with_front_process_starts_and_measures_that_server(tmp_path):
    """`duelq bench --front-process --front-processes 2` benches a front-process server it
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
        [sys.executable, "-m", "duelq.server.cli", "bench", "--quick", "--backend", "reference",
         "--front-process", "--front-processes", "2", "--scaling-actors", "", "--out",
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
    assert {r["kind"] for r in rows} == {"echo", "stream", "unary"}
    assert all("vs_echo" in r for r in rows if r["kind"] != "echo")


@pytest.mark.parametrize("flags, packed", [([], 420), (["--unpacked"], 0)])
def test_learner_path_reports_median_and_range_per_part(flags, packed):
    """benchmarks/learner_path.py runs on the reference backend, the learner taking every
    request packed as the fronts pack them (or none, as they came: the count is the
    script's tally of the learner's calls), and prints each part as "median [min–max]"
    over its blocks (the figures themselves are not checked)."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "learner_path.py"
    done = subprocess.run([sys.executable, str(script), "--backend", "reference", "--batch",
                           "32", "--requests", "20", "--repeats", "3", *flags],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    # 300 warm-up requests, then 3 repeats of two blocks of 20
    assert (f"B = 32 float32, {packed} of 420 requests packed, one thread, 3 blocks of 20 "
            f"requests each way") in done.stdout
    # scripts/ab_gpu.sh takes each row's first figure: the copies-ahead column
    assert "| part | the front's copies ahead | copies inline, same thread |" in done.stdout
    rows = {line.split("|")[1].strip(): line for line in done.stdout.splitlines()
            if line.startswith("| the ")}
    assert set(rows) == {"the learner's share, timed around it",
                         "the front's slot copy alone"}, done.stdout
    cells = re.findall(r"(\S+) \[(\S+)–(\S+)\]", "".join(rows.values()))
    assert len(cells) == 3, done.stdout   # the share both ways, the copy alone
    for median, low, high in cells:
        assert float(low) <= float(median) <= float(high)
    if not flags:
        bad = subprocess.run([sys.executable, str(script), "--repeats", "0"],
                             capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and "--repeats" in bad.stderr


def test_socket_cost_times_each_call_and_the_readers_cpu():
    """benchmarks/socket_cost.py prints a row per call: sendmsg to a reader in each of its
    three modes at both sizes (with the reader's CPU), then the learner side's calls; the
    figures are only checked to be numbers, the means above zero."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "socket_cost.py"
    done = subprocess.run([sys.executable, str(script), "--messages", "50", "--gap-us", "5"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = re.findall(r"^\| ([^|]+) \| ([\d.]+) \| ([\d.]+) \| (\d* ?%?) \|$", done.stdout,
                      re.MULTILINE)
    names = [name for name, *_ in rows]
    assert len(rows) == 10 and names[0] == "sendmsg 8208 B, the reader sleeps in recv", \
        done.stdout
    assert all(cpu.endswith("%") for _, _, _, cpu in rows[:6])
    assert all(float(mean) > 0 for _, _, mean, _ in rows)
    bad = subprocess.run([sys.executable, str(script), "--messages", "0"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--messages" in bad.stderr


@pytest.mark.parametrize("copies", [[], ["--plain-copies"]])
def test_relay_path_drives_the_learner_end_from_front_processes(copies):
    """benchmarks/relay_path.py: two front processes stream to the learner end on the null
    backend (B = 160: features over the stream copy's 64 KiB, unless --plain-copies); it
    prints steps/s, CPU per step, the relay thread's part of it and that less the device
    wait (none here), and with --parts the thread's parts (the values are not checked
    beyond the thread's part being within the whole and each part being there)."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "relay_path.py"
    done = subprocess.run([sys.executable, str(script), "--backend", "null", "--fronts", "2",
                           "--streams", "1", "--batch", "160", "--duration", "0.5", "--parts",
                           *copies], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "null, B = 160 float32, 2 fronts × 1 streams" in done.stdout
    plain = bool(copies)
    if not plain:   # the stream copy where server/native.c builds here
        from duelq.server import native
        try:
            native.load(cuda=False)
        except native.NativeUnavailable:
            plain = True
    assert done.stdout.count("packed by the fronts, plain copies") == plain
    reads = re.search(r"^reads of a front's socket per request: ([\d.]+)$", done.stdout,
                      re.MULTILINE)
    assert reads and float(reads.group(1)) > 0, done.stdout
    parts = dict(re.findall(r"^\| ([a-z][^|]*) \| (-?[\d.]+) \|$", done.stdout, re.MULTILINE))
    assert len(parts) == 6 and float(parts["frames read"]) > 0, done.stdout
    assert float(parts["prepare"]) > 0 and float(parts["reply"]) > 0
    figures = re.search(r"^\| (\d+) \| (\d+) \| (\d+) \| (\d+) \| (-?\d+) \|$",
                        done.stdout, re.MULTILINE).groups()
    steps, cpu, relay, wait, host = map(int, figures)
    assert steps > 0 and 0 < relay <= cpu   # the relay thread's share of it
    assert wait == 0 and host == relay      # no device
    bad = subprocess.run([sys.executable, str(script), "--fronts", "0"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--fronts" in bad.stderr


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
    assert {g["met"] for g in report.goals(rows, "reference")} == {True, False}


def test_null_and_timed_backends_keep_the_learner_contract():
    rng = np.random.default_rng(0)
    learner = Learner(SMALL, backend=servers.TimedBackend(
        servers.NullBackend(SMALL, LearnerState.initial(SMALL))))
    for step in (1, 2):
        result = learner.step(random_batch(rng, 8))
        assert result.step == step and result.td_errors.shape == (8,)
    assert learner.backend.name == "null" and learner.backend.seconds > 0
    assert learner.weights()[1] == 2


def _bench_doc(ratios: dict[str, float | None], steps: float) -> dict:
    """A bench.json's rows with the given B = 1024 TrainStream ratios (None: the cell
    failed), behind rows the summary must pass over: B = 256, the null backend."""
    rows = [{"kind": "echo", "backend": "echo", "batch": 1024, "wire": "float32",
             "steps_per_s": 1000.0}]
    for wire in ratios:
        rows += [{"kind": "stream", "backend": "cuda", "batch": 256, "wire": wire,
                  "steps_per_s": 1.0, "vs_echo": 9.0, "vs_echo_f32": 9.0},
                 {"kind": "stream", "backend": "null", "batch": 1024, "wire": wire,
                  "steps_per_s": 1.0, "vs_echo": 9.0, "vs_echo_f32": 9.0}]
    for wire, ratio in ratios.items():
        row = {"kind": "stream", "backend": "cuda", "batch": 1024, "wire": wire,
               "steps_per_s": steps}
        rows.append({**row, "error": "an actor died"} if ratio is None else
                    {**row, "vs_echo": ratio, "vs_echo_f32": ratio})
    return {"rows": rows}


def test_compare_runs_summarises_each_configuration(tmp_path):
    """benchmarks/compare_runs.py on hand-made runs: medians, ranges and the runs that met
    each goal (float32 ≥ 0.9 of its echo, 16-bit ≥ 1.8×; a failed cell did not), from the
    B = 1024 rows of the server's backend, from a file of runs and from bench.json files
    named by their folder; the PNG is written; bad input exits 2."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "compare_runs.py"
    runs = {"runs": [
        {"config": "A", "bench": _bench_doc({"float32": 0.8, "float16": 1.8}, 100)},
        {"config": "A", "bench": _bench_doc({"float32": 0.9, "float16": 1.79}, 400)},
        {"config": "A", "bench": _bench_doc({"float32": 1.6, "float16": None}, 200)}]}
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    (tmp_path / "B").mkdir()
    (tmp_path / "B" / "bench.json").write_text(json.dumps(_bench_doc({"bfloat16": 2.5}, 50)))
    png = tmp_path / "compare.png"
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "runs.json"),
                           str(tmp_path / "B" / "bench.json"), "--png", str(png)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in done.stdout.splitlines() if line.startswith(("| A", "| B"))}
    assert rows["A"] == ["3", "0.90 (0.80–1.60), 2 of 3, 200",
                         "1.79 (1.79–1.80), 1 of 3, 250", "—"]
    assert rows["B"] == ["1", "—", "—", "2.50 (2.50–2.50), 1 of 1, 50"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for name, text in (("empty.json", "{}"), ("rowless.json", '{"rows": [{"wire": 1}]}'),
                       ("no1024.json", json.dumps({"rows": _bench_doc({"float32": 1.0}, 1)[
                           "rows"][:3]}))):
        (tmp_path / name).write_text(text)
        bad = subprocess.run([sys.executable, str(script), str(tmp_path / name)],
                             capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and "compare_runs:" in bad.stderr, (name, bad.stderr)


def test_unary_latency_times_the_small_rpcs_beside_streaming_actors():
    """benchmarks/unary_latency.py with --stream-actors: a row per small rpc for both server
    models (figures not checked beyond being there) and the actors' steps/s for each."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "unary_latency.py"
    done = subprocess.run([sys.executable, str(script), "--stream-actors", "1",
                           "--seconds", "0.2"], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = re.findall(r"^\| (Act, B = 1|Act, B = 64|GetWeights|ReadISV|GetInfo) \| (\d+) / "
                      r"(\d+) \| (\d+) / (\d+) \| [+-]\d+ \|$", done.stdout, re.MULTILINE)
    assert len(rows) == 5, done.stdout
    for _, *figures in rows:
        p50, p99, front_p50, front_p99 = map(int, figures)
        assert 0 < p50 <= p99 and 0 < front_p50 <= front_p99
    streams = re.findall(r"^(one process|front process): the actors' TrainStream (\d+) steps/s$",
                         done.stdout, re.MULTILINE)
    assert [mode for mode, _ in streams] == ["one process", "front process"], done.stdout
    assert all(int(steps) > 0 for _, steps in streams)
    bad = subprocess.run([sys.executable, str(script), "--seconds", "0"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--seconds" in bad.stderr
