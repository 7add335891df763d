"""The ``duelq`` command: help, environment variables, exit codes, demo, serve."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from duelq.client import LearnerClient
from duelq.apps import cli
from duelq.server.core.config import LearnerConfig
from duelq.server.fronts import make_server
from duelq.server.server import LearnerServer, ServerOptions

from conftest import SMALL

SMALL_DEMO = ["--actors", "3", "--steps", "12", "--batch-size", "16", "--sync-every", "4"]


def test_help_lists_both_commands_and_every_knob(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0 and "{serve,demo,health,bench}" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    text = capsys.readouterr().out
    for f in dataclasses.fields(LearnerConfig) + dataclasses.fields(ServerOptions):
        assert cli.flag_name(f.name) in text and cli.env_name(f.name) in text
    assert "Learning rate" in text  # help comes from the field docstrings


def test_flags_read_environment_variables_and_the_command_line_wins(monkeypatch):
    monkeypatch.setenv("DUELQ_MAX_STREAMS", "7")
    monkeypatch.setenv("DUELQ_DOUBLE_DQN", "yes")
    monkeypatch.setenv("DUELQ_ISV_SLOTS", "a=1,b=2")
    monkeypatch.setenv("DUELQ_LR", "0.25")
    args = cli.build_parser().parse_args(["serve", "--lr", "0.5"])
    config = cli.from_args(LearnerConfig, args)
    assert cli.from_args(ServerOptions, args).max_streams == 7
    assert (config.double_dqn, config.isv_slots, config.lr) == (True, {"a": 1, "b": 2}, 0.5)


def test_front_processes_zero_serves_from_one_process(monkeypatch):
    """DUELQ_FRONT_PROCESSES=0 (or --front-processes 0) serves gRPC from the learner's own
    process; the flag wins over the variable."""
    monkeypatch.setenv("DUELQ_FRONT_PROCESSES", "8")
    args = cli.build_parser().parse_args(["serve", "--front-processes", "0"])
    options = cli.from_args(ServerOptions, args)
    assert options.front_processes == 0
    server = make_server(dataclasses.replace(options, port=0))
    assert type(server) is LearnerServer


@pytest.mark.parametrize("argv, env, message", [
    (["serve", "--lr", "-1"], {}, "--lr: must be > 0"),
    (["serve", "--max-streams", "9", "--max-rpcs", "9"], {}, "--max-rpcs: must exceed"),
    (["serve"], {"DUELQ_PORT": "http"}, "DUELQ_PORT='http'"),
    (["serve"], {"DUELQ_BACKEND": "gpu"}, "DUELQ_BACKEND='gpu': must be one of"),
    (["serve"], {"DUELQ_DOUBLE_DQN": "maybe"}, "DUELQ_DOUBLE_DQN"),
    (["demo", "--actors", "0"], {}, "--actors: must be ≥ 1"),
    (["--log-level", "LOUD", "serve"], {}, "unknown level"),
])
def test_bad_configuration_exits_2_naming_the_flag(monkeypatch, capsys, argv, env, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cli.main(argv) == cli.EXIT_USAGE
    assert message in capsys.readouterr().err


def test_demo_in_process_trains_summarises_and_plots(tmp_path, capsys):
    plot = tmp_path / "loss.png"
    code = cli.main(["demo", *SMALL_DEMO, "--backend", "reference", "--hidden-dim", "16",
                     "--plot", str(plot)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "backend reference" in out and "in-process server" in out
    assert re.search(r"36 steps, 576 transitions in [\d.]+ s \([\d,]+ transitions/s", out)
    assert "loss: first tenth" in out and "action entropy EMA" in out
    assert "server step 36, weights version 36" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_against_a_running_server_with_a_token(make_server, tmp_path, capsys):
    server = make_server(token="t0k")
    code = cli.main(["demo", *SMALL_DEMO, "--target", server.target, "--token", "t0k",
                     "--plot", str(tmp_path / "loss.png")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"server at {server.target}" in out and f"H={SMALL.hidden_dim}" in out
    assert server.learner.step_count == 36
    # a second demo's actors are new actors: their batches apply, none is taken for a retry
    assert cli.main(["demo", *SMALL_DEMO, "--target", server.target, "--token", "t0k",
                     "--plot", str(tmp_path / "loss2.png")]) == 0
    assert server.learner.step_count == 72


def test_demo_against_a_dead_target_says_connection_refused_without_waiting(dead_target):
    """No wait for readiness at a target where nothing listens: the client's own retries
    (about a second), then the refusal (were it to wait for --ready-timeout, the
    subprocess's generous limit would end the test)."""
    done = subprocess.run([sys.executable, "-m", "duelq.apps.cli", "demo", *SMALL_DEMO,
                           "--target", dead_target, "--ready-timeout", "3600"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == cli.EXIT_FAILURE
    assert f"learner at {dead_target} unavailable" in done.stdout
    assert "Connection refused" in done.stdout and "Traceback" not in done.stderr


def test_ctrl_c_stops_the_demo_with_a_partial_summary_and_plot(make_server, tmp_path):
    """SIGINT once steps are flowing: the actors finish their batches in flight, the
    summary (marked interrupted) and the plot still come, exit 130; the output is a
    pipe, so no progress bars (no carriage returns, no escape codes)."""
    server = make_server()
    plot = tmp_path / "loss.png"
    demo = subprocess.Popen(
        [sys.executable, "-m", "duelq.apps.cli", "demo", "--target", server.target,
         "--actors", "2", "--steps", "1000000", "--batch-size", "8", "--plot", str(plot)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while server.learner.step_count < 3:
            assert demo.poll() is None and time.monotonic() < deadline, demo.stderr.read()
            time.sleep(0.05)
        demo.send_signal(signal.SIGINT)
        out, err = demo.communicate(timeout=120)
    finally:
        if demo.poll() is None:
            demo.kill()
    assert demo.returncode == cli.EXIT_INTERRUPTED, err
    assert "(interrupted)" in out and "Traceback" not in err
    steps = int(re.search(r"× 1000000 batches of B=8: (\d+) steps", out).group(1))
    assert 3 <= steps == server.learner.step_count
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "\r" not in err and "\x1b[" not in err


def test_global_flags_go_before_or_after_the_command_and_version(capsys, server):
    parser = cli.build_parser()
    args = parser.parse_args(["serve", "--log-format", "json", "--log-level", "DEBUG"])
    assert (args.log_format, args.log_level) == ("json", "DEBUG")
    args = parser.parse_args(["--log-format", "json", "serve", "--log-level", "ERROR"])
    assert (args.log_format, args.log_level) == ("json", "ERROR")   # before, kept
    assert parser.parse_args(["--log-format", "json", "serve"]).log_format == "json"
    assert cli.main(["health", "--target", server.target, "--log-level", "WARNING"]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert re.fullmatch(r"duelq \S+\n", capsys.readouterr().out)


@pytest.mark.parametrize("command", ["serve", "demo", "bench", "health"])
def test_help_names_flags_not_fields_and_no_repository_files(command, capsys):
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    text = capsys.readouterr().out
    fields = {f.name for f in dataclasses.fields(LearnerConfig) + dataclasses.fields(ServerOptions)
              if "_" in f.name}
    assert "``" not in text
    assert not [name for name in fields if re.search(rf"(?<![-\w]){name}\b", text)]
    assert not re.search(r"[\w/]+\.(py|md|cu)\b", text)


def _serve(*argv: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "duelq.apps.cli", "serve", *argv],
                            stderr=subprocess.PIPE, text=True, env=env)


def _wait_for(process: subprocess.Popen, pattern: str, timeout: float = 30) -> re.Match:
    deadline, seen = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        line = process.stderr.readline()
        if not line and process.poll() is not None:
            break
        seen.append(line)
        if match := re.search(pattern, line):
            return match
    process.kill()
    raise AssertionError(f"no {pattern!r} in:\n{''.join(seen)}")


def test_serve_runs_until_sigterm_and_refuses_a_busy_port():
    server = _serve("--port", "0", "--backend", "reference", "--hidden-dim", "8",
                    "--grace-s", "1")
    try:
        port = int(_wait_for(server, r"listening on 127\.0\.0\.1:(\d+)").group(1))
        _wait_for(server, r"serving duelq\.v1\.Learner: backend reference")
        with LearnerClient(f"127.0.0.1:{port}") as client:
            client.wait_ready(timeout=10)
            assert client.info().hidden_dim == 8

        busy = _serve("--port", str(port), "--backend", "reference")
        assert busy.wait(30) == cli.EXIT_FAILURE
        assert "cannot listen on 127.0.0.1:" in busy.stderr.read()

        server.send_signal(signal.SIGTERM)
        assert server.wait(30) == cli.EXIT_OK
        assert "SIGTERM received" in server.stderr.read()
    finally:
        if server.poll() is None:
            server.kill()
